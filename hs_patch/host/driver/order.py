"""Lines claim their tokens in the dataset's order: of two lines with the same tokens, the earlier is kept.

The driver's workers prepare lines side by side, and a line's tokens (its sample's key) are known
only once it is prepared: a chat is rendered with the chat template (and, with ``--regenerate``,
its assistant turns are generated first), a pre-tokenized line is ready at once. Claimed as each
finished, the later of two lines with the same tokens won whenever it was quicker to prepare
(``[chat X, {"input_ids": tokens(X)}]``: the second line was kept, with its own loss mask and
provenance, most of the time). So the feeder numbers the lines it hands out, and a prepared line
claims its key only once every line before it has claimed its own or ended without one
(:meth:`InOrder.settle`): which line is kept depends on the dataset alone.
"""

from __future__ import annotations

import threading


class InOrder:
    """Line numbers (0, 1, 2, ... in the order the feeder hands lines out) settled in any order, waited on in order."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._next = 0                 # every number below this is settled
        self._ahead: set[int] = set()  # settled numbers above it

    def ready(self, seq: int) -> bool:
        """Whether every line before ``seq`` is settled."""
        with self._cond:
            return self._next >= seq

    def wait(self, seq: int, stop: threading.Event, poll: float = 0.5) -> bool:
        """Wait until every line before ``seq`` is settled; False if ``stop`` is set first."""
        with self._cond:
            while self._next < seq:
                if stop.is_set():
                    return False
                self._cond.wait(poll)
            return True

    def settle(self, seq: int) -> None:
        """Line ``seq`` has claimed its key or ended without one (rejected, failed, stopped); again is a no-op."""
        with self._cond:
            if seq < self._next or seq in self._ahead:
                return
            self._ahead.add(seq)
            while self._next in self._ahead:
                self._ahead.remove(self._next)
                self._next += 1
            self._cond.notify_all()
