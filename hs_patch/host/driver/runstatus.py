"""Progress of a run as a small JSON file (and optionally a Prometheus textfile).

``status.json`` (rewritten atomically every ``--status-interval`` seconds and at the end)::

    {"run", "state": queued|starting|running|paused|stopping|finished|stopped|failed, "pid",
     "started", "updated", "elapsed_s",
     "samples": {"total", "done", "done_before", "done_now", "rejected", "duplicates",
                 "failed", "in_flight", "remaining", "blank"},
     "tokens": {"done_now", "loss", "per_s"}, "bytes_written",
     "dump": {"paused", "pauses", "high_water", "low_water", "used_pct": {dir: pct}},
     "shipping": {"shipped", "pending"},
     "errors": {"count", "retries", "consecutive_failures", "last"},
     "missing": {"lines", "rejected", "failed", "not_attempted", "never", "shown"},  # once ended (missing.py)
     "regenerate": {"lines", "answers_kept", "answers_left_out"},  # --regenerate, this start (regenerate.py)
     "message"}

``total`` is the number of non-blank input lines (``blank`` counts the others);
``remaining`` = total - done - rejected - duplicates - failed. A run that ends with nothing
done from a non-empty input is a failure (:func:`nothing_extracted` says why). The Prometheus file (for node_exporter's textfile collector)
carries the same numbers as ``hs_extract_*`` gauges labelled with the run.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hs_patch.samples import store


@dataclass
class Counters:
    total: int = 0
    blank: int = 0
    done_before: int = 0
    done_now: int = 0
    rejected: int = 0
    duplicates: int = 0
    failed: int = 0
    in_flight: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    bytes: int = 0
    retries: int = 0
    errors: int = 0
    consecutive_failures: int = 0
    last_error: str = ""
    done_keys: set[str] = field(default_factory=set)


class RunStatus:
    def __init__(self, run: str, path: str | os.PathLike, *, prometheus: Optional[str] = None,
                 extra: Callable[[], dict[str, Any]] = dict):
        self.run = run
        self.path = Path(path)
        self.prometheus = Path(prometheus) if prometheus else None
        self.extra = extra
        self.c = Counters()
        self.state = "starting"
        self.message = ""
        self.started = time.time()
        self.lock = threading.Lock()

    def update(self, **inc: int) -> None:
        """Add to counters: ``status.update(done_now=1, tokens=n)``."""
        with self.lock:
            for k, v in inc.items():
                setattr(self.c, k, getattr(self.c, k) + v)

    def error(self, message: str) -> None:
        with self.lock:
            self.c.errors += 1
            self.c.last_error = message[:500]

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            c = self.c
            now = time.time()
            elapsed = max(now - self.started, 1e-6)
            done = c.done_before + c.done_now
            doc = {
                "run": self.run, "state": self.state, "pid": os.getpid(), "started": round(self.started, 3),
                "updated": round(now, 3), "elapsed_s": round(elapsed, 1),
                "samples": {"total": c.total, "done": done, "done_before": c.done_before, "done_now": c.done_now,
                            "rejected": c.rejected, "duplicates": c.duplicates, "failed": c.failed,
                            "in_flight": c.in_flight, "blank": c.blank,
                            "remaining": max(0, c.total - done - c.rejected - c.duplicates - c.failed)},
                "tokens": {"done_now": c.tokens, "loss": c.loss_tokens, "per_s": round(c.tokens / elapsed, 1)},
                "bytes_written": c.bytes,
                "errors": {"count": c.errors, "retries": c.retries, "consecutive_failures": c.consecutive_failures,
                           "last": c.last_error},
                "message": self.message,
            }
        doc.update(self.extra())
        return doc

    def write(self) -> dict[str, Any]:
        doc = self.snapshot()
        store.write_text_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True))
        if self.prometheus is not None:
            store.write_text_atomic(self.prometheus, prometheus_text(doc))
        return doc


def nothing_extracted(doc: dict[str, Any], reject_reasons: dict[str, int]) -> Optional[str]:
    """Why a finished run that holds no sample at all is a failure (None if it holds one)."""
    s = doc["samples"]
    if s["done"]:
        return None
    reasons = ", ".join(f"{n} {r}" for r, n in sorted(reject_reasons.items(), key=lambda x: -x[1])[:4])
    where = []
    if s["rejected"] or not s["failed"]:
        where.append("rejects.jsonl for each rejected line's reason (the input must be JSON lines: one object a line)")
    if s["failed"]:  # the server, the capture or the fidelity check: not the input's fault
        where.append("missing.jsonl for each failed line's stage and error")
    return (f"nothing was extracted: {s['total']} non-blank lines ({s['blank']} blank), {s['rejected']} rejected"
            f"{' (' + reasons + ')' if reasons else ''}, {s['duplicates']} duplicates, {s['failed']} failed; see "
            + "; see ".join(where))


def prometheus_text(doc: dict[str, Any]) -> str:
    run = doc["run"].replace("\\", "\\\\").replace('"', '\\"')
    s, lines = doc["samples"], []

    def gauge(name: str, value: Any, help_: str, series: Optional[dict[str, Any]] = None) -> None:
        lines.append(f"# HELP hs_extract_{name} {help_}")
        lines.append(f"# TYPE hs_extract_{name} gauge")
        for labels, v in (series or {"": value}).items():
            lines.append(f'hs_extract_{name}{{run="{run}"{labels}}} {float(v)}')

    for k in ("total", "done", "rejected", "duplicates", "failed", "in_flight", "remaining"):
        gauge(f"samples_{k}", s[k], f"samples {k.replace('_', ' ')}")
    gauge("tokens_done", doc["tokens"]["done_now"], "tokens captured by this driver process")
    gauge("tokens_per_second", doc["tokens"]["per_s"], "captured tokens per second since the driver started")
    gauge("bytes_written", doc["bytes_written"], "bytes of final samples written by this driver process")
    gauge("errors", doc["errors"]["count"], "errors (failed samples, unusable raw samples)")
    gauge("retries", doc["errors"]["retries"], "HTTP retries")
    dump = doc.get("dump", {})
    gauge("paused", 1 if dump.get("paused") else 0, "1 while sending is paused by the dump high-water mark")
    used = {',path="%s"' % p.replace('"', '\\"'): pct for p, pct in dump.get("used_pct", {}).items()}
    if used:
        gauge("dump_used_percent", 0, "percent used of the dump filesystem", used)
    ship = doc.get("shipping", {})
    gauge("shipped", ship.get("shipped", 0), "samples verified at the destination by the shipper")
    gauge("ship_pending", ship.get("pending", 0), "final samples waiting to be shipped")
    return "\n".join(lines) + "\n"
