"""Run an Ansible play on this machine (local connection, this Python), as the tests of single task files do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


def run_local_play(play: Path, *args: str, env: dict[str, str] | None = None, cwd: Path | None = None,
                   timeout: int = 300) -> subprocess.CompletedProcess:
    """`ansible-playbook -i localhost, -c local PLAY ARGS`, colours off, ``env`` over this process's environment."""
    argv = [str(PLAYBOOK), "-i", "localhost,", "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}",
            *args, str(play)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd,
                          env={**os.environ, "PY_COLORS": "0", "ANSIBLE_FORCE_COLOR": "0", "NO_COLOR": "1",
                               **(env or {})})
