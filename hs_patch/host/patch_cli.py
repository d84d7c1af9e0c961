"""``hs-patch``: apply / verify / revert / status of the capture patch, and sample inspection."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from hs_patch import __version__
from hs_patch.server import config
from hs_patch.host import patcher
from hs_patch.releases import DEFAULT_RELEASE, RELEASES
from hs_patch.flags import REQUIRED_FLAGS, args_violations

EXIT_OK, EXIT_ERROR, EXIT_REFUSED, EXIT_VERIFY, EXIT_NOT_FOUND, EXIT_NOTHING = 0, 1, 2, 3, 4, 5

DESCRIPTION = f"""\
Patch an installed SGLang so that its DeepseekV2/V3 model (Kimi-K2.5, DeepSeek-V3) dumps
the hidden states it computes during prefill, for EAGLE-3 drafter training.

Supported SGLang releases: {", ".join(RELEASES)} (default pin {DEFAULT_RELEASE}); each is
recognised by the sha256 of its deepseek_v2.py. Anything else is refused unchanged.

exit codes: 0 ok, 1 error, 2 refused (nothing written), 3 verify failed (a sample damaged,
missing or unlisted, a manifest line unusable), 4 not found (inspect: no such path),
5 nothing to check (inspect: a directory without manifest.jsonl)
"""

INSPECT_HELP = """\
Validate a sample file, or a directory against its manifest.jsonl: the driver's samples
directory, the capture dir, or a shipped run at the destination (DEST, with samples/ and
manifest.jsonl). Every listed file must exist and match its entry; files the manifest
does not list and manifest lines without key/file/bytes/sha256 are reported (file:line).
A fleet run at the destination (RUN/HOST/ parts, each with its manifest; docs/fleet.md) is
checked as one merged run: a sample id in two parts is reported (extracted twice).

--deep (the default) reads every file: size + sha256 against the manifest, then the
tensors (format, planes, shapes, dtypes, the ids hash to the key); --workers files at a
time, with a progress bar. --quick reads only each file's size and safetensors header
(format, key, where the tensors end): a flipped byte inside the tensor data is NOT found
by --quick, only by --deep.
"""

CAPTURE_HELP = "capture is configured by environment variables of the SGLang server (read once at start):\n" + \
    "".join(f"  {name:27} (default {default}) {text}\n" for name, default, text in config.ENV_DOCS) + \
    "server flags it needs: --disable-radix-cache, and on 0.5.16+ --disable-prefill-cuda-graph\n"


def _site_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--site", metavar="DIR", help="directory that contains sglang/ (default: where this Python "
                   "finds sglang, without importing it)")
    p.add_argument("--json", action="store_true", help="print one JSON object (for Ansible changed_when)")


def _status(site: str | None, model: str | None = None) -> dict[str, Any]:
    t = patcher.inspect_target(site)
    try:
        capture: dict[str, Any] = config.from_env().as_dict()
    except config.ConfigError as e:
        capture = {"error": str(e)}
    release = t.release.version if t.release else None
    return {"action": "status", "release": release, "installed_version": t.installed_version,
            "state": t.state, "site": str(t.site), "files": [t.describe()],
            "backup": str(t.backup) if t.backup.exists() else None, "capture": capture,
            "required_server_flags": REQUIRED_FLAGS.get(release or "", []),
            "serving": _serving(capture.get("layers"), release or t.installed_version, model),
            "message": f"SGLang {release or t.installed_version or '?'}: {t.state}"}


def _check_args(site: str | None, release: str | None, args: list[str]) -> dict[str, Any]:
    """Check a server command line against the capture hook's rules (hs_patch.flags)."""
    if release is None:
        t = patcher.inspect_target(site)
        release = t.release.version if t.release else None
    problems = args_violations(args, release)
    return {"action": "check-args", "release": release, "problems": problems, "clean": not problems,
            "message": "server arguments compatible with capture" if not problems else
            "server arguments the capture hook cannot work with:\n  - " + "\n  - ".join(problems)}


