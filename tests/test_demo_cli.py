"""tests/demo.py's teardown says what it did and leaves no inventory behind (no test hosts booted)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parent / "demo.py"
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the demo runs as root")


def _down(state: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEMO), "--down", "--state-dir", str(state)], capture_output=True,
                          text=True, timeout=120)


def test_down_with_nothing_up_says_so(tmp_path):
    out = _down(tmp_path / "never-used")
    assert out.returncode == 0 and f"demo: nothing to tear down in {tmp_path / 'never-used'}" in out.stdout


def test_down_removes_the_generated_inventory_and_says_so(tmp_path):
    state = tmp_path / "demo"
    (state / "inventory" / "host_vars").mkdir(parents=True)
    (state / "inventory" / "hosts.yml").write_text("all: {}\n")
    out = _down(state)
    assert out.returncode == 0 and "demo: torn down in" in out.stdout, out.stdout + out.stderr
    assert not state.exists(), "the state dir is removed once empty"
    assert "nothing to tear down" in _down(state).stdout
