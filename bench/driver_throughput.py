#!/usr/bin/env python3
"""Driver throughput end to end against the stand-in server.

Part A (end to end): the stand-in server (tests/lab/standin_server.py: real patched forward +
capture hook on a tiny DeepseekV3, a subprocess) and the driver (in this process) run a
generated chat dataset at several concurrencies. Reports samples/s, tokens/s, MB/s of
final samples, and the driver's own CPU time per sample (what the driver costs on the
GPU host, independent of how slow the CPU stand-in model is).

What the driver costs per GB at Kimi-K2.5 size (adopting a sample the hook wrote):
bench/write_once.py part 2.

The driver's pipeline (issue #22): ``--settle-delay-ms D`` makes the stand-in's writer settle each
pass D ms later, one pass after another (a writer slower than the engine, as on the H200 at 8
layers), and ``--awaiting 0,32`` runs the driver with each: 0 is the driver before #22 (a request
kept its place at the server until its sample was adopted), 32 the default (the next request goes
once the server has answered).

    python3 bench/driver_throughput.py                      # defaults below, dirs on /dev/shm
    python3 bench/driver_throughput.py --samples 300 --concurrency 1,4,8 --json out.json
    python3 bench/driver_throughput.py --concurrency 8 --awaiting 0,32 --settle-delay-ms 60
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import requests  # noqa: E402
import torch  # noqa: E402

from hs_patch.host.driver.run import DriveConfig, Driver  # noqa: E402
from lab.drive_runs import standin_process  # noqa: E402
from lab.runcheck import assert_complete, write_chats  # noqa: E402
from lab.tiny_model import make_tiny_model_dir  # noqa: E402


def part_a(base: Path, samples: int, words: int, concurrencies: list[int], hidden: int, awaiting: list[int],
           settle_ms: float) -> list[dict]:
    model = make_tiny_model_dir(base / "model", hidden=hidden)
    data = base / "bench.jsonl"
    ids = write_chats(data, samples, words=words)
    out = []
    for conc, wait in [(c, w) for c in concurrencies for w in awaiting]:
        run = base / f"c{conc}-a{wait}"
        server, url = standin_process(model, run / "capture", base / "server.log", "--settle-delay-ms",
                                      str(settle_ms))
        try:
            cfg = DriveConfig(run=f"bench{conc}", data=[str(data)], model=str(model),
                              server=url, capture_dir=str(run / "capture"),
                              state_dir=str(run / "state"), samples_dir=str(run / "samples"), concurrency=conc,
                              awaiting=wait)
            cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            summary = Driver(cfg).run()
            wall = time.perf_counter() - t0
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            info = requests.get(f"{url}/get_server_info", timeout=5).json()
        finally:
            server.terminate()
            server.wait(30)
        assert summary.exit_code == 0, summary.message
        assert_complete(run / "samples", run / "capture", ids)
        st = summary.status
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        row = {"concurrency": conc, "awaiting": wait, "settle_delay_ms": settle_ms, "samples": samples,
               "wall_s": round(wall, 2),
               "samples_per_s": round(samples / wall, 1), "tokens_per_s": round(st["tokens"]["done_now"] / wall),
               "final_MB_per_s": round(st["bytes_written"] / wall / 1e6, 2),
               "tokens_per_sample": round(st["tokens"]["done_now"] / samples),
               "server_passes": info["passes"], "driver_cpu_ms_per_sample": round(1000 * cpu / samples, 2)}
        print(json.dumps(row), flush=True)
        out.append(row)
        shutil.rmtree(run)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm", help="where the temporary dirs go (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--words", type=int, default=60, help="words per turn of the generated chats")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the stand-in's tiny model")
    ap.add_argument("--awaiting", default="32", help="comma-separated hs-extract drive --awaiting values")
    ap.add_argument("--settle-delay-ms", type=float, default=0.0, help="the stand-in's writer settles each pass "
                    "this much later (a writer slower than the engine)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="hs-bench-driver-", dir=a.dir, ignore_cleanup_errors=True) as tmp:
        res = {"cpu_count": os.cpu_count(),
               "end_to_end": part_a(Path(tmp), a.samples, a.words, [int(x) for x in a.concurrency.split(",")],
                                    a.hidden, [int(x) for x in a.awaiting.split(",")], a.settle_delay_ms)}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
