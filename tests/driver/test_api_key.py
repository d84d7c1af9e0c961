"""The server's API key: SGLang's --api-key on the stand-in, sent by the driver from a file or the
environment, never on a command line or in a run file, and a missing key refused at the start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import requests

from hs_patch.host.driver import client
from hs_patch.host.driver.run import EXIT_OK, DriveConfig, Driver
from lab.runcheck import assert_complete, write_chats
from lab.standin_server import Engine, StandinServer

KEY = "k3y-" + "x" * 40
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def locked(tiny_model_dir, tmp_path_factory):
    srv = StandinServer(Engine(str(tiny_model_dir), str(tmp_path_factory.mktemp("capture")), release="0.5.16",
                               chunked_prefill_size=48, batch_window_ms=3), api_key=KEY).start()
    yield srv
    srv.close()


def _cfg(srv: StandinServer, model: Path, tmp: Path, data: Path, **kw) -> DriveConfig:
    return DriveConfig(run="k", data=[str(data)], model=str(model), server=srv.url,
                       capture_dir=srv.engine.capture.directory, state_dir=str(tmp / "state"),
                       samples_dir=str(tmp / "samples"), max_tokens=512, retries=1, backoff=0.05, raw_timeout=10,
                       status_interval=0.2, server_wait=10, **kw)


def test_the_stand_in_guards_like_sglang(locked):
    assert requests.get(locked.url + "/health", timeout=30).status_code == 200, "/health* needs no key"
    assert requests.get(locked.url + "/get_server_info", timeout=30).status_code == 401
    bad = {"Authorization": "Bearer nope"}
    assert requests.post(locked.url + "/generate", json={"input_ids": [1]}, headers=bad, timeout=30).status_code == 401
    good = {"Authorization": f"Bearer {KEY}"}
    assert requests.get(locked.url + "/get_server_info", headers=good, timeout=30).status_code == 200


def test_without_the_key_the_run_stops_at_the_start(locked, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(client.API_KEY_ENV, raising=False)
    data = tmp_path / "d.jsonl"
    write_chats(data, 3)
    with pytest.raises(client.ServerRejected, match="--api-key-file"):
        Driver(_cfg(locked, tiny_model_dir, tmp_path, data)).run()
    assert not (tmp_path / "samples").exists() or not list((tmp_path / "samples").glob("*.safetensors"))
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(client.ClientError, match="is empty"):
        Driver(_cfg(locked, tiny_model_dir, tmp_path, data, api_key_file=str(empty))).run()


@pytest.mark.parametrize("source", ["file", "env"])
def test_the_driver_sends_the_key_and_never_writes_it(locked, tiny_model_dir, tmp_path, monkeypatch, source):
    data = tmp_path / "d.jsonl"
    ids = write_chats(data, 4)
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    if source == "env":
        monkeypatch.setenv(client.API_KEY_ENV, KEY)
        cfg = _cfg(locked, tiny_model_dir, tmp_path, data)
    else:
        monkeypatch.delenv(client.API_KEY_ENV, raising=False)
        cfg = _cfg(locked, tiny_model_dir, tmp_path, data, api_key_file=str(key_file))
    summary = Driver(cfg).run()
    assert summary.exit_code == EXIT_OK, summary.message
    assert_complete(tmp_path / "samples", Path(locked.engine.capture.directory), ids)
    for f in (tmp_path / "state").rglob("*"):
        if f.is_file():
            assert KEY not in f.read_text(errors="replace"), f"the key is written in {f}"


def test_the_cli_takes_a_key_file_and_refuses_an_unreadable_one(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hs_patch.host.extract_cli", "drive", "--help"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "--api-key-file FILE" in out.stdout and "SGLANG_API_KEY" in out.stdout
    with pytest.raises(client.ClientError, match="cannot read the server's API key"):
        client.read_api_key(str(tmp_path / "missing"))
    (tmp_path / "k").write_text(f"  {KEY}  \nsecond line ignored\n")
    assert client.read_api_key(str(tmp_path / "k")) == KEY
