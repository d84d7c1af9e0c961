#!/usr/bin/env python3
"""The capture writer's ceiling on the CPU, inside a process that also runs a "scheduler" thread.

Inside SGLang the writer's threads (``hs_patch/server/writer.py``) share the scheduler process,
and its GIL, with SGLang's scheduler thread, which runs the forward pass's kernel launches and
the scheduling in Python. ``bench/capture_write.py`` runs the writer alone and overstates what it
does in the server (about 2x on the H200 host, issue #22). Here a thread stands in for SGLang's
scheduler: it holds the GIL for a fraction (``--gil``) of every 10 ms (SGLang's Python: scheduling,
kernel launches) and waits the rest with the GIL released (the GPU computing). Passes are handed
over as the hook does, at the engine's rate: a staging slot (``hs_patch.server.passes.Slot``,
allocated at start), waiting for a free one when all are busy (back-pressure), a ``PassRecord``
submitted to the writer. The planes "arrive" in the slot without CPU work, as the DMA engine puts
them there on a GPU host (the slots are filled with random bytes once); the fingerprints likewise.

``--hold ctypes`` (default) holds the GIL in a C call that sleeps (``usleep`` through
``ctypes.PyDLL``, which keeps the GIL), returning to the interpreter every 0.2 ms as bytecode does:
the GIL's effect without the scheduler eating a core, so a small shared machine measures the GIL
and not CPU contention. ``--hold python`` spins in bytecode (a core's worth of CPU, as on the host).

The engine offers ``--rate`` GB/s of states (0: as fast as the writer takes them: the ceiling).
Reported: GB/s of states from the first pass to the last manifest line (capture until written),
the engine's offered rate, their ratio, the forward's waits for a staging slot, the process's
CPU seconds per GB (the writer's threads; the ctypes scheduler uses next to none), and the **tail**:
seconds from the last pass handed over to the last sample written (the writer's latency at the end of
a burst, what the GPU sweep's 10-s rounds see; ``--whole K`` puts K whole requests of ``--tokens``
beside each chunk, as SGLang's passes mix a prompt's last chunk with short requests).

    python3 bench/writer_ceiling.py                                 # 1 request of 8192 tokens a pass
    python3 bench/writer_ceiling.py --gil 0,0.5,0.9 --rate 0 --writers 4,8
    python3 bench/writer_ceiling.py --chunks 4                      # prompts of 4 passes (written in place)
    python3 bench/writer_ceiling.py --chunks 2 --whole 2 --tokens 3072  # + 2 whole requests a pass: the tail
    python3 bench/writer_ceiling.py --code /path/to/other/checkout  # the writer of another checkout
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def import_hs_patch(code: str | None) -> None:
    sys.path.insert(0, str(Path(code).resolve() if code else ROOT))


class Scheduler:
    """A thread that holds the GIL for ``fraction`` of every ``period`` seconds, as SGLang's scheduler does."""

    def __init__(self, hold: str, fraction: float, period: float = 0.010):
        self.fraction, self.period = fraction, period
        self._usleep = ctypes.PyDLL(None).usleep if hold == "ctypes" else None
        if self._usleep is not None:
            self._usleep.argtypes = [ctypes.c_uint]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)

    def __enter__(self) -> "Scheduler":
        if self.fraction > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            end = time.perf_counter() + self.period * self.fraction
            x = 0
            while time.perf_counter() < end:
                if self._usleep is not None:
                    self._usleep(200)  # the GIL stays held; back in the interpreter every 0.2 ms
                else:
                    x += 1
            if self.fraction < 1:
                time.sleep(self.period * (1 - self.fraction))


