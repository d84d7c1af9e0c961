"""One lab per gateway address on this machine: labs share the root network namespace.

Two labs on one gateway (another checkout's CI, a helper's molecule run) would collide, so
``Lab.up`` waits for the other lab to go, at most ``GATEWAY_WAIT_S``, then fails saying whose
it is; ``OWNERS_DIR`` maps each lab's bridge to its state dir for that message.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import time
from pathlib import Path

from lab.hostcmd import LabError, log, run

GATEWAY_WAIT_S = int(os.environ.get("HS_TESTHOSTS_WAIT_S", "1200"))
OWNERS_DIR = Path("/run/hs-testhosts")


def gateway_user(gw: ipaddress.IPv4Interface) -> str:
    """'' when no interface holds ``gw``'s address, else 'IFACE (lab in DIR)'."""
    busy = run(["ip", "-o", "addr", "show", "to", str(gw.ip)]).stdout.split()
    if not busy:
        return ""
    owner = OWNERS_DIR / busy[1]
    return f"{busy[1]} (lab in {owner.read_text().strip()})" if owner.exists() else busy[1]


@contextlib.contextmanager
def gateway_claimed(gw: ipaddress.IPv4Interface):
    """Hold the machine-wide lab lock once ``gw`` is free, waiting at most GATEWAY_WAIT_S for it."""
    OWNERS_DIR.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + GATEWAY_WAIT_S
    next_note = 0.0
    with open(OWNERS_DIR / ".lock", "w") as lock:
        while True:
            fcntl.flock(lock, fcntl.LOCK_EX)
            user = gateway_user(gw)
            if not user:
                try:
                    yield
                finally:
                    fcntl.flock(lock, fcntl.LOCK_UN)
                return
            fcntl.flock(lock, fcntl.LOCK_UN)
            now = time.monotonic()
            if now > deadline:
                raise LabError(f"gateway {gw.ip} is still configured here by {user} after {GATEWAY_WAIT_S}s:"
                               " another lab is up; run 'testhosts.py down --state-dir DIR' on its state dir"
                               " (or set HS_TESTHOSTS_WAIT_S to wait longer)")
            if now >= next_note:
                log(f"gateway {gw.ip} is in use by {user}; waiting up to {int(deadline - now)}s for it to go")
                next_note = now + 60
            time.sleep(2)
