"""fab's pieces that need no host: its command line, run names, snapshot, dashboard."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from hs_patch.control import dashboard
from hs_patch.host.driver import snapshot
from hs_patch.control.inventory import ConfigError, check_run_name

ROOT = Path(__file__).resolve().parent.parent


def _fab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["fab", *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_fab_says_which_option_is_missing():
    out = _fab("extract")
    assert out.returncode == 1 and "give --host NAME" in out.stderr, out.stderr
    assert "positional" not in out.stdout + out.stderr
    out = _fab("extract", "--host", "gpu1")
    assert out.returncode == 1 and "give --dataset FILE" in out.stderr, out.stderr
    out = _fab("status")
    assert "fab status: give --host NAME" in out.stderr


def test_a_missing_local_dataset_is_found_before_connecting(tmp_path, monkeypatch):
    import fabfile
    from invoke import Context

    def no(*a, **k):
        raise AssertionError("fab read the inventory or connected before checking the dataset")

    monkeypatch.setattr(fabfile, "_target", no)
    monkeypatch.setattr(fabfile, "_connect", no)
    for dataset, why in ((tmp_path / "missing.jsonl", "not found here"), (tmp_path, "is a directory")):
        with pytest.raises(SystemExit, match=why):
            fabfile.extract(Context(), host="gpu1", dataset=str(dataset))
    with pytest.raises(SystemExit, match="must be an absolute path on the host"):
        fabfile.extract(Context(), host="gpu1", dataset="data/x.jsonl", remote_dataset=True)


def test_inventory_option_takes_a_file(tmp_path):
    inv = tmp_path / "hosts.yml"
    inv.write_text("all:\n  hosts:\n    gpu1:\n      ansible_host: 127.0.0.1\n      ansible_port: 1\n")
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    out = _fab("extract", "-h", "gpu1", "-i", str(inv), "-d", str(data))
    assert "no inventory" not in out.stderr and "cannot reach 127.0.0.1:1" in out.stderr, out.stderr
    out = _fab("extract", "-h", "gpu1", "-i", str(tmp_path / "nope.yml"), "-d", str(data))
    assert f"no inventory at {tmp_path / 'nope.yml'}:" in out.stderr, out.stderr


def test_run_names():
    assert check_run_name("kimi-2026.12_02") == "kimi-2026.12_02"
    for bad in ("", "../x", "a b", "-x", "x" * 65):
        with pytest.raises(ConfigError):
            check_run_name(bad)


def test_snapshot_reads_what_is_there(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "status.json").write_text(json.dumps({"state": "running", "samples": {"total": 10, "done": 4}}))
    (state / "rejects.jsonl").write_text('{"line": 3, "reason": "bad json"}\n{"torn')
    snap = snapshot.take("r1", str(state), str(tmp_path / "s"), str(tmp_path / "cap"), "sglang")
    assert snap["driver"]["samples"]["done"] == 4 and snap["shipper"] is None and snap["hook"] is None
    assert snap["rejects"] == [{"line": 3, "reason": "bad json"}]
    assert snap["dump"]["total"] > 0


SNAP = {
    "run": "r1", "time": 0,
    "driver": {"state": "running", "samples": {"total": 100, "done": 40, "rejected": 3, "duplicates": 1, "failed": 0,
                                               "in_flight": 8}, "tokens": {"done_now": 81920, "per_s": 2048.0},
               "bytes_written": 5.8e9, "dump": {"paused": True}, "errors": {"last": "timeout on line 7"}},
    "shipper": {"state": "shipping", "shipped": {"count": 30, "bytes": 4.4e9}, "pending": {"count": 10, "bytes": 1.4e9},
                "throughput_bytes_per_s": 1.1e8, "last_error": None},
    "hook": {"waits": 2, "wait_seconds": 0.5, "error": None},
    "units": {"hs-drive-r1": {"ActiveState": "active"}, "hs-ship-r1": {"ActiveState": "active"},
              "sglang": {"ActiveState": "active"}},
    "dump": {"used_pct": 81.0}, "samples": {"used_pct": 12.0},
    "gpus": [{"index": "0", "name": "NVIDIA RTX PRO 6000 Blackwell", "util": 97, "mem_used": 90000, "mem_total": 97000}],
    "rejects": [{"source": "chat.jsonl", "line": 5, "reason": "no assistant turn"}],
}


def test_dashboard_shows_progress_rates_gpus_and_problems():
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    code = dashboard.watch(lambda: SNAP, "gpu1", "r1", once=True, console=console)
    text = out.getvalue()
    assert code == 0
    for needle in ("40 done / 100", "PAUSED", "2,048", "5.80 GB", "30 (4.40 GB)", "chat.jsonl:5", "RTX PRO 6000", "97%",
                   "no assistant turn", "timeout on line 7", "81.0% used"):
        assert needle in text, needle
    assert not dashboard.done(SNAP)
    finished = {**SNAP, "units": {"hs-drive-r1": {"ActiveState": "inactive"}, "hs-ship-r1": {"ActiveState": "inactive"}}}
    assert dashboard.done(finished)


def test_a_driver_that_stops_short_ends_the_dashboard_with_exit_1_while_the_shipper_follows():
    """A driver stopped by its failures leaves the shipper following (for a resume): fab must not wait for it."""
    snap = {**SNAP, "driver": {**SNAP["driver"], "state": "stopped", "message": "stopped after 20 consecutive failures"},
            "units": {"hs-drive-r1": {"ActiveState": "failed", "ExecMainStatus": "4"},
                      "hs-ship-r1": {"ActiveState": "active"}}}
    assert dashboard.stopped_short(snap) and dashboard.done(snap)
    out = io.StringIO()
    assert dashboard.watch(lambda: snap, "gpu1", "r1", interval=0.01,
                           console=Console(file=out, width=200, force_terminal=False)) == 1
    assert "driver stopped" in out.getvalue() and "20 consecutive failures" in out.getvalue()
    assert "run the same fab extract again to resume" in out.getvalue()
    running = {**snap, "units": {**snap["units"], "hs-drive-r1": {"ActiveState": "active"}}}
    assert not dashboard.done(running), "a driver still running (state stopped is only final once its unit ends)"
