"""``hook_status.json``: the capture writer's counters, for readers outside the server.

The driver reads it before it sends (where does this server write?), ``hs-extract snapshot`` and
fab's dashboard show it, the GPU sweep counts the hook's waits per row from it. Written atomically
(a reader sees a whole file), at most every ``interval`` seconds while passes come and at once
when asked (start, failure, the writer idle), from any thread: the newest document is the one left.
Standard library only (imported inside the server).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

from hs_patch.samples import files

log = logging.getLogger("hs_patch")
STATUS_FILE = "hook_status.json"


class StatusFile:
    """``directory/hook_status.json``, rewritten from ``doc()`` at most every ``interval`` s unless forced."""

    def __init__(self, directory: Path, doc: Callable[[], dict[str, Any]], interval: float = 2.0):
        self.path, self.doc, self.interval = Path(directory) / STATUS_FILE, doc, interval
        self._at = 0.0
        self._lock = threading.Lock()  # the coordinator, a failing job and close() may all write: newest last

    def write(self, force: bool = False) -> None:
        with self._lock:
            now = time.time()
            if not force and now - self._at < self.interval:
                return
            self._at = now
            try:
                files.write_text_atomic(self.path, json.dumps({"pid": os.getpid(), "time": now, **self.doc()},
                                                              sort_keys=True))
            except OSError as e:  # a status file must never stop capture
                log.warning("hs_patch: cannot write %s: %s", self.path.name, e)


def capture_threads() -> dict[str, int]:
    """The capture's threads in this process by name (coordinator, writers, hashers) and their kernel thread ids:
    what a reader outside the server needs to tell their CPU time apart in /proc (the GPU sweep does; Python
    3.12 gives the kernel no thread names)."""
    return {t.name: t.native_id for t in threading.enumerate()
            if t.name.startswith("hs_patch") and t.native_id is not None}
