#!/usr/bin/env python3
"""CPU cost of the fidelity check's row checks (issue #25) per GB of states, on the GPU host's CPUs.

Samples of Kimi-K2.5's width (hidden 7168, bf16) with the default capture (layer.2/30/58 and
both final planes: 5 planes, 23 fingerprint and 6 checksum streams) are written by the real capture hook and
writer (``lab.passes``: every plane, what each layer's attention read, the final norm's input
and output), whole or prefilled in chunks, then checked by the driver's own code
(``hs_patch.host.fidelity.rows.check_rows`` on the opened sample: the fingerprint tensor read
whole, finite and non-zero rows, every row's bytes against its checksum (the whole file read:
the part that grows with the states, issue #33), the additive relations on every row, and for
rows of every chunk the norm relations),
``--reps`` times each. Reported: CPU seconds (process time, one thread) per sample and per GB of
states, at each rows-per-chunk setting, side by side in one run. The same-pass top-1 (one row of
an fp32 lm_head) is not part of it: its cost is the production phase's ``kimi_head_cpu``.

    python3 bench/fidelity_check.py                                   # 2048 whole, 16384 in 8 chunks
    python3 bench/fidelity_check.py --rows 2,8,32 --shapes 2048x1,8192x4,16384x8 --reps 5 --json out.json
    python3 bench/fidelity_check.py --dtypes bf16,fp8 --rows 8 --reps 5      # fp8 samples (issue #35) beside bf16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

from hs_patch.host.fidelity.rows import Norms, check_rows  # noqa: E402
from hs_patch.host.model_files import rms_norm  # noqa: E402
from hs_patch.samples import lazy_sample, store  # noqa: E402
from hs_patch.server import config, hook  # noqa: E402
from lab.passes import Batch, play  # noqa: E402

HIDDEN, LAYERS = 7168, (2, 30, 58)


def write_sample(directory: Path, tokens: int, chunks: int, seed: int, dtype: str = "bf16") -> Path:
    """One sample of ``tokens`` tokens prefilled in ``chunks`` passes, through the real hook and writer, its planes
    stored as ``dtype`` (HS_CAPTURE_DTYPE: bf16, or fp8 quantized by the hook)."""
    step = -(-tokens // chunks)
    cfg = config.CaptureConfig(enabled=True, directory=str(directory), layers=LAYERS, final="both", slots=2,
                               slot_tokens=step, writers=2, dtype=dtype)
    h = hook.CaptureHook(cfg, hidden_size=HIDDEN, metadata={"sglang_release": "bench"})
    g = torch.Generator().manual_seed(seed)
    ids = torch.arange(tokens, dtype=torch.int64) + seed * 1_000_000
    try:
        for start in range(0, tokens, step):
            n = min(step, tokens - start)
            x = {i: (torch.randn(n, HIDDEN, generator=g) * (1 + i / 10)).to(torch.bfloat16) for i in LAYERS}
            pre = (torch.randn(n, HIDDEN, generator=g) * 8).to(torch.bfloat16)
            post = rms_norm(pre, torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-6)  # what the check's norms say
            play(h, Batch([n], [start], [tokens]), ids[start:start + n], x, pre, post)
    finally:
        h.close(600)
    (entry,) = store.read_manifest(directory).values()
    return directory / entry["file"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="2,8,32", help="rows per chunk to compare (the driver's --fidelity-rows)")
    ap.add_argument("--shapes", default="2048x1,16384x8", help="TOKENSxCHUNKS of the samples")
    ap.add_argument("--reps", type=int, default=5, help="checks of each sample at each setting")
    ap.add_argument("--dtypes", default="bf16", help="the stored planes' HS_CAPTURE_DTYPE, compared side by side "
                    "(bf16,fp8: the same states, one sample of each)")
    ap.add_argument("--dir", default="/dev/shm", help="where the samples are written (tmpfs, as in production)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    torch.set_num_threads(1)  # the driver checks several samples at once, one per worker thread
    norms = Norms.of({i: torch.ones(HIDDEN, dtype=torch.bfloat16) for i in LAYERS},
                     torch.ones(HIDDEN, dtype=torch.bfloat16), 1e-6)
    out = []
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="hs-bench-fidelity-") as tmp:
        for k, shape in enumerate(a.shapes.split(",")):
            tokens, chunks = (int(x) for x in shape.split("x"))
            paths = {d: write_sample(Path(tmp) / f"{shape}-{d}", tokens, chunks, k, d) for d in a.dtypes.split(",")}
            gb = tokens * HIDDEN * 2 * 5 / 1e9  # the states as the engine held them (bf16), whatever is stored
            for rows, dtype in ((int(r), d) for r in a.rows.split(",") for d in paths):
                t0 = time.process_time()
                for _ in range(a.reps):
                    with lazy_sample.open_sample(paths[dtype]) as s:
                        r = check_rows(s, norms, per_chunk=rows)
                cpu = (time.process_time() - t0) / a.reps
                assert r.ok, r.problems
                out.append({"dtype": dtype, "tokens": tokens, "chunks": chunks, "rows_per_chunk": rows,
                            "rows_checked": r.rows,
                            "GB_states": round(gb, 3), "cpu_ms_per_sample": round(cpu * 1000, 1),
                            "cpu_s_per_GB": round(cpu / gb, 4)})
                print(json.dumps(out[-1]), flush=True)
    print(f"\n{'dtype':>5} {'tokens':>7} {'chunks':>6} {'rows/chunk':>10} {'rows':>5} {'ms/sample':>10} {'CPU s/GB':>9}")
    for r in out:
        print(f"{r['dtype']:>5} {r['tokens']:>7} {r['chunks']:>6} {r['rows_per_chunk']:>10} {r['rows_checked']:>5} "
              f"{r['cpu_ms_per_sample']:>10} {r['cpu_s_per_GB']:>9}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
