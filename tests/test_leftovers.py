"""A test run leaves nothing behind: no temp dirs of passing tests, no torch cache dir, nothing of a killed
stand-in."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[1]


def test_a_passing_run_keeps_no_temp_dirs_and_a_failing_test_keeps_its_own(tmp_path):
    (tmp_path / "test_t.py").write_text("def test_ok(tmp_path):\n    (tmp_path / 'f').write_bytes(b'x' * 4096)\n\n"
                                        "def test_bad(tmp_path):\n    (tmp_path / 'g').write_text('kept')\n"
                                        "    assert False\n")
    for select, left in (("test_ok", []), ("", ["test_bad0/g"])):
        root = tmp_path / f"temproot-{select or 'all'}"
        root.mkdir()
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                        str(ROOT / "pyproject.toml"), str(tmp_path / "test_t.py"), *(["-k", select] if select else [])],
                       cwd=tmp_path, env={**os.environ, "PYTEST_DEBUG_TEMPROOT": str(root)}, capture_output=True,
                       timeout=120)
        files = sorted("/".join(p.relative_to(root).parts[2:]) for p in root.rglob("*") if p.is_file())
        assert files == left, f"the repository's pytest settings (tmp_path_retention_*) left {files}"


def test_building_the_tiny_model_leaves_nothing_in_tmp(tmp_path):
    """transformers building a model makes torch's Inductor cache dir in TMPDIR; conftest points it at
    the session's own directory, which every test and what it starts inherit."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    subprocess.run([sys.executable, "-c", "from lab.tiny_model import random_model; random_model(vocab_size=64)"],
                   cwd=ROOT / "tests", env={**os.environ, "TMPDIR": str(tmp)}, check=True, timeout=300)
    assert not list(tmp.iterdir())


@pytest.mark.slow
def test_a_killed_standin_leaves_nothing_in_tmp(tiny_model_dir, tmp_path):
    """The fault tests SIGKILL the stand-in: what it unpacked from the SGLang wheel is gone already."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "lab" / "standin_server.py"), "--model",
                             str(tiny_model_dir), "--port", str(port), "--capture-dir", str(tmp_path / "capture"),
                             "--threads", "1", "--release", "0.5.23"],
                            env={**os.environ, "TMPDIR": str(tmp)}, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the stand-in did not start within 120 s"
            try:
                if requests.get(f"http://127.0.0.1:{port}/get_server_info", timeout=1).ok:
                    break
            except requests.RequestException:
                time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert not list(tmp.glob("standin-sglang-*")), "a killed stand-in left its unpacked wheel in TMPDIR"
