#!/usr/bin/env python3
"""Capture + write throughput of the hook on the CPU, side by side with a plain memcpy to tmpfs.

Both sides move the same bytes into the same directory, one file per request:

- baseline: each request's states are already one contiguous buffer; one ``write()``
  per file (a memcpy into the page cache: the fastest any writer can be);
- hs_patch: the real hook path for prefill passes of REQUESTS x TOKENS tokens: the
  captured [T, H] planes are copied into the staging buffers (on a GPU host the DMA
  engine does this copy), split per request, written as safetensors in 1 MiB chunks, hashed
  with sha256 and recorded in the manifest by the background writer threads.

The fingerprints the hook takes of every captured tensor (issue #25) are GPU work on a GPU
host (one reduction per stream in the compute stream; 8 floats a row reach the host with the
planes). On the CPU the calling thread would compute them, at about 0.3 GB/s a stream, and
they would stand for the host's work here: by default their results are filled in instead
(``--cpu-fingerprints`` computes them on the CPU, for the record).

Prints the throughput of each and the ratio (target >= 0.5). Run:

    python3 bench/capture_write.py                       # 8 x 2048 tokens, 5 planes, hidden 7168
    python3 bench/capture_write.py --json out.json --passes 6 --writers 4
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hs_patch.samples import store  # noqa: E402
from hs_patch.server import config, fingerprint, hook  # noqa: E402


class _Mode:
    name = "EXTEND"


class _Batch:
    def __init__(self, lens: list[int]):
        self.forward_mode = _Mode()
        self.extend_seq_lens_cpu = lens
        self.extend_prefix_lens_cpu = [0] * len(lens)
        self.orig_seq_lens = list(lens)


def run_hook(directory: Path, ids: torch.Tensor, planes: list[torch.Tensor], lens: list[int], passes: int,
             writers: int, slots: int) -> float:
    layers = tuple(range(len(planes) - 1))
    cfg = config.CaptureConfig(enabled=True, directory=str(directory), layers=layers, final="pre",
                               slots=slots, slot_tokens=ids.shape[0], writers=writers)
    h = hook.CaptureHook(cfg, hidden_size=planes[0].shape[1], metadata={"sglang_release": "bench"})
    t0 = time.perf_counter()
    for n in range(passes):
        batch_ids = ids + n * 100_000  # distinct tokens, distinct samples
        p = h.begin(_Batch(lens), batch_ids)
        for i in layers:
            tee = p.collector(i, None)
            tee.append(planes[i])  # owned, as SGLang 0.5.16 hands it over
            tee.hs_attn_input(planes[i])  # what the layer's attention reads: fingerprinted only
        p.final_prenorm(planes[-1], owned=True)
        p.finish(planes[-1])
    h.close(timeout=600)
    dt = time.perf_counter() - t0
    assert len(store.read_manifest(directory)) == passes * len(lens), "every sample must be recorded"
    return dt


def run_baseline(directory: Path, blobs: list[bytes], passes: int) -> float:
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for n in range(passes):
        for j, blob in enumerate(blobs):
            with open(directory / f"{n}_{j}.bin", "wb") as f:
                f.write(blob)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per request")
    ap.add_argument("--planes", type=int, default=5, help="captured planes (layers + final)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--passes", type=int, default=4, help="prefill passes per repetition")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--writers", type=int, default=4)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--dir", default="/dev/shm/hs-bench")
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--cpu-fingerprints", action="store_true",
                    help="compute the hook's fingerprints on the CPU (GPU work on a GPU host; by default filled in)")
    a = ap.parse_args()
    if not a.cpu_fingerprints:  # what the GPU computes on a GPU host: only its result is the host's
        fingerprint.block_sums = lambda x, out=None: out.fill_(1.0)

    total = a.requests * a.tokens
    g = torch.Generator().manual_seed(0)
    planes = [torch.randn(total, a.hidden, generator=g).to(torch.bfloat16) for _ in range(a.planes)]
    ids = torch.arange(total, dtype=torch.int64)
    lens = [a.tokens] * a.requests
    state_bytes = total * a.planes * a.hidden * 2
    # baseline: the same bytes per request, already contiguous
    blobs = [b"".join(p[j * a.tokens:(j + 1) * a.tokens].view(torch.uint8).numpy().tobytes() for p in planes)
             for j in range(a.requests)]

    root = Path(a.dir)
    res: dict[str, list[float]] = {"baseline": [], "hs_patch": []}
    for _ in range(a.reps):
        for name in ("baseline", "hs_patch"):
            shutil.rmtree(root, ignore_errors=True)
            d = root / name
            dt = run_baseline(d, blobs, a.passes) if name == "baseline" else \
                run_hook(d, ids, planes, lens, a.passes, a.writers, a.slots)
            res[name].append(a.passes * state_bytes / dt / 1e9)
    shutil.rmtree(root, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in res.items()}
    out = {
        "shape": {"requests": a.requests, "tokens": a.tokens, "planes": a.planes, "hidden": a.hidden,
                  "dtype": "bf16", "passes": a.passes, "reps": a.reps, "writers": a.writers, "dir": a.dir},
        "cpus": os.cpu_count(), "GBps": res, "median_GBps": med, "ratio": med["hs_patch"] / med["baseline"],
        "cpu_fingerprints": a.cpu_fingerprints,
        "target": 0.5,
    }
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))
    print(f"{a.passes} passes x {a.requests} x {a.tokens} tokens x {a.planes} planes x {a.hidden} bf16 "
          f"({state_bytes / 1e9:.2f} GB a pass) into {a.dir}, {os.cpu_count()} CPUs, {a.reps} reps, fingerprints "
          f"{'computed on the CPU' if a.cpu_fingerprints else 'filled in (GPU work on a GPU host)'}")
    print(f"{'':24}{'median GB/s':>12}  runs")
    for k in ("baseline", "hs_patch"):
        print(f"{k:24}{med[k]:12.2f}  {', '.join(f'{x:.2f}' for x in res[k])}")
    print(f"ratio hs_patch / memcpy-to-tmpfs: {out['ratio']:.2f} (target >= 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