def _serving(layers: Any, release: str | None, model: str | None) -> dict[str, Any]:
    """The drafter eagle_config that serves the captured layers on this release (hs_patch.serving)."""
    from hs_patch import serving

    if not layers or not release:
        return {}
    n, arch = None, ""
    if model:
        from hs_patch.host.model_files import ModelFileError, model_info

        try:
            info = model_info(model)
            n, arch = info.num_hidden_layers, info.architecture
        except ModelFileError as e:
            return {"error": str(e)}
    try:
        ids = serving.eagle_ids(release, list(layers), n, arch)
    except serving.NotServable as e:
        return {"release": release, "refused": str(e)}
    return {"release": release, "eagle_aux_hidden_state_layer_ids": ids, "checked_with_model": n is not None}


class _NotFound(Exception):
    pass


class _Nothing(Exception):
    pass


def _progress_bar(total_bytes: int, files: int) -> Any:
    """A rich progress bar on stderr (a plain line every few percent without rich or a terminal)."""
    try:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
        from rich.console import Console
    except ImportError:  # the host extra does not require rich
        return None
    return Progress(TextColumn(f"checking {files} samples"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True)


def _inspect(path: str, deep: bool, workers: int = 1, show_progress: bool = False) -> dict[str, Any]:
    try:
        from hs_patch import reader, store
    except ImportError as e:  # pragma: no cover - store imports only the standard library
        raise SystemExit(f"hs-patch inspect needs the host extra: pip install 'hs-patch[host]' ({e})")
    p = Path(path)
    if not p.exists():
        raise _NotFound(f"{p} does not exist")
    if p.is_dir():
        entries, _ = reader.manifest_entries(p)
        if entries is None:
            raise _Nothing(f"{p} has no {store.MANIFEST}: nothing to check against (not a samples directory, "
                           "or nothing was written there yet)")
        bar = _progress_bar(sum(e["bytes"] for e in entries.values()), len(entries)) if show_progress else None
        if bar is not None:
            with bar:
                task = bar.add_task("check", total=sum(e["bytes"] for e in entries.values()))
                rep = reader.check_dir(p, deep=deep, workers=workers, progress=lambda n: bar.advance(task, n))
        else:
            rep = reader.check_dir(p, deep=deep, workers=workers)
        return {"action": "inspect", "directory": str(p), "mode": "deep" if deep else "quick", "ok": len(rep.ok),
                "bad": rep.bad, "missing": rep.missing, "unlisted": rep.unlisted, "manifest_problems": rep.problems,
                "tokens": rep.tokens, "bytes": rep.nbytes, "clean": rep.clean,
                "message": f"{len(rep.ok)} ok, {len(rep.bad)} bad, {len(rep.missing)} missing, "
                           f"{len(rep.unlisted)} not in the manifest, {len(rep.problems)} unusable manifest lines "
                           f"({'sha256 + tensors' if deep else 'sizes + headers only'})"}
    entry = store.read_manifest(p.parent).get(p.name[: -len(store.SUFFIX)])
    s = reader.read_sample(p, entry=entry)
    shapes = {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in s.tensors.items()}
    return {"action": "inspect", "file": str(p), "key": s.key, "metadata": s.metadata, "tensors": shapes,
            "manifest_checked": entry is not None, "clean": True,
            "message": f"{s.key}: {s.metadata['num_tokens']} tokens, planes {s.metadata['planes']}"}


def _print(res: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(res, sort_keys=True))
        return
    print(res.get("message", ""))
    if res["action"] == "status":
        print(f"  file: {res['files'][0]['path']}\n  sha256: {res['files'][0]['sha256']}")
        print(f"  capture: {json.dumps(res['capture'])}")
        sv = res.get("serving") or {}
        if "eagle_aux_hidden_state_layer_ids" in sv:
            print(f"  drafter served on SGLang {sv['release']}: eagle_aux_hidden_state_layer_ids "
                  f"{sv['eagle_aux_hidden_state_layer_ids']} feed layers {list(res['capture']['layers'])}"
                  + ("" if sv["checked_with_model"] else " (give --model DIR to check against the model's depth)"))
        elif sv:
            print(f"  drafter serving: {sv.get('refused') or sv.get('error')}")
        if res["required_server_flags"]:
            print(f"  server flags needed with capture on: {' '.join(res['required_server_flags'])}")
    if res["action"] == "inspect":
        for k in ("manifest_problems", "bad", "missing", "unlisted"):
            for item in (res.get(k) or {}):
                print(f"  {k}: {item}{': ' + res[k][item] if isinstance(res[k], dict) else ''}")
        if "tensors" in res:
            for name, (shape, dtype) in res["tensors"].items():
                print(f"  {name}: {dtype} {shape}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hs-patch", description=DESCRIPTION, epilog=CAPTURE_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hs-patch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    actions: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "apply": lambda a: patcher.apply(a.site),
        "verify": lambda a: patcher.verify(a.site),
        "revert": lambda a: patcher.revert(a.site),
        "status": lambda a: _status(a.site, a.model),
        "inspect": lambda a: _inspect(a.path, not a.quick, a.workers, a.progress and not a.json),
        "check-args": lambda a: _check_args(a.site, a.release, a.args),
    }
    helps = {
        "apply": "patch deepseek_v2.py (idempotent; keeps the original for revert)",
        "verify": "exit 0 only if the patch is present, intact, compiles and sits where it must",
        "revert": "restore the byte-identical original (idempotent)",
        "status": "release, pristine/patched/unknown, capture configuration, required server flags",
        "inspect": "validate a sample file, or a samples directory or shipped run against its manifest",
        "check-args": "check SGLang server arguments against what capture needs and refuses (exit 2: refused)",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=INSPECT_HELP if name == "inspect" else text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == "check-args":
            _site_arg(p)
            p.add_argument("--release", help="the SGLang release the server runs (default: the installed one)")
            p.add_argument("args", nargs=argparse.REMAINDER, help="the server's arguments, after --")
        elif name == "inspect":
            p.add_argument("path", help="a sample .safetensors file or a directory with manifest.jsonl")
            depth = p.add_mutually_exclusive_group()
            depth.add_argument("--deep", action="store_true", help="read every file: sha256 + tensors (the default)")
            depth.add_argument("--quick", action="store_true", help="sizes and headers only; misses a flipped byte "
                               "in the tensor data")
            p.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), metavar="N",
                           help="files checked at a time (default: %(default)s)")
            p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty(),
                           help="a progress bar on stderr (default: when stderr is a terminal)")
            p.add_argument("--json", action="store_true", help="print one JSON object")
        else:
            _site_arg(p)
        if name == "status":
            p.add_argument("--model", metavar="DIR", help="the served model's directory: check the drafter's serving "
                           "ids against its depth and architecture")
    args = parser.parse_args(argv)
    if args.command == "check-args" and args.args[:1] == ["--"]:
        args.args = args.args[1:]
    if args.command == "inspect" and args.workers < 1:
        parser.error("--workers must be >= 1")
    os.umask(0o077)  # what we create is owner-only; the patched module keeps the original's mode (patcher)
    as_json = args.json
    try:
        res = actions[args.command](args)
    except patcher.Refused as e:
        return _fail(args.command, str(e), EXIT_REFUSED, as_json)
    except patcher.VerifyFailed as e:
        return _fail(args.command, str(e), EXIT_VERIFY, as_json)
    except _NotFound as e:
        return _fail(args.command, str(e), EXIT_NOT_FOUND, as_json)
    except _Nothing as e:
        return _fail(args.command, str(e), EXIT_NOTHING, as_json)
    except Exception as e:  # noqa: BLE001 - one line for the user, not a traceback
        kind = type(e).__name__
        return _fail(args.command, f"{kind}: {e}", EXIT_ERROR if kind != "SampleError" else EXIT_VERIFY, as_json)
    _print(res, as_json)
    if res["action"] == "check-args" and not res["clean"]:
        return EXIT_REFUSED
    return EXIT_OK if res.get("clean", True) else EXIT_VERIFY


def _fail(command: str, message: str, code: int, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"action": command, "changed": False, "error": message, "exit_code": code}))
    print(f"hs-patch {command}: {message}", file=sys.stderr)
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
