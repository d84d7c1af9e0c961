#!/usr/bin/env python3
"""Export throughput and disk size: SpecForge, speculators bf16 and speculators fp8, side by side.

Writes SAMPLES finished samples of TOKENS tokens at hidden HIDDEN with the default capture
(layer.2/30/58 + final.pre_norm + final.post_norm, bf16), then exports them in each format
with ``--workers`` 1 (per-core figures) and with N workers, each into a fresh directory, in
one run. Reports per format: source GB read per second and per worker, output GB written
per second, and the export's bytes against the source's (both whole directories).

    python3 bench/export.py [--samples 8] [--tokens 1024] [--hidden 7168] [--workers 2] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from hs_patch.host.export.run import export  # noqa: E402
from hs_patch.host.export.spec import ExportSpec  # noqa: E402
from lab.sample_files import write_finished  # noqa: E402


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    ap.add_argument("--fsync", action="store_true", help="fsync every file (the CLI's default)")
    a = ap.parse_args()
    work = Path(a.dir or tempfile.mkdtemp(prefix="hs-bench-export-"))
    try:
        src = work / "src"
        for i in range(a.samples):
            ids = [(i * 7919 + j * 31) % 160000 for j in range(a.tokens)]
            write_finished(src, ids, hidden=a.hidden, seed=i, shipped=True)
        src_bytes = du(src)
        out = {"samples": a.samples, "tokens": a.tokens, "hidden": a.hidden, "source_bytes": src_bytes,
               "source_bytes_per_token": round(src_bytes / (a.samples * a.tokens), 1), "runs": []}
        for name, spec in (("specforge", ExportSpec("specforge")), ("speculators", ExportSpec("speculators")),
                           ("speculators-fp8", ExportSpec("speculators", fp8=True))):
            for workers in sorted({1, a.workers}):
                dst = work / f"{name}-w{workers}"
                t = time.perf_counter()
                s = export(src, dst, spec, workers=workers, fsync=a.fsync)
                sec = time.perf_counter() - t
                assert s.state == "complete", s.failed
                size = du(dst)
                out["runs"].append({"format": name, "workers": workers, "seconds": round(sec, 3),
                                    "read_GBps": round(src_bytes / sec / 1e9, 3),
                                    "read_GBps_per_worker": round(src_bytes / sec / 1e9 / workers, 3),
                                    "write_GBps": round(s.out_bytes / sec / 1e9, 3),
                                    "bytes": size, "bytes_per_token": round(size / (a.samples * a.tokens), 1),
                                    "size_vs_source": round(size / src_bytes, 3)})
                print(json.dumps(out["runs"][-1]), flush=True)
                if workers != max(1, a.workers) or name != "speculators-fp8":
                    shutil.rmtree(dst)
        print(json.dumps(out, indent=1))
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
