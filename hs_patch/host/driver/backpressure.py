"""Back-pressure on the dump filesystems: pause sending above a high-water mark.

The driver watches the filesystem of the capture dir and of the samples dir
(``os.statvfs``, the Use% of ``df``). When any of them is
at or above ``high`` percent, new requests wait; they resume when all are below
``low`` percent (hysteresis, so the driver does not flap). Requests already at the
server finish, so the overshoot is at most ``concurrency`` samples.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Optional, Sequence


def disk_usage(path: str) -> float:
    """Percent of the filesystem of ``path`` in use, as ``df`` shows it: used / (used + available)."""
    st = os.statvfs(path)
    used = st.f_blocks - st.f_bfree
    total = used + st.f_bavail
    return 100.0 * used / total if total else 0.0


class BackPressure:
    def __init__(self, paths: Sequence[str], *, high: float = 80.0, low: float = 60.0,
                 usage: Callable[[str], float] = disk_usage, interval: float = 0.5,
                 on_change: Optional[Callable[[str, dict[str, float]], None]] = None):
        if not 0 < low < high <= 100:
            raise ValueError(f"need 0 < low-water ({low}) < high-water ({high}) <= 100")
        self.paths = list(dict.fromkeys(paths))
        self.high, self.low = high, low
        self.usage_fn = usage
        self.interval = interval
        self.on_change = on_change
        self.paused = False
        self.pauses = 0
        self.paused_seconds = 0.0
        self.last: dict[str, float] = {}
        self._checked = 0.0
        self._since = 0.0
        self._lock = threading.Lock()

    def check(self) -> bool:
        """Re-read usage (at most every ``interval`` s); return True while paused."""
        with self._lock:
            now = time.monotonic()
            if now - self._checked < self.interval and self._checked:
                return self.paused
            self._checked = now
            self.last = {p: round(self.usage_fn(p), 2) for p in self.paths}
            top = max(self.last.values(), default=0.0)
            if not self.paused and top >= self.high:
                self.paused, self._since = True, now
                self.pauses += 1
                self._notify("pause")
            elif self.paused and top < self.low:
                self.paused = False
                self.paused_seconds += now - self._since
                self._notify("resume")
            return self.paused

    def _notify(self, what: str) -> None:
        if self.on_change is not None:
            self.on_change(what, dict(self.last))

    def wait(self, stop: threading.Event) -> bool:
        """Block while paused; False if ``stop`` was set meanwhile."""
        while self.check():
            if stop.wait(self.interval):
                return False
        return not stop.is_set()

    def status(self) -> dict[str, Any]:
        return {"paused": self.paused, "pauses": self.pauses, "high_water": self.high, "low_water": self.low,
                "used_pct": dict(self.last)}
