"""Turns at the server: at most ``--concurrency`` of the driver's requests are at the server at once.

The driver's workers outnumber the turns (``--concurrency`` + ``--awaiting``): a worker takes a
turn before it takes a sample (so samples are prepared and sent in the dataset's order, at most
``--concurrency`` at once, as before), holds it while the sample is tokenized and its request is at
the server, and gives it back as soon as the server has answered; then it waits for the sample the
server's writer produces, checks it and adopts it while the next request already has the turn. The writer runs behind the forward passes (its staging buffers let
it), so a worker that kept its turn until its sample was written left the server idle meanwhile:
on the H200 that cut ``hs-extract drive`` to about half the speed of a plain client on the same
capturing server (issue #22).
"""

from __future__ import annotations

import threading
from typing import Optional


class Turn:
    """One request's turn; :meth:`release` gives it back (once, however often it is called)."""

    def __init__(self, sem: threading.Semaphore):
        self._sem: Optional[threading.Semaphore] = sem

    def release(self) -> None:
        sem, self._sem = self._sem, None
        if sem is not None:
            sem.release()


class Turns:
    def __init__(self, concurrency: int):
        self._sem = threading.BoundedSemaphore(concurrency)

    def take(self, stop: threading.Event, poll: float = 0.5) -> Optional[Turn]:
        """Wait for a turn; None if ``stop`` is set first (nothing more is sent after a stop)."""
        while not self._sem.acquire(timeout=poll):
            if stop.is_set():
                return None
        if stop.is_set():
            self._sem.release()
            return None
        return Turn(self._sem)
