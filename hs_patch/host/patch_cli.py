"""``hs-patch``: apply / verify / revert / status of the capture patch, and sample inspection."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from hs_patch import __version__
from hs_patch.engine.releases import DEFAULT_RELEASE, RELEASES
from hs_patch.samples.files import quiet_when_stdout_closes
from hs_patch.server import config
from hs_patch.host.patching import hook_check, inspection, patcher, status

EXIT_OK, EXIT_ERROR, EXIT_REFUSED, EXIT_VERIFY, EXIT_NOT_FOUND, EXIT_NOTHING = 0, 1, 2, 3, 4, 5

DESCRIPTION = f"""\
Patch an installed SGLang so that its DeepseekV2/V3 model (Kimi-K2.5, DeepSeek-V3) dumps
the hidden states it computes during prefill, for EAGLE-3 drafter training.

Supported SGLang releases: {", ".join(RELEASES)} (default pin {DEFAULT_RELEASE}); each is
recognised by the sha256 of its deepseek_v2.py. Anything else is refused unchanged; for such
a file, status names the nearest known release and shows what differs where the patch works.

exit codes: 0 ok, 1 error, 2 refused (nothing written), 3 verify failed (a sample damaged,
missing or unlisted, a manifest line unusable), 4 not found (inspect: no such path),
5 nothing to check (inspect: a directory without manifest.jsonl), 141 stdout closed early
(a pipe into head: the rest of the output is dropped quietly)
"""

CAPTURE_HELP = "capture is configured by environment variables of the SGLang server (read once at start):\n" + \
    "".join(f"  {name:27} (default {default}) {text}\n" for name, default, text in config.ENV_DOCS) + \
    "server flags it needs: --disable-radix-cache; on 0.5.10 .. 0.5.13.post1 --disable-piecewise-cuda-graph, on\n" + \
    "  0.5.14 and later --disable-prefill-cuda-graph (status prints the installed release's)\n"


def _site_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--site", metavar="DIR", help="directory that contains sglang/ (default: where this Python "
                   "finds sglang, without importing it)")
    p.add_argument("--json", action="store_true", help="print one JSON object (for Ansible changed_when)")


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
                  f"{sv['eagle_aux_hidden_state_layer_ids']} feed layers "
                  f"{sv.get('layers_default') or list(res['capture']['layers'])}"
                  + ("" if sv["checked_with_model"] else " (give --model DIR to check against the model's depth)"))
        elif sv:
            print(f"  drafter serving: {sv.get('refused') or sv.get('error') or sv.get('note')}")
        if res["required_server_flags"]:
            print(f"  server flags needed with capture on: {' '.join(res['required_server_flags'])}")
    if res["action"] == "inspect":
        for k in ("manifest_problems", "bad", "missing", "unlisted"):
            for item in (res.get(k) or {}):
                print(f"  {k}: {item}{': ' + res[k][item] if isinstance(res[k], dict) else ''}")
        if "tensors" in res:
            for name, (shape, dtype) in res["tensors"].items():
                print(f"  {name}: {dtype} {shape}")


@quiet_when_stdout_closes
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hs-patch", description=DESCRIPTION, epilog=CAPTURE_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hs-patch {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    actions: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
        "apply": lambda a: patcher.apply(a.site),
        "verify": lambda a: patcher.verify(a.site),
        "revert": lambda a: patcher.revert(a.site),
        "status": lambda a: status.status(a.site, a.model),
        "inspect": lambda a: inspection.inspect(a.path, not a.quick, a.workers, a.progress and not a.json),
        "check-args": lambda a: status.check_args(a.site, a.release, a.args),
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
        p = sub.add_parser(name, help=text, description=inspection.HELP if name == "inspect" else text,
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
    except hook_check.VerifyFailed as e:
        return _fail(args.command, str(e), EXIT_VERIFY, as_json)
    except inspection.NotFound as e:
        return _fail(args.command, str(e), EXIT_NOT_FOUND, as_json)
    except inspection.Nothing as e:
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
