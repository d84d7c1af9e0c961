"""The driver against a stand-in server started in this process (the driver tests' set-up)."""

from __future__ import annotations

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
