"""A pytest plugin (tests/conftest.py loads it): SIGTERM stops a test run the way Ctrl-C does.

Without it SIGTERM (a CI job cancelled, a session's end) kills pytest where it stands: no fixture's
teardown runs, so the S3 server's netns and veth, a lab's test hosts and the stand-ins stay, and the
next run on the machine finds them in its way (one such run's veth routed the next run's S3 address
away from its server). With it, SIGTERM raises KeyboardInterrupt in the controller and in each xdist
worker, and pytest tears its fixtures down before it exits, where the teardown is quick: with xdist the
controller ends its workers soon after, so a slow teardown (the S3 server's, a molecule destroy) may be cut
(seen once). SIGKILL cannot be caught at all: what is left, the next run's ``up`` removes where it can
(tests/lab/gateway.py, tests/lab/seaweed.py).
"""

from __future__ import annotations

import os
import signal

import pytest


_PID = 0  # the pytest process that set the handler


def _interrupt(signum: int, frame: object) -> None:
    if os.getpid() != _PID:  # a child forked from a test (a pool's worker): SIGTERM ends it, as before
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"stopped by signal {signum}: tearing the fixtures down")


def pytest_configure(config: pytest.Config) -> None:
    global _PID
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # leave a handler someone else set alone
        _PID = os.getpid()
        signal.signal(signal.SIGTERM, _interrupt)
