"""Run names, checked the same way by ``fab`` (control node) and ``hs-extract`` (GPU host).

A run name becomes a directory name (``/var/lib/hs-patch/runs/<run>``,
``/dev/shm/hs-runs/<run>``), a systemd unit name (``hs-drive-<run>``) and part of request
ids, so it must be one plain path component: letters, digits, ``.``, ``_``, ``-``,
starting with a letter or digit, at most 64 characters (no ``..``, ``/``, empty or ``.``).
Standard library only.
"""

from __future__ import annotations

import re

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class RunNameError(ValueError):
    """A run name that cannot be used; the message says what is allowed."""


def is_run_name(run: object) -> bool:
    """Whether ``run`` is a valid run name."""
    return isinstance(run, str) and bool(RUN_NAME.match(run)) and ".." not in run


def check_run_name(run: str) -> str:
    """``run`` if it is a valid run name, else RunNameError."""
    if not is_run_name(run):
        raise RunNameError(f"run name {run!r}: use letters, digits, '.', '_' or '-' (at most 64, starting with a "
                           "letter or digit, no '..'), e.g. kimi-2026-12-02")
    return run
