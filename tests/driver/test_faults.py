"""Faults with real processes: the stand-in server and ``hs-extract drive`` as subprocesses.

Each fault ends with the same check after a resume: 0 lost, 0 duplicated, 0 truncated
(every sample id once, verified against its manifest entry), nothing left behind.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from hs_patch.host.driver import runstate
from lab.runcheck import assert_complete, write_chats

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, capture: Path, port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "lab" / "standin_server.py"), "--model", str(model_dir),
                             "--port", str(port), "--capture-dir", str(capture), "--threads", "1"],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the stand-in exited: {log.read_text()[-2000:]}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/get_server_info", timeout=1).ok:
                return proc
        except requests.RequestException:
            time.sleep(0.2)
    stop(proc)
    raise AssertionError("the stand-in did not start within 90 s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def start_driver(tmp: Path, model_dir: Path, port: int, data: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "hs_patch.host.extract_cli", "drive", "--run", "fault", "--data", str(data),
           "--model", str(model_dir), "--server", f"http://127.0.0.1:{port}", "--capture-dir", str(tmp / "capture"),
           "--state-dir", str(tmp / "state"), "--samples-dir", str(tmp / "samples"), "--concurrency", "4",
           "--retries", "2", "--backoff", "0.2", "--backoff-max", "0.5", "--raw-timeout", "10",
           "--max-consecutive-failures", "4", "--status-interval", "0.2", "--server-wait", "60"]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=open(tmp / "driver.log", "ab"), stderr=subprocess.STDOUT)


def wait_done(state: Path, n: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(e["event"] == "done" for e in runstate.read_jsonl(state / "ledger.jsonl")) >= n:
            return
        assert proc.poll() is None, "the driver ended before the fault"
        time.sleep(0.05)
    raise AssertionError(f"fewer than {n} samples done within {timeout} s")


def finish(proc: subprocess.Popen, timeout: float = 120) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


@pytest.fixture
def dataset_path(tmp_path: Path) -> tuple[Path, list[str]]:
    data = tmp_path / "chats.jsonl"
    return data, write_chats(data, 60, words=40)


def test_kill_the_server_mid_run(tiny_model_dir, tmp_path, dataset_path):
    data, ids = dataset_path
    port, log = free_port(), tmp_path / "server.log"
    server = start_server(tiny_model_dir, tmp_path / "capture", port, log)
    try:
        driver = start_driver(tmp_path, tiny_model_dir, port, data)
        wait_done(tmp_path / "state", 10, driver)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        rc = finish(driver)
        status = json.loads((tmp_path / "state" / "status.json").read_text())
        assert rc in (3, 4) and status["samples"]["done"] < len(ids), (rc, status["message"])
        server = start_server(tiny_model_dir, tmp_path / "capture", port, log)
        assert finish(start_driver(tmp_path, tiny_model_dir, port, data)) == 0, (tmp_path / "driver.log").read_text()
    finally:
        stop(server)
    assert_complete(tmp_path / "samples", tmp_path / "capture", ids)


def test_stop_and_kill_the_driver_mid_run(tiny_model_dir, tmp_path, dataset_path):
    data, ids = dataset_path
    port = free_port()
    server = start_server(tiny_model_dir, tmp_path / "capture", port, tmp_path / "server.log")
    state = tmp_path / "state"
    try:
        driver = start_driver(tmp_path, tiny_model_dir, port, data)
        wait_done(state, 8, driver)
        driver.send_signal(signal.SIGTERM)  # a clean stop: the samples in flight finish
        assert finish(driver) == 130
        status = json.loads((state / "status.json").read_text())
        assert status["state"] == "stopped" and "SIGTERM" in status["message"]
        stopped_at = status["samples"]["done"]

        driver = start_driver(tmp_path, tiny_model_dir, port, data)
        wait_done(state, stopped_at + 8, driver)
        os.kill(driver.pid, signal.SIGKILL)  # no chance to clean up
        driver.wait(10)

        assert finish(start_driver(tmp_path, tiny_model_dir, port, data)) == 0, (tmp_path / "driver.log").read_text()
    finally:
        stop(server)
    assert_complete(tmp_path / "samples", tmp_path / "capture", ids)
    starts = [e for e in runstate.read_jsonl(state / "ledger.jsonl") if e["event"] == "run_start"]
    assert [e["resumed"] for e in starts] == [False, True, True]
