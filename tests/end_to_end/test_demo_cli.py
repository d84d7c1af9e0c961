"""tests/lab/demo.py's teardown says what it did and leaves no inventory behind (no test hosts booted);
what it says of the example dataset's bad lines is what the driver and examples/data/README.md say."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[1] / "lab" / "demo.py"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="the demo runs as root")


def _down(state: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DEMO), "--down", "--state-dir", str(state)], capture_output=True,
                          text=True, timeout=120)


@as_root
def test_down_with_nothing_up_says_so(tmp_path):
    out = _down(tmp_path / "never-used")
    assert out.returncode == 0 and f"demo: nothing to tear down in {tmp_path / 'never-used'}" in out.stdout


@as_root
def test_down_removes_the_generated_inventory_and_says_so(tmp_path):
    state = tmp_path / "demo"
    (state / "inventory" / "host_vars").mkdir(parents=True)
    (state / "inventory" / "hosts.yml").write_text("all: {}\n")
    out = _down(state)
    assert out.returncode == 0 and "demo: torn down in" in out.stdout, out.stdout + out.stderr
    assert not state.exists(), "the state dir is removed once empty"
    assert "nothing to tear down" in _down(state).stdout


def test_the_demo_says_which_lines_of_the_example_are_bad_on_purpose():
    from lab.demo import ROOT, bad_lines_on_purpose

    bad = bad_lines_on_purpose()
    assert len(bad) == 11 and bad[13] == "bad_json" and bad[14] == "not_utf8", bad
    table = (ROOT / "examples" / "data" / "README.md").read_text()
    listed = {int(n) for n, reason in re.findall(r"^\| (\d+) \|[^|]*\| reject `(\w+)`", table, re.M)
              if reason != "too_long"}   # too long only under --max-tokens 512; the demo keeps the default
    assert set(bad) == listed, "the demo and examples/data/README.md name the same bad lines"
    out = subprocess.run([sys.executable, str(DEMO), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "bad lines ON PURPOSE" in out.stdout, out.stderr
