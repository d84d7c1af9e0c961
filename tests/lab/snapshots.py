"""A run's snapshot mid-run, as ``hs-extract snapshot`` prints it (:mod:`hs_patch.host.driver.snapshot`):
what the dashboard tests draw."""

from __future__ import annotations

SNAP = {
    "run": "r1", "time": 0,
    "driver": {"state": "running", "samples": {"total": 100, "done": 40, "rejected": 3, "duplicates": 1, "failed": 0,
                                               "in_flight": 8}, "tokens": {"done_now": 81920, "per_s": 2048.0},
               "bytes_written": 5.8e9, "dump": {"paused": True}, "errors": {"last": "timeout on line 7"}},
    "shipper": {"state": "shipping", "shipped": {"count": 30, "bytes": 4.4e9}, "pending": {"count": 10, "bytes": 1.4e9},
                "throughput_bytes_per_s": 1.1e8, "last_error": None},
    "hook": {"waits": 2, "wait_seconds": 0.5, "error": None},
    "units": {"hs-drive-r1": {"ActiveState": "active"}, "hs-ship-r1": {"ActiveState": "active"},
              "sglang": {"ActiveState": "active"}},
    "dump": {"used_pct": 81.0}, "samples": {"used_pct": 12.0},
    "gpus": [{"index": "0", "name": "NVIDIA RTX PRO 6000 Blackwell", "util": 97, "mem_used": 90000, "mem_total": 97000}],
    "rejects": [{"source": "chat.jsonl", "line": 5, "reason": "no assistant turn"}],
}
