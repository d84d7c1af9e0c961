"""One lab per gateway address on this machine: labs share the root network namespace.

Two labs on one gateway (another checkout's CI, a helper's molecule run) would collide, so
``Lab.up`` waits for the other lab to go, at most ``GATEWAY_WAIT_S``, then fails saying whose
it is; ``OWNERS_DIR`` maps each lab's bridge to its state dir for that message.

A lab whose every host process is gone (left by a run that was killed before its ``down``), or
whose recorded owner is gone while its hosts run (``OWNER_ENV`` below), is in nobody's use:
``reclaim`` removes it by its own recorded ids instead of waiting for it.
``labs_locked`` is the one machine-wide lock: ``up`` holds it while it claims a gateway and
boots, ``down`` while it removes, so a waiter never sees a lab half made or half gone.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lab.hostcmd import LabError, file_locked, log, proc_start_time, run

GATEWAY_WAIT_S = int(os.environ.get("HS_TESTHOSTS_WAIT_S", "1200"))
OWNERS_DIR = Path("/run/hs-testhosts")
# The pid of the process whose life bounds a lab (the test suite sets its own, in tests/conftest.py):
# recorded by `up`, so a lab still running after its owner died (a worker killed before its teardown
# took the lab down) is reclaimed like a dead one. Unset (a lab made by hand): the lab is never reclaimed
# while a host of it runs.
OWNER_ENV = "HS_TESTHOSTS_OWNER_PID"


def owner_from_env() -> dict | None:
    """The process named by OWNER_ENV, as a lab records it ({pid, start}), or None when it is unset."""
    value = os.environ.get(OWNER_ENV, "")
    if not value:
        return None
    start = proc_start_time(int(value)) if value.isdigit() else None
    if start is None:
        raise LabError(f"{OWNER_ENV}={value!r} is not a running process: unset it, or set it to the pid of the"
                       " process the lab belongs to (a lab it outlives is removed by the next lab's up)")
    return {"pid": int(value), "start": start}


def gateway_owner(gw: ipaddress.IPv4Interface) -> tuple[str, Path | None]:
    """('', None) when no interface holds ``gw``'s address, else (IFACE, the state dir of its lab or None)."""
    busy = run(["ip", "-o", "addr", "show", "to", str(gw.ip)]).stdout.split()
    if not busy:
        return "", None
    owner = OWNERS_DIR / busy[1]
    return busy[1], Path(owner.read_text().strip()) if owner.exists() else None


def gateway_user(gw: ipaddress.IPv4Interface) -> str:
    """'' when no interface holds ``gw``'s address, else 'IFACE (lab in DIR)'."""
    return _named(*gateway_owner(gw))


def _named(iface: str, state_dir: Path | None) -> str:
    return f"{iface} (lab in {state_dir})" if state_dir else iface


def labs_locked() -> contextlib.AbstractContextManager:
    """The machine-wide lab lock (an flock: a killed holder releases it)."""
    return file_locked(OWNERS_DIR / ".lock")


@contextlib.contextmanager
def gateway_claimed(gw: ipaddress.IPv4Interface,
                    reclaim: Callable[[Path], bool] = lambda state_dir: False) -> Iterator[None]:
    """Hold the machine-wide lab lock once ``gw`` is free, waiting at most GATEWAY_WAIT_S for it.

    ``reclaim(state_dir)`` is asked first, under the lock, about the lab holding ``gw``: it
    removes that lab and returns True when nobody will take it down (see the module's docstring).
    """
    deadline = time.monotonic() + GATEWAY_WAIT_S
    next_note = 0.0
    while True:
        with labs_locked():
            iface, state_dir = gateway_owner(gw)
            if iface and state_dir is not None and reclaim(state_dir):
                iface, state_dir = gateway_owner(gw)
            if not iface:
                yield
                return
            user = _named(iface, state_dir)
        now = time.monotonic()
        if now > deadline:
            raise LabError(f"gateway {gw.ip} is still configured here by {user} after {GATEWAY_WAIT_S}s:"
                           " another lab is up; run 'testhosts.py down --state-dir DIR' on its state dir"
                           " (or set HS_TESTHOSTS_WAIT_S to wait longer)")
        if now >= next_note:
            log(f"gateway {gw.ip} is in use by {user}; waiting up to {int(deadline - now)}s for it to go")
            next_note = now + 60
        time.sleep(2)
