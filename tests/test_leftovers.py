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


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_stopped_with_sigterm_tears_its_fixtures_down(tmp_path, workers):
    """SIGTERM to the run's process group (a cancelled CI job, a session's end) runs every session fixture's
    teardown, in the controller and in each xdist worker (tests/lab/stop_on_sigterm.py); before, it killed
    pytest where it stood and left the S3 server's netns and veth to route the next run's address away."""
    (tmp_path / "test_t.py").write_text(
        "import os, pathlib, time\nimport pytest\n\n"
        "@pytest.fixture(scope='session')\ndef held():\n"
        f"    d = pathlib.Path({str(tmp_path)!r})\n"
        "    (d / f'up-{os.getpid()}').touch()\n    yield\n    (d / f'down-{os.getpid()}').touch()\n\n"
        "@pytest.mark.parametrize('i', range(4))\ndef test_long(held, i):\n    time.sleep(60)\n")
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "lab.stop_on_sigterm",
            "-c", str(tmp_path / "none.ini"), str(tmp_path / "test_t.py"), *(["-n", str(workers)] if workers else [])]
    (tmp_path / "none.ini").write_text("[pytest]\n")
    run = subprocess.Popen(argv, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("up-*"))) < max(workers, 1):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate(timeout=30)[0][-3000:]
        time.sleep(0.1)
    time.sleep(0.5)  # inside the tests' sleep
    os.killpg(run.pid, signal.SIGTERM)
    out = run.communicate(timeout=60)[0].decode()
    up = sorted(p.name.split("-")[1] for p in tmp_path.glob("up-*"))
    down = sorted(p.name.split("-")[1] for p in tmp_path.glob("down-*"))
    assert up and down == up, f"fixtures set up in {up} were torn down in {down}:\n{out[-3000:]}"
    assert run.returncode != 0, out[-3000:]


def test_a_child_forked_from_a_test_still_dies_of_sigterm():
    """The handler above is the pytest process's own: a child forked from a test (a pool's worker) inherits
    it, and must still end on SIGTERM as it did, not raise KeyboardInterrupt into whatever it runs."""
    pid = os.fork()
    if pid == 0:  # the child: wait to be stopped
        try:
            time.sleep(30)
        finally:
            os._exit(3)  # reached only if SIGTERM became an exception
    time.sleep(0.2)
    os.kill(pid, signal.SIGTERM)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
