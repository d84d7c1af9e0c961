"""The driver's start-up, overlapped: what waits on the server runs beside what the driver does itself.

Before its first request the driver loads the tokenizer (transformers: seconds), reads the run's
state and the dataset, and asks the server three things: ``/health`` (SGLang's handler prefills
``input_ids [0]`` and then sleeps a whole second before it answers), ``/server_info`` (the radix
cache, the KV cache pool, the input limit), and the capture check's probe (``capture_check.py``:
it needs the tokenizer). One after another that was their sum (issue #36: 10-11 s on the H100
host); :func:`ask_server` runs the first two in a thread (:class:`Pending`) while the tokenizer
loads, so the start-up costs the longer of the two, then the probe. What fails is said as before,
in the same order: the tokenizer's and the dataset's refusals first, then the server's.

The fidelity check's weights (the LM head in fp32, the embedding weight's row checksums: torch's
import and gigabytes of reading on Kimi-K2.5) are read in a thread begun once the first request is
sent (begun before it, the import held the interpreter's lock while the first request was being
made: 0.3 s later on the dev VM): only the first sample's check waits for them (``sample_steps.py``).
:func:`process_started` and :class:`Timings` put the start-up's steps in the ledger's ``run_start``
(``startup``), so a run says where its start went.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Generic, Mapping, Optional, TypeVar

from hs_patch.host.driver.client import SGLangClient

T = TypeVar("T")


class Pending(Generic[T]):
    """A value made in a daemon thread; :meth:`result` waits for it and raises what making it raised. ``start``:
    begin now (else at :meth:`start`, or at the first :meth:`result`)."""

    def __init__(self, name: str, make: Callable[[], T], *, start: bool = True):
        self._make, self._value, self._error = make, None, None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._lock = threading.Lock()
        if start:
            self.start()

    def _run(self) -> None:
        try:
            self._value = self._make()
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the value
            self._error = e

    def start(self) -> None:
        with self._lock:
            if not self._thread.is_alive() and self._thread.ident is None:
                self._thread.start()

    def started(self) -> bool:
        return self._thread.ident is not None

    def result(self) -> T:
        self.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


def ask_server(client: SGLangClient, wait: float) -> dict[str, Any]:
    """``/health`` (waited for up to ``wait`` s), then ``/server_info``: the server's info (the driver judges it)."""
    client.wait_healthy(wait)
    return client.server_info(timeout=wait)


def process_started() -> Optional[float]:
    """When this process started (epoch seconds, to the kernel's 10 ms), from /proc; None where there is none."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, clock ticks after boot
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


class Timings:
    """Seconds of each start-up step (``run_start``'s ``startup``): ``mark(name)`` ends the step begun at the last
    mark."""

    def __init__(self) -> None:
        self.t0 = self._last = time.monotonic()
        self.steps: dict[str, float] = {}

    def since(self) -> float:
        """Seconds since the first step began (any thread)."""
        return round(time.monotonic() - self.t0, 3)

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.steps[name] = round(now - self._last, 3)
        self._last = now

    def record(self, **extra: Any) -> Mapping[str, Any]:
        started = process_started()
        out: dict[str, Any] = {**self.steps, "prepare_s": round(time.monotonic() - self.t0, 3), **extra}
        if started is not None:
            out["since_process_start_s"] = round(time.time() - started, 3)
        return out
