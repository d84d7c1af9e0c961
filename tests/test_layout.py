"""The package is laid out by where its code runs, and the rules that keep the places apart hold.

The code every place shares is in two rooms, and the top of ``hs_patch/`` holds neither (only
``__init__``, ``names`` and ``shard``):

- ``hs_patch/samples/``: the sample format's code (``store``, ``reader``, ``lazy_sample``, ``intent``,
  ``files``);
- ``hs_patch/engine/``: what the project knows about SGLang (``releases``, ``families``, ``flags``,
  ``serving``, ``kv_cache``).

The places and their rules:

- ``hs_patch/server/`` runs inside the SGLang server process: it may import only the
  standard library, torch, SGLang itself (its settings readers) and its own subpackage,
  plus the shared standard-library-only modules (``SERVER_SHARED``: ``store``, ``files``, ``intent``;
  ``flags``, ``serving``, ``releases``, ``families``). Nothing heavy, so the forward pass never waits
  on an import and the server's environment stays SGLang's.
- ``hs_patch/control/`` (and ``fabfile.py``) runs on the control node: never torch,
  safetensors or transformers (a laptop with Ansible and Fabric only).
- The shared modules (both rooms, ``names``, ``shard``) import only the standard library at module
  level (``reader`` and ``lazy_sample`` are shared too: safetensors, and the server's ``fingerprint``
  and ``fp8`` tables, which are standard library only at module level).
- The patch's injected import names a module and function that exist.

``hs_patch/host/`` is in rooms by job (``driver/``, ``fidelity/``, ``readiness/``, ``patching/``,
``drafter/``, ``export/``, ``shipping/``, ``model/``); at its top only the two CLIs and ``model_files``:

- the driver is imported, outside its room, by the CLI and by two modules that truly need a
  piece of it: the fidelity check reads the server's ``/generate`` answer with
  ``driver.client``, and the shipper follows ``driver.runstate``'s file names (the driver's
  done marker, ``shipped.jsonl``), the contract between the two;
- the readiness checks are copied alone to the host by the services role and run there with
  the host's Python, without this package: the standard library only at module level, torch
  (and tvm-ffi) only inside the GPU checks, nothing of ours; a lone copy answers ``--help``
  under ``python3 -I -S`` (no site-packages);
- the control node (``hs_patch/control/``, ``fabfile.py``) imports only its own modules and the
  shared ones, never the host's or the server's.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from hs_patch.engine.releases import RELEASES

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "hs_patch"
STDLIB = set(sys.stdlib_module_names)
SAMPLES = ("files", "intent", "lazy_sample", "reader", "store")       # hs_patch/samples/: the sample format
ENGINE = ("families", "flags", "kv_cache", "releases", "serving")      # hs_patch/engine/: what we know of SGLang
ROOM_PACKAGES = ("hs_patch.engine", "hs_patch.samples")                # their __init__: a docstring only
SHARED = ("hs_patch.engine.families", "hs_patch.engine.flags", "hs_patch.engine.kv_cache", "hs_patch.engine.releases",
          "hs_patch.engine.serving", "hs_patch.names", "hs_patch.samples.files", "hs_patch.samples.intent",
          "hs_patch.samples.store", "hs_patch.shard")
# shared too, but they read with safetensors (and check the server's fingerprint and fp8 planes)
READERS = ("hs_patch.samples.lazy_sample", "hs_patch.samples.reader")
READERS_ALSO = ("safetensors", "hs_patch.server", "hs_patch.server.fingerprint", "hs_patch.server.fp8")
SERVER_SHARED = {"hs_patch", *ROOM_PACKAGES, "hs_patch.engine.families", "hs_patch.engine.flags",
                 "hs_patch.engine.releases", "hs_patch.engine.serving",
                 "hs_patch.samples.files", "hs_patch.samples.intent", "hs_patch.samples.store"}


def _names(node: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute module name) of what one import statement imports; none for any other node."""
    out = []
    if isinstance(node, ast.Import):
        out += [(node.lineno, a.name) for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        if node.module == "hs_patch":  # from hs_patch import shard -> hs_patch.shard
            out += [(node.lineno, f"hs_patch.{a.name}") for a in node.names if a.name != "__version__"]
        elif node.module.startswith("hs_patch."):  # from hs_patch.samples import store -> hs_patch.samples.store
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
            out.append((node.lineno, node.module))
        else:
            out.append((node.lineno, node.module))
    return out


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, at any depth (lazy ones too)."""
    return [name for node in ast.walk(ast.parse(path.read_text(), str(path))) for name in _names(node)]


def _module_level_imports(path: Path) -> list[tuple[int, str]]:
    """The imports that run when ``path`` is imported: not inside a function, nor under ``if TYPE_CHECKING``."""
    out: list[tuple[int, str]] = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                visit(node.orelse)
                continue
            out.extend(_names(node))
            visit(ast.iter_child_nodes(node))

    visit(ast.parse(path.read_text(), str(path)).body)
    return out


def _is_module(name: str) -> bool:
    return (PKG.parent / (name.replace(".", "/") + ".py")).is_file() or (PKG.parent / name.replace(".", "/")).is_dir()


ROOMS = ("drafter", "driver", "export", "fidelity", "model", "patching", "readiness", "shipping")
# outside the driver's room, who imports which of its modules, and why (the module docstring says it too)
DRIVER_USERS = {
    "hs_patch/host/extract_cli.py": {"cli", "snapshot"},    # hs-extract: the drive and snapshot subcommands
    "hs_patch/host/fidelity/check.py": {"client"},          # the server's /generate answer: generated token, top-1
    "hs_patch/host/shipping/batches.py": {"runstate"},      # the driver's done marker and shipped.jsonl's name
    # hs-extract accept reads held-out chats, renders prompts and calls /generate exactly as the driver does
    # (and reports the reader's unreadable-file error, datafile's, as the driver does)
    "hs_patch/host/drafter/accept.py": {"chat", "client", "dataset", "datafile"},
}
READINESS_LAZY = {"torch", "tvm_ffi"}  # imported inside the GPU checks only, by the venv's Python


def test_subpackages_are_the_places_code_runs():
    for sub in ("server", "host", "control", "samples", "engine", *(f"host/{room}" for room in ROOMS)):
        assert (PKG / sub / "__init__.py").is_file(), sub
    host = sorted(p.name for p in (PKG / "host").iterdir() if p.name != "__pycache__")
    assert host == sorted(["__init__.py", "extract_cli.py", "model_files.py", "patch_cli.py", *ROOMS]), \
        f"hs_patch/host/ holds its rooms, the two CLIs and model_files, nothing else: {host}"


def test_the_sample_format_and_what_we_know_of_sglang_each_have_their_room():
    """The sample format's code is in ``hs_patch/samples/``, what the project knows about SGLang in
    ``hs_patch/engine/`` (none of either at the top); at module level each imports only the standard library
    and the shared modules, ``reader`` and ``lazy_sample`` also safetensors and the server's fp8 and
    fingerprint tables."""
    top = sorted(p.stem for p in PKG.glob("*.py"))
    assert top == ["__init__", "names", "shard"], f"neither room's modules at the top of hs_patch/: {top}"
    for room, modules in (("samples", SAMPLES), ("engine", ENGINE)):
        held = sorted(p.name for p in (PKG / room).iterdir() if p.name != "__pycache__")
        assert held == sorted(["__init__.py", *(f"{m}.py" for m in modules)]), f"hs_patch/{room}/ holds {held}"
        assert not _imports(PKG / room / "__init__.py"), f"hs_patch/{room}/__init__.py imports nothing"
    bad = []
    for path in sorted((PKG / "samples").glob("*.py")) + sorted((PKG / "engine").glob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        also = (*READERS, *READERS_ALSO) if module in READERS else ()
        for line, name in _module_level_imports(path):
            if name.split(".")[0] in STDLIB or name in ("hs_patch", *ROOM_PACKAGES, *also) or any(
                    name == m or name.startswith(m + ".") for m in SHARED) or (
                    "safetensors" in also and name.startswith("safetensors.")) or (
                    name.startswith("hs_patch.") and not _is_module(name)):  # a name imported from a module
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not bad, "at module level, the standard library and the shared modules only:\n" + "\n".join(bad)


def test_only_the_cli_and_what_truly_needs_it_import_the_driver():
    bad = []
    for path in sorted((PKG / "host").rglob("*.py")) + sorted((PKG / "control").glob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel.startswith("hs_patch/host/driver/"):
            continue
        used = {name.split(".")[3] for _, name in _imports(path)
                if name.startswith("hs_patch.host.driver.") and _is_module(".".join(name.split(".")[:4]))}
        if not used <= DRIVER_USERS.get(rel, set()):
            bad.append(f"{rel}: hs_patch.host.driver.{sorted(used - DRIVER_USERS.get(rel, set()))}")
    assert not bad, "imports of the driver from outside its room (only the CLI and DRIVER_USERS):\n" + "\n".join(bad)


@pytest.mark.parametrize("script", sorted(p.name for p in (PKG / "host" / "readiness").glob("*.py")
                                          if p.name != "__init__.py"))
def test_readiness_scripts_run_alone_with_the_standard_library_only(script, tmp_path):
    path = PKG / "host" / "readiness" / script
    tree = ast.parse(path.read_text())
    top_level = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    for line, name in _imports(path):
        root = name.split(".")[0]
        assert root in STDLIB or root in READINESS_LAZY, f"{script}:{line}: {name} (the host runs it without it)"
    for node in top_level:
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        assert all(n.split(".")[0] in STDLIB for n in names), f"{script}:{node.lineno}: {names} at module level"
    lone = tmp_path / script   # as the services role installs it: one file in sglang_service_check_dir
    lone.write_bytes(path.read_bytes())
    out = subprocess.run([sys.executable, "-I", "-S", str(lone), "--help"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "usage:" in out.stdout, out.stderr
    tasks = (ROOT / "roles" / "sglang_service" / "tasks" / "main.yml").read_text()
    assert "hs_patch/host/readiness/{{ item }}" in tasks and script in tasks, "the services role copies it"


def test_the_control_node_imports_only_its_own_and_the_shared_modules():
    bad = []
    for path in sorted((PKG / "control").glob("*.py")) + [ROOT / "fabfile.py"]:
        for line, name in _imports(path):
            if name.startswith("hs_patch") and not (name.startswith("hs_patch.control") or name == "hs_patch"
                                                    or name in ROOM_PACKAGES
                                                    or any(name == m or name.startswith(m + ".") for m in SHARED)):
                bad.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not bad, "the control node has neither the host's nor the server's code:\n" + "\n".join(bad)


def test_server_code_imports_only_stdlib_torch_sglang_and_its_own_subpackage():
    bad = []
    for path in sorted((PKG / "server").glob("*.py")):
        for line, name in _imports(path):
            top = name.split(".")[0]
            if top in STDLIB or top in ("torch", "sglang"):
                continue
            if name.startswith("hs_patch.server") or name in SERVER_SHARED or (
                    name.startswith("hs_patch.") and not _is_module(name)):  # a name imported from a module
                continue
            bad.append(f"{path.relative_to(ROOT)}:{line}: {name}")
    assert not bad, "imports the SGLang server must not load:\n" + "\n".join(bad)


def _new_modules(code: str, before: str = "") -> set[str]:
    script = (f"import sys\n{before}\nold = set(sys.modules)\n{code}\n"
              "print('\\n'.join(sorted(set(sys.modules) - old)))")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(out.stdout.split())


def test_importing_the_hook_in_the_server_loads_nothing_beyond_stdlib_and_our_server_modules():
    """What ``from hs_patch.server.hook import attach`` (the patch's import) adds to a process that has torch."""
    new = _new_modules("import hs_patch.server.hook, hs_patch.server.writer, hs_patch.server.config, "
                       "hs_patch.server.checks", before="import torch")
    foreign = sorted(m for m in new if m.split(".")[0] not in STDLIB and not m.startswith("hs_patch"))
    ours = sorted(m for m in new if m.startswith("hs_patch") and not m.startswith("hs_patch.server")
                  and m not in SERVER_SHARED)
    assert not foreign and not ours, f"loaded into the server: {foreign + ours}"


BLOCK_HEAVY = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'safetensors', 'transformers', 'numpy'):
            raise ImportError(f'the control node must not import {name}')
sys.meta_path.insert(0, Block())
"""


def test_control_node_never_imports_torch():
    mods = sorted(f"hs_patch.control.{p.stem}" for p in (PKG / "control").glob("*.py") if p.stem != "__init__")
    new = _new_modules("import " + ", ".join(mods) + "\nimport fabfile", before=BLOCK_HEAVY)
    assert not {m for m in new if m.split(".")[0] in ("torch", "safetensors", "transformers")}


def test_shared_modules_import_only_the_standard_library():
    for mod in SHARED:
        new = _new_modules(f"import {mod}", before=BLOCK_HEAVY)
        assert all(m.split(".")[0] in STDLIB or m == "hs_patch" or m in ROOM_PACKAGES or m in SHARED
                   for m in new), (mod, new)


@pytest.mark.parametrize("version", sorted(RELEASES))
def test_the_patch_imports_a_function_that_exists(version):
    text = "".join(e.replacement for e in RELEASES[version].edits)
    tree = ast.parse("\n".join(line.strip() for line in text.splitlines() if line.strip().startswith("from ")))
    (imp,) = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    module = __import__(imp.module, fromlist=["_"])
    assert all(hasattr(module, a.name) for a in imp.names), (imp.module, [a.name for a in imp.names])


def test_no_module_is_much_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in PKG.rglob("*.py") if (n := len(p.read_text().splitlines())) > 420}
    assert not long, f"split these by what they do: {long}"
