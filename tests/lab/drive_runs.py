"""The driver against a stand-in server started in this process (the driver tests' set-up), or in its own
(:func:`standin_process`: the benchmarks)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

from hs_patch.host.driver.run import DriveConfig, Driver
from lab.standin_server import Engine, StandinServer


def start_standin(model_dir: Path, capture: Path, release: str) -> StandinServer:
    return StandinServer(Engine(str(model_dir), str(capture), release=release, chunked_prefill_size=48,
                                batch_window_ms=3)).start()


def config(server_url: str, capture: str, model_dir: Path, tmp_path: Path, data: list[Path], **kw) -> DriveConfig:
    base = dict(run="t", data=[str(d) for d in data], model=str(model_dir), server=server_url, capture_dir=capture,
                state_dir=str(tmp_path / "state"), samples_dir=str(tmp_path / "samples"), max_tokens=512,
                concurrency=4, retries=2, backoff=0.05, backoff_max=0.1, raw_timeout=10, status_interval=0.2,
                server_wait=10)
    base.update(kw)
    return DriveConfig(**base)


def drive(standin: StandinServer, model_dir: Path, tmp_path: Path, data: list[Path], *, usage=None, **kw):
    cfg = config(standin.url, standin.engine.capture.directory, model_dir, tmp_path, data, **kw)
    return Driver(cfg, **({"usage": usage} if usage else {})).run()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def standin_process(model_dir: Path, capture: Path, log: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """The stand-in server as a process of its own (in its own session) and its URL, once ``/server_info``
    answers (at most 120 s); ``args``: more of its options."""
    import requests

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("standin_server.py")), "--model",
                             str(model_dir), "--port", str(port), "--capture-dir", str(capture), "--threads", "1",
                             *args], stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/server_info", timeout=1).ok:
                return proc, url
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the stand-in server did not come up (exit {proc.poll()}): see {log}")
