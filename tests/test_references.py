"""Every pointer a reader may follow resolves: the repository paths, sections, test names and
``hs_patch.*`` names that docs, playbooks, roles, group_vars, scripts and code comments cite;
and the stack each SGLang release runs on is written the same in the inventory and in
``hs_patch/engine/releases.py``."""

from __future__ import annotations

import ast
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import yaml

from hs_patch.engine.releases import RELEASES

ROOT = Path(__file__).resolve().parents[1]
TEXT = (".md", ".yml", ".yaml", ".j2", ".py", ".sh", ".cfg", ".toml", ".txt")
ROOTS = ("hs_patch", "tests", "docs", "roles", "playbooks", "inventory", "molecule", "scripts", "bench", "examples")
# a path from the repository's root, globs allowed (one going on into a placeholder, host_vars/<host>.yml, is skipped)
PATH = re.compile(r"(?<![\w/.${}-])((?:" + "|".join(ROOTS) + r")/[\w./*-]*[\w*])(::\w+)?")
SECTION = re.compile(r"`?([\w./-]+\.md)`?, \"([^\"]+)\"")
NUMBERED = re.compile(r"`?([\w./-]+\.md)`? section (\d+)\b")
ANCHOR = re.compile(r"\]\(([\w./-]*\.md)?#([\w-]+)\)")
DOTTED = re.compile(r"(?<![\w.])hs_patch(?:\.\w+)+(?![\w/])")   # not the format's name, hs_patch.sample/2
# names that are gone on purpose and still cited where their old files are recognised
GONE = {"hs_patch.hook": "0.1.0's hook, which a file patched by that release imports (releases.py, patcher.py)"}


def _sources() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / f for f in out if f.endswith(TEXT) and not f.startswith("bench/results/") and (ROOT / f).is_file()]


SOURCES = _sources()


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@lru_cache(maxsize=None)
def _headings(md: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in md.read_text().splitlines() if line.startswith("#")]


def _md(name: str, where: Path) -> Path:
    """A cited markdown file: relative to the citing file's folder, else to the repository."""
    return where.parent / name if (where.parent / name).is_file() else ROOT / name


@lru_cache(maxsize=None)
def _top_names(py: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(py.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _dotted_resolves(name: str) -> bool:
    """The dotted name is a module, or a name defined at the top of its longest module prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        module = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
        if module.is_file():
            return i == len(parts) or parts[i] in _top_names(module) or (base.is_dir() and (base / parts[i]).exists())
    return False


def _dangling(source: Path) -> list[str]:
    """What ``source`` cites that is not there."""
    text = source.read_text(errors="replace")
    bad = []
    for m in PATH.finditer(text):
        path, test, after = m.group(1).rstrip("."), m.group(2), text[m.end():m.end() + 40]
        if after.startswith(("/<", "/{")):
            continue
        if after.startswith(".{") and "}" in after:   # results.{json,log}
            exts = after[2:after.index("}")].split(",")
            bad += [f"{path}.{e}: no such file" for e in exts if not (ROOT / f"{path}.{e}").exists()]
            continue
        target = ROOT / path
        if "*" in path:
            if not list(ROOT.glob(path)):
                bad.append(f"{path}: matches nothing")
        elif not target.exists():
            bad.append(f"{path}: no such file or folder")
        elif test and target.suffix == ".py" and test[2:] not in _top_names(target):
            bad.append(f"{path}{test}: no such test there")
    for m in SECTION.finditer(text):
        md = _md(m.group(1), source)
        if not md.is_file() or not any(h.startswith(m.group(2)) for h in _headings(md)):
            bad.append(f'{m.group(1)}, "{m.group(2)}": no such section')
    for m in NUMBERED.finditer(text):
        md = _md(m.group(1), source)
        if not md.is_file() or not any(h.startswith(m.group(2) + ".") for h in _headings(md)):
            bad.append(f"{m.group(1)} section {m.group(2)}: no such section")
    for m in ANCHOR.finditer(text):
        md = _md(m.group(1), source) if m.group(1) else source
        if md.suffix == ".md" and (not md.is_file() or m.group(2) not in {_slug(h) for h in _headings(md)}):
            bad.append(f"{m.group(1) or ''}#{m.group(2)}: no such heading")
    for m in DOTTED.finditer(text):
        if m.group(0) not in GONE and not _dotted_resolves(m.group(0).rstrip(".")):
            bad.append(f"{m.group(0)}: no such module or name")
    return sorted(set(bad))


def test_every_cited_path_section_and_name_resolves():
    assert len(SOURCES) > 200, "git ls-files found the sources"
    bad = {_rel(s): found for s in SOURCES if (found := _dangling(s))}
    assert not bad, "pointers at what is not there:\n" + "\n".join(f"{f}: {x}" for f, xs in bad.items() for x in xs)


def test_the_inventory_runs_each_release_on_the_stack_releases_py_names():
    knobs = yaml.safe_load((ROOT / "inventory/group_vars/gpu_hosts.yml").read_text())
    stacks = knobs["hs_sglang_releases"]
    role = yaml.safe_load((ROOT / "roles/sglang/meta/argument_specs.yml").read_text())
    role_default = role["argument_specs"]["main"]["options"]["sglang_supported_versions"]["default"]
    assert knobs["hs_sglang_supported_versions"] == "{{ hs_sglang_releases | list }}"
    assert list(stacks) == list(RELEASES) == role_default, ("hs_sglang_releases, the sglang role's supported versions "
                                                           "and hs_patch/engine/releases.py name the same releases")
    for version, r in RELEASES.items():
        s = stacks[version]
        assert (s["torch"], s["cuda"], tuple(s["pip_overrides"]), s["cudnn_min"], tuple(s["replaces"])) == \
            (r.torch, r.cuda, r.pip_overrides, r.cudnn_min, r.replaces), version
        cudnn = [p for p in r.pip_overrides if p.startswith("nvidia-cudnn")]
        if cudnn:  # the override must bring at least the cuDNN the release then checks for
            major, minor, *_ = cudnn[0].split("==")[1].split(".")
            assert 0 < s["cudnn_min"] <= int(major) * 10000 + int(minor) * 100, version
        else:
            assert s["cudnn_min"] == 0, f"{version}: a cuDNN minimum without an override that brings it"
