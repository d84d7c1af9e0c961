#!/usr/bin/env python3
"""Driver + store throughput against the stand-in server, and the finalize step at Kimi size.

Part A (end to end): the stand-in server (tests/standin_server.py: real patched forward +
capture hook on a tiny DeepseekV3, a subprocess) and the driver (in this process) run a
generated chat dataset at several concurrencies. Reports samples/s, tokens/s, MB/s of
final samples, and the driver's own CPU time per sample (what the driver costs on the
GPU host, independent of how slow the CPU stand-in model is).

Part B (finalize at Kimi-K2.5 size): raw samples written by the real hook writer
(hidden 7168, 4 planes, bf16) in a capture dir, then the driver's finalize (verify the
raw file's sha256 and tensors, add the loss mask, write the final file atomically with
its sha256, manifest lines, remove the raw file) with 1..N threads. Reports GB/s and
tokens/s: the rate the driver can keep up with per host.

    python3 bench/driver_throughput.py                      # defaults below, dirs on /dev/shm
    python3 bench/driver_throughput.py --samples 300 --concurrency 1,4,8 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import requests  # noqa: E402
import torch  # noqa: E402

from hs_patch.server import config, hook  # noqa: E402
from hs_patch import store  # noqa: E402
from hs_patch.host.capture_dir import CaptureWatcher  # noqa: E402
from hs_patch.host.driver import DriveConfig, Driver  # noqa: E402
from hs_patch.host.finalize import finalize  # noqa: E402
from runcheck import assert_complete, write_chats  # noqa: E402
from tiny_model import make_tiny_model_dir  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_a(base: Path, samples: int, words: int, concurrencies: list[int], hidden: int) -> list[dict]:
    model = make_tiny_model_dir(base / "model", hidden=hidden)
    data = base / "bench.jsonl"
    ids = write_chats(data, samples, words=words)
    out = []
    for conc in concurrencies:
        run = base / f"c{conc}"
        port = free_port()
        server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "standin_server.py"), "--model", str(model),
                                   "--port", str(port), "--capture-dir", str(run / "capture"), "--threads", "1"],
                                  stdout=open(base / "server.log", "ab"), stderr=subprocess.STDOUT)
        try:
            for _ in range(300):
                try:
                    if requests.get(f"http://127.0.0.1:{port}/get_server_info", timeout=1).ok:
                        break
                except requests.RequestException:
                    time.sleep(0.2)
            cfg = DriveConfig(run=f"bench{conc}", data=[str(data)], model=str(model),
                              server=f"http://127.0.0.1:{port}", capture_dir=str(run / "capture"),
                              state_dir=str(run / "state"), samples_dir=str(run / "samples"), concurrency=conc)
            cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            summary = Driver(cfg).run()
            wall = time.perf_counter() - t0
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            info = requests.get(f"http://127.0.0.1:{port}/get_server_info", timeout=5).json()
        finally:
            server.terminate()
            server.wait(30)
        assert summary.exit_code == 0, summary.message
        assert_complete(run / "samples", run / "capture", ids)
        st = summary.status
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        row = {"concurrency": conc, "samples": samples, "wall_s": round(wall, 2),
               "samples_per_s": round(samples / wall, 1), "tokens_per_s": round(st["tokens"]["done_now"] / wall),
               "final_MB_per_s": round(st["bytes_written"] / wall / 1e6, 2),
               "tokens_per_sample": round(st["tokens"]["done_now"] / samples),
               "server_passes": info["passes"], "driver_cpu_ms_per_sample": round(1000 * cpu / samples, 2)}
        print(json.dumps(row), flush=True)
        out.append(row)
        shutil.rmtree(run)
    return out


class _Mode:
    name = "EXTEND"


class _Batch:
    def __init__(self, n: int):
        self.forward_mode = _Mode()
        self.extend_seq_lens_cpu = [n]
        self.extend_prefix_lens_cpu = [0]


def part_b(base: Path, n_samples: int, tokens: int, hidden: int, planes: int, threads: list[int]) -> list[dict]:
    out = []
    for nt in threads:
        cap, final = base / f"fin{nt}" / "capture", base / f"fin{nt}" / "samples"
        cfg = config.CaptureConfig(enabled=True, directory=str(cap), layers=tuple(range(planes - 1)), final="pre",
                                   slots=2, slot_tokens=tokens, writers=4)
        h = hook.CaptureHook(cfg, hidden_size=hidden, metadata={"sglang_release": "bench"})
        data = [torch.randn(tokens, hidden).to(torch.bfloat16) for _ in range(planes)]
        for k in range(n_samples):
            p = h.begin(_Batch(tokens), torch.arange(tokens, dtype=torch.int64) + k * tokens)
            for i in range(planes - 1):
                p.collector(i, None).append(data[i])
            p.final_prenorm(data[-1], owned=True)
            p.finish(data[-1])
        h.close(600)
        watcher = CaptureWatcher(cap)
        entries = list(store.read_manifest(cap).values())
        nbytes = sum(e["bytes"] for e in entries)
        mask = [0] * (tokens // 4) + [1] * (tokens - tokens // 4)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(nt) as pool:
            list(pool.map(lambda e: finalize(watcher, e, final, mask, {"sample_id": e["key"], "run": "bench"}),
                          entries))
        wall = time.perf_counter() - t0
        watcher.close()
        row = {"threads": nt, "samples": n_samples, "tokens_per_sample": tokens, "hidden": hidden, "planes": planes,
               "MB_per_sample": round(nbytes / n_samples / 1e6, 1), "wall_s": round(wall, 2),
               "GB_per_s": round(nbytes / wall / 1e9, 2), "tokens_per_s": round(n_samples * tokens / wall)}
        print(json.dumps(row), flush=True)
        out.append(row)
        shutil.rmtree(base / f"fin{nt}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm", help="where the temporary dirs go (default: %(default)s)")
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--words", type=int, default=60, help="words per turn of the generated chats")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size of the stand-in's tiny model")
    ap.add_argument("--fin-samples", type=int, default=12)
    ap.add_argument("--fin-tokens", type=int, default=1024)
    ap.add_argument("--fin-hidden", type=int, default=7168)
    ap.add_argument("--fin-planes", type=int, default=4)
    ap.add_argument("--fin-threads", default="1,2,4")
    ap.add_argument("--skip-a", action="store_true")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="hs-bench-driver-", dir=a.dir))
    try:
        res = {"cpu_count": os.cpu_count()}
        if not a.skip_a:
            res["end_to_end"] = part_a(base, a.samples, a.words, [int(x) for x in a.concurrency.split(",")], a.hidden)
        res["finalize"] = part_b(base, a.fin_samples, a.fin_tokens, a.fin_hidden, a.fin_planes,
                                 [int(x) for x in a.fin_threads.split(",")])
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
