"""Each GPU host read in its own thread, every read bounded in time: what the dashboards show.

A dead host must never hold up the others (docs/fleet.md). Fabric's ThreadingGroup waits for
every member, and on an open SSH connection to a host whose link died paramiko waits where no
timeout of ours applies: opening the channel waits ``Transport.channel_timeout`` (an hour by
default), ``Channel.exec_command`` waits for the server's reply with no limit at all, and
invoke's ``timeout=`` is armed only after both; paramiko's keepalives only send, they never
notice a silent peer. So :class:`Poller` reads each host in a thread of its own, and the
dashboard draws whatever answer each host last gave, every interval, waiting for none. A read
that has not answered within ``deadline`` seconds makes the host's answer "no answer" and drops
its connection: closing the transport ends every one of those waits at once (the channel open
sees the transport inactive, ``exec_command``'s event is set as its channel closes, invoke's
wait sees the channel closed); the host's thread records the failure and connects again, a
connect being bounded by its own timeouts (``fleet.CONNECT_TIMEOUT_S``, paramiko's banner and
auth timeouts), and dropped only by them.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from hs_patch.control.fleet import FleetConnection, FleetGroup, open_connection
from hs_patch.control.inventory import Target

POLL_DEADLINE_S = 20.0   # a read unanswered this long: the host is unreachable and its connection dropped

# paramiko logs a traceback when a connection is closed under its transport thread; the reads
# raise the same errors, which the dashboards show on the host's row
logging.getLogger("paramiko").addHandler(logging.NullHandler())


@dataclass(frozen=True)
class Answer:
    value: Any = None                  # what the last read returned, or why it failed (None: none ended yet)
    ok: bool = False
    last_ok: float | None = None       # when the host last answered (time.monotonic())

    def down_for(self, now: float, since: float) -> float | None:
        """Seconds since the host last answered (or since ``since``) while it does not; None while it
        does, and while its first read is within the deadline."""
        if self.ok or self.value is None:
            return None
        return now - (self.last_ok if self.last_ok is not None else since)


class Reader(Protocol):
    """One host's read, and a way to end a read in flight from another thread."""
    name: str

    def read(self) -> Any: ...

    def drop(self, *, connected_only: bool) -> None: ...


class SshReader:
    """``fn(shell, target)`` over a Fabric connection, opened (again) when closed."""

    def __init__(self, conn: FleetConnection, fn: Callable[..., Any]):
        self.conn, self.fn, self.name = conn, fn, conn.target.name or conn.target.host

    def read(self) -> Any:
        if not self.conn.is_connected:
            open_connection(self.conn, self.conn.target)
        return self.fn(self.conn.shell, self.conn.target)

    def drop(self, *, connected_only: bool) -> None:
        """Close the connection: every paramiko wait on it ends at once (a connect in progress is left
        to its own timeouts when ``connected_only``)."""
        if connected_only and not self.conn.is_connected:
            return
        try:
            self.conn.client.close()
        except Exception:  # noqa: BLE001 - it is being dropped anyway
            pass


class Poller:
    """Read every host every ``interval`` seconds, each in its own thread; :meth:`latest` never waits."""

    def __init__(self, readers: Sequence[Reader], *, interval: float, deadline: float = POLL_DEADLINE_S):
        self.readers, self.interval, self.deadline = list(readers), interval, deadline
        self.started = time.monotonic()
        self._answers = {r.name: Answer() for r in self.readers}
        self._inflight: dict[str, float | None] = dict.fromkeys(self._answers)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for r in self.readers:
            threading.Thread(target=self._loop, args=(r,), name=f"hs-poll-{r.name}", daemon=True).start()
        threading.Thread(target=self._watchdog, name="hs-poll-watchdog", daemon=True).start()

    @classmethod
    def of(cls, targets: Sequence[Target], fn: Callable[..., Any], *, interval: float) -> "Poller":
        """``fn(shell, target)`` on new connections to ``targets`` (those of a :class:`FleetGroup`)."""
        return cls([SshReader(c, fn) for c in FleetGroup.of(targets)], interval=interval)

    def latest(self) -> dict[str, Answer]:
        """Each host's last answer, now."""
        with self._lock:
            return dict(self._answers)

    def first(self) -> dict[str, Answer]:
        """Every host's first answer, each waited for at most the deadline (``fab status --once``)."""
        while time.monotonic() - self.started <= self.deadline + 2:
            answers = self.latest()
            if all(a.value is not None for a in answers.values()):
                return answers
            time.sleep(0.05)
        return self.latest()

    def close(self) -> None:
        self._stop.set()
        for r in self.readers:
            r.drop(connected_only=False)

    def _loop(self, r: Reader) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            with self._lock:
                self._inflight[r.name] = t0
            try:
                value, ok = r.read(), True
            except Exception as e:  # noqa: BLE001 - shown on the host's row
                value, ok = e, False
            with self._lock:
                late = self._inflight[r.name] is None        # the watchdog answered for this read already
                self._inflight[r.name] = None
                if ok:
                    self._answers[r.name] = Answer(value, True, time.monotonic())
                elif not late:
                    self._answers[r.name] = Answer(value, False, self._answers[r.name].last_ok)
            if not ok:
                r.drop(connected_only=False)
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - t0)))

    def _watchdog(self) -> None:
        while not self._stop.wait(min(1.0, self.deadline / 4)):
            now = time.monotonic()
            for r in self.readers:
                with self._lock:
                    t0 = self._inflight[r.name]
                    late = t0 is not None and now - t0 > self.deadline
                    if late:
                        self._inflight[r.name] = None
                        self._answers[r.name] = Answer(TimeoutError(f"no answer in {self.deadline:.0f} s"), False,
                                                       self._answers[r.name].last_ok)
                if late:
                    r.drop(connected_only=True)
