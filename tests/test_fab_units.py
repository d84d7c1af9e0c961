"""fab's pieces that need no host: inventory reading, run names, snapshot, dashboard."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from hs_patch.control import dashboard
from hs_patch.host import snapshot
from hs_patch.control.inventory import ConfigError, check_run_name, load

ROOT = Path(__file__).resolve().parent.parent


def write_inventory(d: Path) -> Path:
    (d / "group_vars").mkdir(parents=True)
    (d / "host_vars").mkdir()
    (d / "hosts.yml").write_text(
        "all:\n  children:\n    gpu_hosts:\n      hosts:\n        gpu1:\n          ansible_host: 198.51.100.10\n"
        "          ansible_user: root\n          ansible_port: 2222\n")
    (d / "group_vars" / "gpu_hosts.yml").write_text(
        "hs_venv: /opt/v\nhs_server_port: 31000\nhs_dump_dir: /dev/shm/x\n"
        "hs_sglang_wheelhouse: '{{ playbook_dir }}/../wheelhouse'\nhs_capture_layers: [1, 2]\n")
    (d / "host_vars" / "gpu1.yml").write_text("hs_server_port: 32000\n")
    return d


def test_inventory_gives_connection_and_knobs(tmp_path):
    t = load("gpu1", str(write_inventory(tmp_path)))
    assert (t.host, t.user, t.port, t.venv, t.dump_dir) == ("198.51.100.10", "root", 2222, "/opt/v", "/dev/shm/x")
    assert t.server_port == 32000, "host_vars override group_vars"
    assert t.capture_layers == [1, 2] and t.bin("hs-extract") == "/opt/v/bin/hs-extract"
    assert t.state_dir("r1") == "/var/lib/hs-patch/runs/r1" and t.samples_dir("r1") == "/dev/shm/hs-runs/r1/samples"
    with pytest.raises(ConfigError, match="not in"):
        load("gpu2", str(tmp_path))
    with pytest.raises(ConfigError, match="no inventory"):
        load("gpu1", str(tmp_path / "nowhere"))


def test_production_inventory_has_the_seed_host():
    t = load("10.1.230.174", str(ROOT / "inventory"))
    assert t.user == "root" and t.venv.startswith("/")


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
