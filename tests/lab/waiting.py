"""Waiting in tests for what another process brings about, bounded in time."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait(what: str, predicate: Callable[[], Any], timeout: float = 180, every: float = 1.0) -> Any:
    """The first true value of ``predicate()``, asked every ``every`` s; AssertionError naming ``what`` after
    ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
