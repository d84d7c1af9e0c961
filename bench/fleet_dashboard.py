#!/usr/bin/env python3
"""The control node's cost of the fleet dashboard: polling N hosts, measured in CPU seconds per wall second.

    python3 bench/fleet_dashboard.py [--hosts 16] [--seconds 60] [--interval 2]

N private sshd's on loopback (tests/lab/loopback_fleet.py: each its own port, host key and
authorized key, so N hosts to Fabric) stand for the GPU hosts. The control side is the
real one: ``hs_patch.control.poll.Poller`` (a thread a host, one SSH connection a host kept
open, each read bounded by the poll deadline), ``remote.snapshot`` on each host every
``--interval`` seconds, the fleet table rendered from the latest answers
(``fleet_dashboard.views`` and ``render``) into a console every interval. The host side of
each read (``hs-extract snapshot``) is replaced by ``cat`` of a snapshot JSON of the same
shape, so that N Python starts a poll on this same machine do not compete with what is
measured: this process's own CPU time (every thread: SSH, JSON, rendering), not sshd's
nor the remote commands'. Prints one result line (JSON) and, with ``--results``,
appends it to bench/RESULTS.md's raw results (bench/results/fleet_dashboard.jsonl).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent / "tests")]

from rich.console import Console  # noqa: E402

from lab import loopback_fleet  # noqa: E402
from hs_patch.control import fleet_dashboard, remote  # noqa: E402
from hs_patch.control.poll import Poller  # noqa: E402


def fake_snapshot(run: str, i: int) -> dict:
    """A snapshot as hs_patch.host.driver.snapshot.take writes it, mid-run."""
    return {"time": time.time(), "run": run,
            "driver": {"state": "running", "samples": {"total": 1000, "done": 100 + i, "rejected": 2, "duplicates": 1,
                                                       "failed": 0, "in_flight": 8, "remaining": 897 - i},
                       "tokens": {"done_now": 123456, "loss": 60000, "per_s": 5400.0}, "bytes_written": 8 * 10**9,
                       "dump": {"paused": False, "used_pct": 41.0}, "errors": {"count": 0, "retries": 1},
                       "shipping": {"shipped": 90, "pending": 10}},
            "shipper": {"state": "shipping", "shipped": {"count": 90, "bytes": 7 * 10**9},
                        "pending": {"count": 10, "bytes": 10**9}, "throughput_bytes_per_s": 4 * 10**8},
            "hook": {"waits": 0, "wait_seconds": 0},
            "units": {f"hs-drive-{run}": {"ActiveState": "active"}, f"hs-ship-{run}": {"ActiveState": "active"},
                      "sglang": {"ActiveState": "active"}},
            "dump": {"used_pct": 41.0}, "samples": {"used_pct": 41.0},
            "gpus": [{"index": str(g), "name": "NVIDIA RTX PRO 6000", "util": 97.0, "mem_used": 90000.0,
                      "mem_total": 97887.0} for g in range(8)],
            "rejects": []}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--results", action="store_true", help="append the result to bench/results/fleet_dashboard.jsonl")
    a = ap.parse_args(argv)
    run = "bench"
    reads = []
    with tempfile.TemporaryDirectory() as tmp:
        hosts = loopback_fleet.start(Path(tmp), [f"h{i:02d}" for i in range(a.hosts)])
        try:
            for i, h in enumerate(hosts):
                h.show(fake_snapshot(run, i))
            rows = [fleet_dashboard.Row(h.target.name, h.target.name, run, f"{i}/{a.hosts}")
                    for i, h in enumerate(hosts)]
            console = Console(file=io.StringIO(), width=160)
            rates = fleet_dashboard.Rates()

            def read(c, t) -> dict:
                t0 = time.monotonic()
                snap = {t.name: remote.snapshot(c, t, run)}
                reads.append(time.monotonic() - t0)
                return snap

            poller = Poller.of([h.target for h in hosts], read, interval=a.interval)
            first = poller.first()  # connects every host (not counted: a dashboard connects once)
            bad = {k: v.value for k, v in first.items() if not v.ok}
            if bad:
                raise SystemExit(f"bench: hosts failed: {bad}")
            seen: dict = {}
            cpu0, wall0, n0 = time.process_time(), time.monotonic(), len(reads)
            while time.monotonic() - wall0 < a.seconds:
                now = time.monotonic()
                snaps = fleet_dashboard.views(rows, poller.latest(), now, poller.started, seen)
                console.print(fleet_dashboard.render(rows, snaps, "bench", rates))
                assert all(isinstance(v, dict) for v in snaps.values()), snaps
                time.sleep(max(0.0, a.interval - (time.monotonic() - now)))
            cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
            polls = (len(reads) - n0) / a.hosts
            slowest = max(reads[n0:])
            poller.close()
        finally:
            for h in hosts:
                h.stop()
    res = {"bench": "fleet_dashboard", "hosts": a.hosts, "interval_s": a.interval, "polls": round(polls, 1),
           "wall_s": round(wall, 1), "cpu_s": round(cpu, 2), "cpu_share": round(cpu / wall, 4),
           "cpu_ms_per_host_poll": round(1000 * cpu / (polls * a.hosts), 2), "slowest_poll_s": round(slowest, 3),
           "cpus": os.cpu_count(), "command": "python3 bench/fleet_dashboard.py " + " ".join(argv or sys.argv[1:])}
    print(json.dumps(res))
    if a.results:
        out = HERE / "results" / "fleet_dashboard.jsonl"
        from hs_patch.samples.files import append_line

        append_line(out, (json.dumps(res) + "\n").encode(), fsync=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
