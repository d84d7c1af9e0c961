#!/usr/bin/env python3
"""A test host's power cycle: boot the guest with systemd-nspawn again each time it reboots.

``systemd-nspawn --boot`` ends with exit status 133 when its guest asks for a reboot
(``systemctl reboot``, Ansible's reboot module); a real machine comes back instead. So
:mod:`lab.testhosts` runs the host's nspawn command under this loop, which starts the same
command again, on the same overlay and network namespace (both live outside the guest: the
disk and the network survive, ``/run`` and ``/dev/shm`` start empty, the guest's boot id
changes), at most ``MAX_BOOTS`` times. Any other exit ends the loop with that status.

SIGTERM or SIGINT is passed to the running systemd-nspawn (which powers the guest off in
order, as ``testhosts down`` asks) and ends the loop. The loop's pid is the host's recorded
pid and leads a process group holding nspawn too, so killing the group ends both.

    python3 tests/lab/boot_loop.py -- systemd-nspawn --boot ...
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

REBOOT_STATUS = 133  # systemd-nspawn(1): "the container requested a reboot"
MAX_BOOTS = 50  # bounded: a guest that reboots for ever stops here


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--" or len(argv) < 2:
        print("usage: boot_loop.py -- COMMAND...", file=sys.stderr)
        return 2
    command = argv[1:]
    stopping = False
    child: subprocess.Popen | None = None

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = 0
    for boot in range(1, MAX_BOOTS + 1):
        child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
        rc = child.wait()
        if rc != REBOOT_STATUS or stopping:
            return rc
        print(f"boot_loop: the guest rebooted (boot {boot} ended with {rc}); booting it again", file=sys.stderr,
              flush=True)
        time.sleep(0.2)
    print(f"boot_loop: the guest rebooted {MAX_BOOTS} times; not booting it again", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