def run(a: argparse.Namespace, directory: Path, writers: int, gil: float) -> dict:
    import torch

    try:
        from hs_patch.samples import store
    except ModuleNotFoundError as e:  # --code: a checkout from before the sample format had its room (#35 item 6)
        if e.name != "hs_patch.samples":
            raise
        from hs_patch import store
    from hs_patch.server import fingerprint
    from hs_patch.server.passes import Slot
    from hs_patch.server.writer import Writer

    layers = tuple(range(a.planes - 1))
    planes = store.plane_names(layers, "pre")
    streams = fingerprint.streams(layers, "pre")
    meta = {"format": store.FORMAT, "hidden_size": str(a.hidden), "planes": ",".join(planes),
            fingerprint.META: fingerprint.describe(streams), "sglang_release": "bench"}
    writer = Writer(directory, planes, meta, workers=writers)
    free: "queue.Queue[Slot]" = queue.Queue()
    g = torch.Generator().manual_seed(0)
    rows = a.tokens * (1 + a.whole)  # a pass: one prompt's chunk + ``--whole`` requests
    for _ in range(a.slots):
        slot = Slot(rows, len(planes), len(streams), a.hidden, 2, False)
        for k in range(len(planes)):  # what the DMA engine would have put there
            slot.plane(k, torch.empty(0, a.hidden, dtype=torch.bfloat16), rows).copy_(
                torch.randn(rows, a.hidden, generator=g))
        slot.fp.fill_(1.0)
        free.put(slot)
    state_bytes = rows * a.hidden * 2 * len(planes)  # a pass's states
    pass_s = state_bytes / (a.rate * 1e9) if a.rate else 0.0
    like = torch.empty(0, a.hidden, dtype=torch.bfloat16)
    with Scheduler(a.hold, gil):
        cpu0, t0 = time.process_time(), time.perf_counter()
        engine_s, waits, wait_s = feed(a, writer, free, like, planes, pass_s)
        handed = time.perf_counter()
        writer.close(timeout=3600)
        wall = time.perf_counter() - t0
        tail = time.perf_counter() - handed
        cpu = time.process_time() - cpu0
    entries = store.read_manifest(directory)
    samples = a.passes // a.chunks + a.passes * a.whole
    assert len(entries) == samples and writer.error is None, (len(entries), samples, writer.error)
    gb = a.passes * state_bytes / 1e9
    return {"writers": writers, "gil_fraction": gil, "rate_offered_GBps": a.rate or None,
            "GBps_written": round(gb / wall, 3), "ratio_to_offered": round(gb / wall / a.rate, 3) if a.rate else None,
            "engine_s": round(engine_s, 2), "wall_s": round(wall, 2), "tail_s": round(tail, 3), "waits": waits, "wait_s": round(wait_s, 2),
            "cpu_s_per_GB": round(cpu / gb, 3)}


