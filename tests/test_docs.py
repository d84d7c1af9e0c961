"""The docs stay true to the code: generated tables current, every setting described once and
distinctly, the README a short front door whose links resolve, help texts readable."""

from __future__ import annotations

import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gen_docs  # noqa: E402


def _all_settings() -> list[tuple[str, object, str]]:
    rows = gen_docs.knobs() + gen_docs.capture_env()
    for role in gen_docs.roles():
        rows += gen_docs.role_variables(role)
    return rows


def test_generated_tables_and_defaults_match_the_code():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts/gen_docs.py"), "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr


def test_every_setting_has_its_own_description():
    rows = _all_settings()
    missing = [n for n, _, d in rows if len(d.split()) < 3]
    assert not missing, f"describe these where they are defined: {missing}"
    counts = Counter(" ".join(d.split()) for _, _, d in rows)
    shared = sorted(n for n, _, d in rows if counts[" ".join(d.split())] > 1)
    assert not shared, f"these share one description; each needs its own: {shared}"


def test_deployment_doc_lists_every_variable_with_its_default():
    doc = (ROOT / "docs/deployment.md").read_text()
    cells = [re.split(r"(?<!\\)\|", line) for line in doc.splitlines() if line.startswith("| `")]  # "\|" is text
    rows = {c[1].strip().strip("`"): c[2].strip() for c in cells}
    knobs = yaml.safe_load((ROOT / "inventory/group_vars/gpu_hosts.yml").read_text())
    for role in gen_docs.roles():
        knobs.update(yaml.safe_load((ROOT / "roles" / role / "defaults/main.yml").read_text()))
    for name, default in knobs.items():
        assert name in rows, f"docs/deployment.md does not list {name}"
        shown = rows[name].strip("`")
        expected = gen_docs._fmt_default(default)  # a long mapping is summarised: its entries are tabled elsewhere
        assert shown == expected, f"docs/deployment.md shows {name} = {shown}, the code has {expected}"


def test_readme_is_a_short_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    assert "sudo " not in readme, "the scripts check for root themselves; a root machine may have no sudo"
    for heading in ("## Install", "## Test", "## Try it", "## Run an extraction", "## Supported SGLang releases"):
        assert heading in readme, heading


def test_ci_runs_exactly_the_readmes_install_and_test_commands_and_the_demo_comes_first():
    """On a stock Debian 12 or Ubuntu 24.04 the README's `python3 -m pip install ...` failed with
    "externally-managed-environment" (PEP 668): the install makes a venv, the test command runs it."""
    readme = (ROOT / "README.md").read_text()

    def block(heading: str) -> str:
        section = readme[readme.index(heading):]
        return section.split("```\n", 2)[1].strip()

    install, test = block("## Install"), block("## Test")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert ci == [install, test], (ci, install, test)
    assert test.startswith(".venv/bin/python -m pytest") and install == "bash scripts/install.sh"
    assert readme.index("## Try it") < readme.index("## Test"), "the 5-minute demo before the half-hour suite"
    assert block("## Try it").startswith(".venv/bin/python tests/lab/demo.py")


@pytest.mark.parametrize("doc", sorted(str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]))
def test_links_resolve(doc):
    path = ROOT / doc
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" in target:
            continue
        assert (path.parent / target).exists(), f"{doc} links to {target}, which does not exist"


@pytest.mark.parametrize("argv", [["hs_patch.host.patch_cli", "--help"], ["hs_patch.host.extract_cli", "--help"],
                                  ["hs_patch.host.extract_cli", "drive", "--help"],
                                  ["hs_patch.host.extract_cli", "ship", "--help"],
                                  ["hs_patch.host.extract_cli", "snapshot", "--help"]])
def test_help_texts_have_no_raw_markup(argv):
    out = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "``" not in out.stdout and ":mod:" not in out.stdout and ":class:" not in out.stdout, out.stdout


def _help_options(argv: list[str]) -> set[str]:
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, (argv, out.stderr)
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", out.stdout)) | {"-h", "--help"}


def test_every_option_the_docs_give_a_command_is_one_it_takes():
    """An operator copies the commands of README and docs/ as they stand: each option written after `fab TASK`,
    `hs-extract SUB`, `hs-patch SUB` or `hs-model SUB` on one line must be one that command's --help lists."""
    from hs_patch.host.extract_cli import build_parser

    py = [sys.executable, "-m"]
    extract_subs = next(a for a in build_parser()._actions if a.dest == "command").choices
    commands = {"hs-extract": {s: py + ["hs_patch.host.extract_cli", s, "--help"] for s in extract_subs},
                "hs-patch": {s: py + ["hs_patch.host.patch_cli", s, "--help"]
                             for s in ("apply", "verify", "revert", "status", "inspect", "check-args")},
                "hs-model": {s: py + ["hs_patch.host.model.cli", s, "--help"] for s in ("fetch", "verify")},
                "fab": {t: [str(Path(sys.executable).parent / "fab"), "--help", t]
                        for t in ("extract", "status", "stop", "ship", "verify")}}
    known: dict[tuple[str, str], set[str]] = {}
    wrong = []
    use = re.compile(r"\b(hs-extract|hs-patch|hs-model|fab)\s+(?:--help\s+)?([a-z][a-z-]*)([^`\n|]*)")
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for tool, sub, rest in use.findall(line):
                if sub not in commands[tool]:
                    continue  # prose ("fab names the unit ..."), not a command
                if (tool, sub) not in known:
                    known[tool, sub] = _help_options(commands[tool][sub])
                for opt in re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)(?=[\s=\]`,;.)]|$)", rest):
                    if opt not in known[tool, sub] and not opt.startswith("--no-"):
                        wrong.append(f"{doc.relative_to(ROOT)}:{n}: {tool} {sub} takes no {opt}")
    assert not wrong, "\n".join(wrong)
