"""A run's snapshot mid-run, as ``hs-extract snapshot`` prints it (:mod:`hs_patch.host.driver.snapshot`):
what the dashboard tests draw."""

from __future__ import annotations

SNAP = {
    "run": "r1", "time": 0,
    "driver": {"state": "running", "samples": {"total": 100, "done": 40, "rejected": 3, "duplicates": 1, "failed": 0,
                                               "in_flight": 8, "remaining": 56},
               "tokens": {"done_now": 81920, "per_s": 2048.0},
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


def progress(run: str, done: int, total: int, state: str = "running", paused: bool = False) -> dict:
    """A run's snapshot at ``done`` of ``total``: its units active while ``state`` is running."""
    active = "active" if state == "running" else "inactive"
    return {"run": run, "driver": {"state": state, "samples": {"done": done, "total": total,
                                                               "remaining": 0 if state == "finished" else total - done},
                                   "tokens": {"per_s": 100.0}, "bytes_written": done * 10**6,
                                   "dump": {"paused": paused}, "errors": {"count": 0}},
            "shipper": {"shipped": {"count": done, "bytes": done * 10**6}, "pending": {"count": 0, "bytes": 0}},
            "dump": {"used_pct": 85.0 if paused else 10.0},
            "units": {f"hs-drive-{run}": {"ActiveState": active}, f"hs-ship-{run}": {"ActiveState": active}}}


class Local:
    """A host read by a function in this process: what the dashboards draw, without SSH (the SSH
    reads themselves: tests/control/test_fleet_poll.py)."""

    def __init__(self, name: str, fn):
        self.name, self.fn, self.drops = name, fn, 0

    def read(self):
        return self.fn()

    def drop(self, *, connected_only: bool) -> None:
        self.drops += 1


def poller(interval: float = 0.01, deadline: float = 5.0, **hosts):
    """A :class:`hs_patch.control.poll.Poller` over ``name=function`` hosts read here."""
    from hs_patch.control.poll import Poller

    return Poller([Local(name, fn) for name, fn in hosts.items()], interval=interval, deadline=deadline)