def feed(a: argparse.Namespace, writer: Any, free: queue.Queue, like: Any, planes: list[str],
         pass_s: float) -> tuple[float, int, float]:
    """Hand ``a.passes`` passes to the writer at the engine's rate; (seconds, slot waits, seconds waited)."""
    import torch

    from hs_patch.server.writer import PassRecord

    waits, wait_s = 0, 0.0
    t0 = time.perf_counter()
    for n in range(a.passes):
        if pass_s:  # the GPU computing this pass (the scheduler thread holds the GIL meanwhile, in part)
            time.sleep(max(0.0, t0 + (n + 1) * pass_s - time.perf_counter()))
        try:
            slot = free.get_nowait()
        except queue.Empty:
            w = time.perf_counter()
            slot = free.get()
            waits, wait_s = waits + 1, wait_s + time.perf_counter() - w
        prompt, part = divmod(n, a.chunks)
        full, rows, t = a.tokens * a.chunks, a.tokens * (1 + a.whole), a.tokens
        slot.ids[:t].copy_(torch.arange(part * t, (part + 1) * t) + prompt * 10_000_000)
        for w in range(a.whole):  # whole requests, ids of their own
            slot.ids[t * (w + 1): t * (w + 2)].copy_(torch.arange(t) + (n * a.whole + w + 1) * 1_000_000_000)
        slot.lens[: 1 + a.whole] = torch.tensor([full] + [t] * a.whole, dtype=torch.int32)
        writer.submit(PassRecord(
            ids=slot.ids[:rows], planes=[slot.plane(k, like, rows) for k in range(len(planes))],
            seq_lens=[t] * (1 + a.whole), prefix_lens=[part * t] + [0] * a.whole, full_lens=slot.lens[: 1 + a.whole],
            rids=[f"r{prompt}"] + [f"w{n}-{w}" for w in range(a.whole)],
            release=lambda s=slot: free.put(s), fingerprints=slot.fp[:, :rows]))
    return time.perf_counter() - t0, waits, wait_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens a pass (one request a pass)")
    ap.add_argument("--chunks", type=int, default=1, help="passes a prompt (>1: written in place, chunk by chunk)")
    ap.add_argument("--whole", type=int, default=0, help="whole requests of --tokens beside each pass's chunk")
    ap.add_argument("--planes", type=int, default=5, help="captured planes (layers + final.pre_norm)")
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--passes", type=int, default=16)
    ap.add_argument("--slots", type=int, default=3)
    ap.add_argument("--writers", default="4", help="comma-separated writer thread counts")
    ap.add_argument("--gil", default="0,0.5,0.9", help="comma-separated fractions of the time the scheduler "
                    "thread holds the GIL")
    ap.add_argument("--rate", type=float, default=1.0, help="GB/s of states the engine offers (0: unlimited)")
    ap.add_argument("--hold", choices=("ctypes", "python"), default="ctypes")
    ap.add_argument("--reps", type=int, default=2, help="each setting this many times, settings alternating")
    ap.add_argument("--dir", default="/dev/shm/hs-bench-ceiling")
    ap.add_argument("--code", help="import hs_patch from this checkout instead (the writer before a change)")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    if a.passes % a.chunks:
        ap.error("--passes must be a multiple of --chunks")
    import_hs_patch(a.code)
    import torch

    torch.set_num_threads(1)
    settings = [(w, float(g)) for w in map(int, a.writers.split(",")) for g in a.gil.split(",")]
    rows: dict[tuple[int, float], list[dict]] = {s: [] for s in settings}
    root = Path(a.dir)
    for _ in range(a.reps):
        for w, g in settings:
            shutil.rmtree(root, ignore_errors=True)
            rows[(w, g)].append(run(a, root / "cap", w, g))
            print(json.dumps(rows[(w, g)][-1]), flush=True)
    shutil.rmtree(root, ignore_errors=True)
    out = {"shape": {k: getattr(a, k) for k in ("tokens", "chunks", "whole", "planes", "hidden", "passes", "slots", "rate",
                                                 "hold", "reps", "dir")},
           "code": a.code or str(ROOT), "cpus": os.cpu_count(), "load": os.getloadavg(), "runs": [
               {"writers": w, "gil_fraction": g, "median_GBps_written": statistics.median(r["GBps_written"] for r in rs),
                "median_cpu_s_per_GB": statistics.median(r["cpu_s_per_GB"] for r in rs),
                "median_tail_s": statistics.median(r["tail_s"] for r in rs),
                "waits": [r["waits"] for r in rs], "runs": rs} for (w, g), rs in rows.items()]}
    print(f"{a.passes} passes of {a.tokens} tokens x {a.planes} planes x {a.hidden} bf16 "
          f"({a.tokens * (1 + a.whole) * a.hidden * 2 * a.planes / 1e9:.2f} GB a pass), prompts of {a.chunks} "
          f"pass(es) + {a.whole} whole request(s) a pass, {a.slots} slots, engine offering {a.rate or 'unlimited'} GB/s, scheduler holding the GIL by {a.hold}; "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; code {out['code']}")
    print(f"{'writers':>8}{'GIL held':>10}{'GB/s written':>14}{'CPU s/GB':>10}{'tail s':>8}  waits")
    for r in out["runs"]:
        print(f"{r['writers']:8}{r['gil_fraction']:10.2f}{r['median_GBps_written']:14.2f}"
              f"{r['median_cpu_s_per_GB']:10.2f}{r['median_tail_s']:8.2f}  {r['waits']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
