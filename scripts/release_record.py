#!/usr/bin/env python3
"""Draft an SGLang release's entry for hs_patch/engine/releases.py from its own wheel (docs/adding-a-release.md).

    python3 scripts/release_record.py 0.5.24            # the entry, or why none of the known spellings fits
    python3 scripts/release_record.py 0.5.24 --wheel W  # a wheel already here (no download)

Downloads the wheel once into the tests' cache (the one the tests read: ~/.cache/hs-patch-tests/wheels,
or $HS_PATCH_TEST_CACHE/wheels), then, from its ``deepseek_v2.py``: the pristine sha256; which known
family and spelling (a known release's ``family`` and ``own``) has every anchor exactly once, and for
that one the line each anchor starts at, the patched file's sha256 and the regions' digests; from its
metadata the torch it pins, and from that torch's metadata on PyPI (pip, metadata only) the CUDA it is
built for. Prints the ``_r(...)`` line to paste into ``_ALL``. ``pip_overrides``, ``cudnn_min`` and
``replaces`` are not guessed: the guide says when a release needs one. Exit 1 when no known spelling
fits (then ``hs-patch status`` on the file says which anchors and regions differ).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hs_patch.engine.releases import RELEASES, TARGET, PatchError, Release, anchor_lines, apply_edits  # noqa: E402
from hs_patch.host.patching.nearest import nearest, region_digests  # noqa: E402

FAMILY_NAMES = {"layer-point": "LAYER_POINT", "communicator": "COMMUNICATOR", "layer-boundary": "LAYER_BOUNDARY"}


def spellings() -> list[Release]:
    """One known release per family and spelling, the newest first (a new release is most like the last)."""
    seen: dict[tuple, Release] = {}
    for r in reversed(list(RELEASES.values())):
        seen.setdefault((r.family.name, tuple(sorted(r.own.items()))), r)
    return list(seen.values())


def fit(version: str, text: str) -> tuple[Release, Release] | None:
    """(the new release's record, the known release whose family and spelling it takes), or None."""
    for like in spellings():
        candidate = replace(like, version=version, anchor_lines=(), pip_overrides=(), cudnn_min=0, replaces=())
        try:
            lines = anchor_lines(candidate, text)
        except PatchError:
            continue
        patched = hashlib.sha256(apply_edits(candidate, text).encode()).hexdigest()
        return replace(candidate, pristine_sha256=hashlib.sha256(text.encode()).hexdigest(), patched_sha256=patched,
                       anchor_lines=lines, regions=region_digests(text)), like
    return None


def pinned(wheel: Path, name: str) -> str:
    """The version the wheel's metadata pins ``name`` to (``Requires-Dist: torch==X``)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            m = re.match(rf"Requires-Dist: {re.escape(name)}==([\w.]+)\s*(;.*)?$", line)
            if m:
                return m.group(1)
    raise SystemExit(f"release_record: {wheel.name} pins no {name}==X; read its requirements by hand")


def cuda_of(torch: str) -> str:
    """The CUDA version of PyPI's Linux x86_64 torch wheel (its CUDA runtime pin), as the GPU host gets it."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "--isolated", "--dry-run", "--ignore-installed",
                        "--no-deps", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64", "--python-version",
                        "3.12", "--implementation", "cp", "--target", str(Path(tmp) / "t"), "--quiet", "--report",
                        str(report), f"torch=={torch}"], check=True)
        requires = json.loads(report.read_text())["install"][0]["metadata"].get("requires_dist", [])
    for r in requires:
        # torch 2.9: nvidia-cuda-runtime-cu12==12.8.90; from 2.11: cuda-toolkit[cublas,cudart,...]==13.0.2
        m = re.match(r"(?:nvidia-cuda-runtime(?:-cu\d+)?|cuda-toolkit(?:\[[^]]*\])?)==(\d+)\.(\d+)", r)
        if m:
            return f"{m.group(1)}.{m.group(2)}"
    raise SystemExit(f"release_record: torch {torch}'s metadata names no CUDA runtime; give --cuda X.Y")


def entry(r: Release, like: Release) -> str:
    from hs_patch.engine import releases

    name = next((n for n, v in vars(releases).items() if n.startswith("_") and v == dict(r.own)), None)
    own = "" if not r.own else f", own={name or f'<the spelling of {like.version}>'}"
    return (f'    _r("{r.version}", {FAMILY_NAMES[r.family.name]}, "{r.torch}", "{r.cuda}", "{r.pristine_sha256}",\n'
            f'       "{r.patched_sha256}", "{" ".join(r.regions)}",\n'
            f'       ({", ".join(map(str, r.anchor_lines))}){own}),')


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("version", help="the SGLang release, e.g. 0.5.24")
    ap.add_argument("--wheel", type=Path, help="its wheel, already downloaded")
    ap.add_argument("--cuda", help="torch's CUDA build (default: read from torch's metadata on PyPI)")
    a = ap.parse_args(argv)
    if a.wheel is None:
        from lab.sglang_wheels import sglang_wheel

        a.wheel = sglang_wheel(a.version)
    with zipfile.ZipFile(a.wheel) as z:
        text = z.read(TARGET).decode()
    sha = hashlib.sha256(text.encode()).hexdigest()
    same = [v for v, r in RELEASES.items() if r.pristine_sha256 == sha]
    found = fit(a.version, text)
    if found is None:
        near = nearest(text)
        print(f"release_record: no known family and spelling has every anchor of {a.version}'s {TARGET} exactly once "
              f"(sha256 {sha}).", file=sys.stderr)
        print("\n".join(near.lines()), file=sys.stderr)
        return 1
    r, like = found
    torch = pinned(a.wheel, "torch")
    r = replace(r, torch=torch, cuda=a.cuda or cuda_of(torch))
    print(f"# {a.version}: {r.family.name} family, spelled as {like.version}"
          + (f"; the same deepseek_v2.py as {', '.join(same)}" if same else "")
          + f"; torch {r.torch} (CUDA {r.cuda}). Add pip_overrides/cudnn_min/replaces where docs/adding-a-release.md "
          "says a release needs them.")
    print(entry(r, like))
    return 0


if __name__ == "__main__":
    sys.exit(main())
