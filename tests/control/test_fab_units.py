"""fab's pieces that need no host: its command line, run names, snapshot, dashboard."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from rich.console import Console

from hs_patch.control import dashboard, verdict
from hs_patch.host.driver import snapshot
from hs_patch.control.inventory import ConfigError, check_run_name
from lab.snapshots import SNAP, Local, poller

ROOT = Path(__file__).resolve().parents[2]


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
    out = _fab("status", "--host", "nosuch", "--interval", "0.5", "--once")  # was "--interval takes an int"
    assert "is not in inventory" in out.stderr and "--interval" not in out.stderr, out.stderr
    out = _fab("stop", "--host", "gpu1", "--hosts", "gpu", "--run", "r1")  # --host was not used, said nothing
    assert out.returncode == 1 and "fab stop: give --host NAME (one host) or --hosts GROUP (a fleet), not both" \
        in out.stderr, out.stderr


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
    # a file this user cannot read (mode 0 for a non-root operator; root reads anything, so access(2) says no
    # here for that one path): it was a traceback from the upload's checksum
    unreadable = tmp_path / "private.jsonl"
    unreadable.write_text("{}\n")
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == unreadable else access(p, mode))
    with pytest.raises(SystemExit, match="is not readable by this user"):
        fabfile.extract(Context(), host="gpu1", dataset=str(unreadable))
    with pytest.raises(SystemExit, match="must be an absolute path on the host"):
        fabfile.extract(Context(), host="gpu1", dataset="data/x.jsonl", remote_dataset=True)


def test_bad_numbers_and_run_names_are_refused_before_connecting(tmp_path, monkeypatch):
    """--interval -1 reached time.sleep only once the units were started (a traceback after the job began);
    --limit -5 reached the driver on the host; a run name no host can have was checked after connecting."""
    import fabfile
    from invoke import Context

    def no(*a, **k):
        raise AssertionError("fab read the inventory or connected before checking its options")

    monkeypatch.setattr(fabfile, "_target", no)
    monkeypatch.setattr(fabfile, "_connect", no)
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    for kw, said in (({"interval": -1}, "--interval -1 must be a number of seconds >= 0.2"),
                     ({"interval": 0.001}, "--interval 0.001 must be"),  # every host read 1000 times a second
                     ({"interval": 0}, "--interval 0 must be"), ({"dead_after": float("nan")}, "--dead-after nan"),
                     ({"limit": -5}, "--limit -5 must be a whole number >= 0"),
                     ({"max_tokens": 0}, "--max-tokens 0 must be a whole number >= 1"),
                     ({"server_timeout": -5}, "--server-timeout -5 must be a number of seconds > 0")):
        with pytest.raises(SystemExit, match=said):
            fabfile.extract(Context(), host="gpu1", dataset=str(data), **kw)
    # a '$' systemd would expand in the driver's command line: refused after the upload and the server's start
    dollar = tmp_path / "chat$2026.jsonl"
    dollar.write_text("{}\n")
    for kw in ({"dataset": str(dollar)}, {"dataset": "/data/$HOME/x.jsonl", "remote_dataset": True}):
        with pytest.raises(SystemExit, match=r"a '\$' in its (name|path) would be expanded by systemd"):
            fabfile.extract(Context(), host="gpu1", **kw)
    # no --run: a name made from the file's, whatever the file is called (it was refused as a name never given)
    assert re.fullmatch(r"my-data-\d{8}-\d{6}", fabfile.default_run_name("my data"))
    long = fabfile.default_run_name("x" * 100 + ".v2")
    assert len(long) <= 64 and fabfile.check_run_name(long) and fabfile.default_run_name("..").startswith("run-")
    with pytest.raises(SystemExit, match="--interval -1"):
        fabfile.status(Context(), host="gpu1", interval=-1)
    for task in (fabfile.status, fabfile.stop, fabfile.ship):
        with pytest.raises(SystemExit) as e:
            task(Context(), host="gpu1", run="bad name")
        assert "run name 'bad name'" in str(e.value.code)  # sys.exit(message): exit 1
    out = _fab("status", "--host", "gpu1", "--dead-after", "x")
    assert out.returncode == 1 and out.stderr.strip() == "--dead-after takes a float, not 'x'", out.stderr


def test_max_tokens_reaches_the_kv_check_the_space_check_and_the_driver(tmp_path, monkeypatch):
    """The KV cache refusal says to send shorter samples with --max-tokens: fab extract takes it, checks the
    server's KV cache and the free space for it, and the driver on the host gets it (its own parser reads
    what fab passes)."""
    import argparse

    import fabfile
    from invoke import Context

    from hs_patch.control import extraction, fleet, fleet_run, host_checks, remote, sizing
    from hs_patch.control.inventory import Target
    from hs_patch.host.driver.cli import add_arguments, drive_config

    seen: dict = {}
    monkeypatch.setattr(fabfile, "_target", lambda *a: Target(host="gpu1", name="gpu1"))
    monkeypatch.setattr(fabfile, "_connect", lambda t: "conn")
    monkeypatch.setattr(sizing, "remote_size", lambda c, path: 1 << 20)
    monkeypatch.setattr(sizing, "remote_lines", lambda c, path: 10)
    monkeypatch.setattr(sizing, "run_status", lambda c, t, run: {})
    monkeypatch.setattr(sizing, "estimate_bytes", lambda c, t, size: (size, 100))
    monkeypatch.setattr(host_checks, "preflight", lambda c, t, **kw: seen.setdefault("preflight", kw) and [])
    for step in ("prepare", "start_server"):
        monkeypatch.setattr(remote, step, lambda *a, **k: None)
    monkeypatch.setattr(remote, "check_kv_cache", lambda c, t, max_tokens: seen.setdefault("kv", max_tokens))
    monkeypatch.setattr(remote, "start_jobs", lambda c, t, run, args, dest=None: seen.setdefault("args", args) and [])
    fabfile.extract(Context(), host="gpu1", dataset="/data/d.jsonl", remote_dataset=True, run="r1", limit=3,
                    max_tokens=4096, detach=True)
    assert seen["kv"] == 4096 and seen["preflight"]["max_tokens"] == 4096
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = drive_config(p.parse_args(["--run", "r1", *seen["args"]]))
    assert (cfg.max_tokens, cfg.limit, cfg.data) == (4096, 3, ["/data/d.jsonl"])
    # without --max-tokens the driver gets fab's default, which is the driver's own
    seen.clear()
    fabfile.extract(Context(), host="gpu1", dataset="/data/d.jsonl", remote_dataset=True, run="r1", detach=True)
    assert drive_config(p.parse_args(["--run", "r1", *seen["args"]])).max_tokens == remote.MAX_SAMPLE_TOKENS == \
        drive_config(p.parse_args(["--run", "r1", "--data", "x", "--model", "m"])).max_tokens
    plan = fleet.Plan("r2", {"gpu1": 0, "gpu2": 1})
    jobs = fleet_run.jobs_for(plan, [Target(host="a", name="gpu1")], "/d", True, 0, False, 2048)
    assert jobs["gpu1"].max_tokens == 2048 and isinstance(jobs["gpu1"], extraction.Job)
    assert "--accept-changed-data" not in jobs["gpu1"].driver_args
    # the driver's refusal of a changed dataset names --accept-changed-data: fab takes it to the driver
    seen.clear()
    fabfile.extract(Context(), host="gpu1", dataset="/data/d.jsonl", remote_dataset=True, run="r1", detach=True,
                    accept_changed_data=True)
    assert drive_config(p.parse_args(["--run", "r1", *seen["args"]])).accept_changed_data is True
    jobs = fleet_run.jobs_for(plan, [Target(host="a", name="gpu1")], "/d", True, 0, False, 2048, True)
    assert drive_config(p.parse_args(["--run", "r1", *jobs["gpu1"].driver_args, "--data", "x", "--model", "m"])
                        ).accept_changed_data is True


def test_the_space_check_asks_room_for_what_the_run_still_ships(tmp_path, monkeypatch):
    """Storage must hold the run's estimate: for the whole dataset that asked a --limit trial for ~18,000 times the
    dataset's bytes, and a resumed run for all of it again. It asks for the limit's share of the lines, less what an
    earlier start of the same run has shipped (its status.json), on a local and on a remote dataset."""
    from hs_patch.control import extraction, host_checks, remote, sizing
    from hs_patch.control.inventory import Target

    data = tmp_path / "d.jsonl"
    data.write_bytes(b'{"messages": []}\n' * 99 + b'{"messages": []}')  # 100 lines, the last without a newline
    status: dict = {}
    seen: list = []
    monkeypatch.setattr(sizing, "estimate_bytes", lambda c, t, size: (size * 1000, 100))
    monkeypatch.setattr(sizing, "remote_size", lambda c, path: data.stat().st_size)
    monkeypatch.setattr(sizing, "remote_lines", lambda c, path: 100)
    monkeypatch.setattr(sizing, "run_status", lambda c, t, run: status)
    monkeypatch.setattr(host_checks, "preflight", lambda c, t, **kw: seen.append(kw["estimated_bytes"]) or [])
    full = data.stat().st_size * 1000
    for remote_dataset in (False, True):
        job = lambda *args: extraction.Job("r", str(data), remote_dataset, list(args))  # noqa: E731
        t = Target(host="gpu1")
        for args, shipped, expected in [((), None, full), (("--limit", "10"), None, full // 10),
                                        (("--limit", "1000"), None, full), ((), 50, full // 2),
                                        (("--limit", "10"), 4, full // 10 * 6 // 10)]:
            status.clear()
            if shipped is not None:
                status.update({"samples": {"total": 10 if args else 100}, "shipping": {"shipped": shipped}})
            extraction.preflight("conn", t, job(*args))
            assert seen[-1] == expected, (remote_dataset, args, shipped)
    ended = tmp_path / "e.jsonl"
    ended.write_bytes(b"{}\n" * 7)
    assert sizing.count_lines(data) == 100 and sizing.count_lines(ended) == 7


def test_with_shipping_off_the_samples_space_must_hold_the_whole_run_below_the_high_water():
    """Nothing ships the samples away when hs_ship_enabled is false: the run stays in the samples dir, and the driver
    pauses for good at its high water. The check asked room for one sample; it asks for the run below the mark."""
    from types import SimpleNamespace

    from hs_patch.control import host_checks, remote
    from hs_patch.control.inventory import Target
    from hs_patch.control.shell import Shell
    from hs_patch.host.driver.config import DriveConfig

    class Host:  # a 1 GiB tmpfs, all of it free
        host = "gpu"

        def run(self, line, **kw):
            out = "Filesystem 1024-blocks Used Available Capacity Mounted on\ntmpfs 1048576 0 1048576 0% /dev/shm\n" \
                if line.startswith("df -Pk") else ""
            return SimpleNamespace(ok=True, failed=False, exited=0, stdout=out, stderr="")

    def samples_check(ship: bool, estimated: int):
        t = Target(host="gpu", ship_enabled=ship)
        return next(ch for ch in host_checks.preflight(Shell(Host(), t), t, estimated_bytes=estimated,
                                                      bytes_per_token=1, need_gpus=False) if ch.name == "samples space")

    assert remote.HIGH_WATER_PCT == DriveConfig.high_water, "the driver's default, named once on each side"
    fits, too_big = samples_check(False, 700 << 20), samples_check(False, 900 << 20)
    assert fits.ok and "0.8 GiB for /dev/shm" in fits.detail and "(shipping is off)" in fits.detail, fits
    assert not too_big.ok and too_big.fix.startswith("shipping is off (hs_ship_enabled: false): free 0.1 GiB more"), \
        too_big
    assert samples_check(True, 900 << 20).ok  # shipping frees the space as it goes: one sample's room is enough


def test_fab_list_shows_each_task_in_a_whole_sentence():
    """fab --list shows a docstring's first line: it was cut mid-sentence ('...(resume with fab extract);')."""
    import fabfile

    out = _fab("--list")
    assert out.returncode == 0, out.stderr
    listed = re.findall(r"^  (\w+)\s+(.*(?:\n {12}.*)*)", out.stdout, re.M)
    assert sorted(name for name, _ in listed) == ["extract", "ship", "status", "stop", "verify"], out.stdout
    for name, text in listed:
        first = getattr(fabfile, name).__doc__.strip().splitlines()[0]
        assert first.endswith(".") and " ".join(text.split()) == first, (name, text)


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
    assert snap["samples_left"] is None  # no samples dir yet
    (tmp_path / "s").mkdir()
    for name in ("a.safetensors", "b.safetensors", "manifest.jsonl", ".hs-samples.lock"):
        (tmp_path / "s" / name).write_text("")
    assert snapshot.take("r1", str(state), str(tmp_path / "s"), str(tmp_path / "cap"), "sglang")["samples_left"] == 2


def test_dashboard_shows_progress_rates_gpus_and_problems():
    out = io.StringIO()
    console = Console(file=out, width=120, force_terminal=False)
    changed = "chat.jsonl changed since the last start; 38 held sample(s) kept, 2 of lines no longer there"
    regen = {"lines": 30, "answers_kept": 30, "answers_left_out": 45}
    snap = {**SNAP, "driver": {**SNAP["driver"], "dataset": {"message": changed}, "regenerate": regen}}
    code = dashboard.watch(poller(gpu1=lambda: snap), "gpu1", "r1", once=True, console=console)
    text = out.getvalue()
    assert code == 0
    for needle in ("40 done / 100", "PAUSED", "2,048", "5.80 GB", "30 (4.40 GB)", "chat.jsonl:5", "RTX PRO 6000", "97%",
                   "no assistant turn", "timeout on line 7", "81.0% used", "dataset: chat.jsonl changed since",
                   "regenerate: 45 of 75 generated answers are not in the samples"):
        assert needle in " ".join(text.split()), needle
    assert not verdict.ended(SNAP)
    finished = {**SNAP, "units": {"hs-drive-r1": {"ActiveState": "inactive"}, "hs-ship-r1": {"ActiveState": "inactive"}}}
    assert verdict.ended(finished)


def test_a_driver_that_stops_short_ends_the_dashboard_with_exit_1_while_the_shipper_follows():
    """A driver stopped by its failures leaves the shipper following (for a resume): fab must not wait for it."""
    snap = {**SNAP, "driver": {**SNAP["driver"], "state": "stopped", "message": "stopped after 20 consecutive failures"},
            "units": {"hs-drive-r1": {"ActiveState": "failed", "ExecMainStatus": "4"},
                      "hs-ship-r1": {"ActiveState": "active"}}}
    assert verdict.ended(snap)
    out = io.StringIO()
    assert dashboard.watch(poller(gpu1=lambda: snap), "gpu1", "r1", interval=0.01,
                           console=Console(file=out, width=200, force_terminal=False)) == 1
    lines = out.getvalue().rstrip().splitlines()
    assert "gpu1: the driver stopped (exit 4): stopped after 20 consecutive failures" in lines
    assert "gpu1: 56 line(s) not attempted: the driver stopped before them" in lines
    assert lines[-1] == ("incomplete: 59 of 100 line(s) not held (3 rejected, 56 not attempted); 3 can never be "
                         "extracted as they are; run the same fab extract again for the rest"), lines[-1]
    running = {**snap, "units": {**snap["units"], "hs-drive-r1": {"ActiveState": "active"}}}
    assert not verdict.ended(running), "a driver still running (state stopped is only final once its unit ends)"


def ended_run(run: str, total: int, failed: list[dict], rejected: int = 0) -> dict:
    """A run whose driver finished (exit 3 when something failed) and whose shipper shipped all it made."""
    done = total - len(failed) - rejected
    code = "3" if failed else "0"
    return {"run": run, "driver": {"state": "finished", "message": "...",
                                   "samples": {"total": total, "done": done, "rejected": rejected, "duplicates": 0,
                                               "failed": len(failed), "remaining": 0},
                                   "missing": {"lines": len(failed) + rejected, "rejected": rejected,
                                               "failed": len(failed), "not_attempted": 0,
                                               "never": rejected + sum(not f["retry"] for f in failed),
                                               "shown": failed}},
            "shipper": {"state": "done", "shipped": {"count": done}, "pending": {"count": 0}},
            "units": {f"hs-drive-{run}": {"ActiveState": "failed" if failed else "inactive", "ExecMainStatus": code},
                      f"hs-ship-{run}": {"ActiveState": "inactive", "ExecMainStatus": "0"}}}


FIDELITY = {"sample_id": "chats.jsonl:17", "retry": True, "runs_failed": 1,
            "why": "failed at fidelity: the dumped final state gives other tokens than the server's at 1 of 1 last "
                   "position(s)"}


def test_a_run_that_ended_with_a_failed_sample_exits_1_naming_it_one_host_and_a_fleet():
    """The issue's run: the driver finished with 1 failed (its exit 3), the shipper shipped the rest. fab said
    'finished' and exited 0; it must exit 1 and say which line is missing and why."""
    from hs_patch.control.fleet_dashboard import Row, ending

    snap = ended_run("r1", 300, [FIDELITY])
    assert verdict.ended(snap)
    out = io.StringIO()
    assert dashboard.watch(poller(gpu1=lambda: snap), "gpu1", "r1", interval=0.01,
                           console=Console(file=out, width=300, force_terminal=False)) == 1
    lines = out.getvalue().rstrip().splitlines()
    assert lines[-2] == "gpu1: chats.jsonl:17 " + FIDELITY["why"]
    assert lines[-1] == ("incomplete: 1 of 300 line(s) not held (1 failed); run the same fab extract again for "
                         "the rest"), lines[-1]

    rows = [Row("gpu1", "gpu1", "f", "0/3", "gpu1"), Row("gpu2", "gpu2", "f", "1/3", "gpu2"),
            Row("gpu3 (shard of gpu4)", "gpu3", "f.gpu4", "2/3", "gpu4")]
    never = {"sample_id": "chats.jsonl:5", "retry": False, "runs_failed": 2,
             "why": "failed at intent: cannot write the sample's intent: provenance metadata over 16384 bytes"}
    snaps = {"gpu1": ended_run("f", 300, []), "gpu2": ended_run("f", 299, [FIDELITY]),
             "gpu3 (shard of gpu4)": ended_run("f.gpu4", 301, [never], rejected=2)}
    end = ending(rows, snaps, "f", "fab status --hosts gpu_hosts --run f", 120)
    assert end.code == 1 and end.lines[:2] == ["gpu2: chats.jsonl:17 " + FIDELITY["why"],
                                               "gpu3 (shard of gpu4): chats.jsonl:5 " + never["why"]
                                               + "; it can never be extracted as it is"], end.lines
    assert end.lines[-1] == ("incomplete: 4 of 900 line(s) not held (2 rejected, 2 failed); 3 can never be "
                             "extracted as they are; run the same fab extract again for the rest"), end.lines[-1]
    snaps["gpu2"] = ended_run("f", 299, [])
    snaps["gpu3 (shard of gpu4)"] = ended_run("f.gpu4", 301, [never])
    assert ending(rows, snaps, "f", "", 120).lines[-1] == (
        "incomplete: 1 of 900 line(s) not held (1 failed); running it again will not extract them: change those "
        "lines (missing.jsonl says why)")
    done = {r.label: ended_run(r.run, 300, []) for r in rows}
    assert ending(rows, done, "f", "", 120) == dashboard.Ending(
        0, ["complete: every line is held (900 samples, shipped and verified at the destination)"], "green")
    # a shipper that counted nothing pending while samples are still in the samples dir: not complete
    stale = ended_run("f", 300, [])
    stale["samples_left"] = 6
    assert verdict.gaps(stale) == ["6 extracted sample(s) not at the destination (shipper inactive, exit 0); fab ship "
                                   "sends them"]
    # shipping off: no shipper; fab says where the samples are, and that a tmpfs loses them at a reboot
    alone = ended_run("f", 300, [])
    del alone["shipper"], alone["units"]["hs-ship-f"]
    alone["samples"] = {"path": "/dev/shm/hs-runs/f/samples", "total": 1 << 30, "free": 1 << 29, "used_pct": 50.0}
    assert dashboard.conclusion([("gpu1", alone)]) == dashboard.Ending(0, [
        "complete: every line is held (300 samples, not shipped: shipping is off), in "
        "gpu1:/dev/shm/hs-runs/f/samples; copy them off before a reboot where that is a tmpfs (/dev/shm: RAM)"], "green")
    unshipped = {**done, "gpu1": {**done["gpu1"], "shipper": {"pending": {"count": 4}, "last_error": "refused"},
                                  "units": {**done["gpu1"]["units"],
                                            "hs-ship-f": {"ActiveState": "failed", "ExecMainStatus": "1"}}}}
    end = ending(rows, unshipped, "f", "", 120)
    assert end.code == 1 and end.lines[0] == ("gpu1: 4 extracted sample(s) not at the destination (shipper failed, "
                                              "exit 1: refused); fab ship sends them")
    assert end.lines[-1] == ("incomplete: 4 extracted sample(s) not at the destination; run the same fab extract "
                             "again for the rest")


def test_h_alone_is_the_tasks_help_and_a_bad_number_is_one_line():
    for name in ("extract", "status", "ship"):
        out = _fab(name, "-h")
        assert out.returncode == 0 and f"fab [--core-opts] {name} [--options]" in out.stdout, out.stderr
        assert "--known-hosts" in out.stdout and "needed value" not in out.stderr
    out = _fab("extract", "--host", "gpu1", "--limit", "abc")
    assert out.returncode == 1 and out.stderr.strip() == "--limit takes a whole number, not 'abc'", out.stderr


def test_host_with_its_value_forgotten_fails_and_a_mistyped_name_gets_the_nearest():
    """`fab extract --host` (the value forgotten) printed the task's help and exited 0, as -h does; a mistyped
    task or option got only "No idea what 'extrct' is!"."""
    for name in ("extract", "stop", "verify"):
        out = _fab(name, "--host")
        assert out.returncode == 1 and out.stderr.strip() == (
            f"fab {name}: --host needs a value: the GPU host's name or address in the inventory (--host NAME); "
            f"fab --help {name} lists every option"), out.stdout + out.stderr
    for argv, said in ((["extrct"], "No idea what 'extrct' is! Did you mean 'extract'? (fab --list shows the tasks)"),
                       (["stauts", "--host", "gpu1"], "Did you mean 'status'?"),
                       (["extract", "--dataet", "x"], "No idea what '--dataet' is! Did you mean '--dataset'? "
                                                      "(fab --help extract lists its options)"),
                       (["qqqq"], "No idea what 'qqqq' is! (fab --list shows the tasks)")):
        out = _fab(*argv)
        assert out.returncode == 1 and said in out.stderr, (argv, out.stderr)


def test_stop_says_in_words_what_it_stopped(monkeypatch, capsys):
    """fab stop printed a Python dict: "stopped: {'hs-drive-r1': 'inactive', 'hs-ship-r1': 'inactive'}"."""
    import fabfile
    from invoke import Context

    from hs_patch.control import remote
    from hs_patch.control.inventory import Target

    monkeypatch.setattr(fabfile, "_target", lambda *a: Target(host="gpu1", name="gpu1"))
    monkeypatch.setattr(fabfile, "_connect", lambda t: "conn")
    monkeypatch.setattr(fabfile, "_pick_run", lambda c, t, run: "r1")
    monkeypatch.setattr(remote, "stop", lambda c, t, run, server=False: {
        "hs-drive-r1": "inactive", "hs-ship-r1": "failed", **({"sglang": "inactive"} if server else {})})
    fabfile.stop(Context(), host="gpu1", server=True)
    out = capsys.readouterr().out
    assert out.strip() == ("[fab] hs-drive-r1 stopped, hs-ship-r1 stopped (it had failed: journalctl -u hs-ship-r1 "
                           "says why), sglang stopped; resume with the same fab extract --run r1, drain with fab ship "
                           "--host gpu1 --run r1"), out
    assert remote.in_words({"u": "active"}) == "u STILL RUNNING (systemctl status u)"
    # a unit the stop left running: said, and the exit says so too (it was 0)
    monkeypatch.setattr(remote, "stop", lambda c, t, run, server=False: {"hs-drive-r1": "active",
                                                                         "hs-ship-r1": "inactive"})
    with pytest.raises(SystemExit) as e:
        fabfile.stop(Context(), host="gpu1")
    assert e.value.code == 1 and "hs-drive-r1 STILL RUNNING" in capsys.readouterr().out


def test_a_fleet_stop_that_leaves_a_unit_running_names_its_host_and_fails(monkeypatch):
    """fab stop --hosts exited 0 when a host's units were still active after the stop (only a host that did
    not answer counted)."""
    from hs_patch.control import fleet_run, remote

    monkeypatch.setattr(fleet_run, "on_each_host", lambda inv, plan, group, step, after=None: {
        "gpu-a": {"gpu-a": {"hs-drive-f1": "inactive", "hs-ship-f1": "inactive"}},
        "gpu-b": {"gpu-b": {"hs-drive-f1": "active", "hs-ship-f1": "inactive"}}})
    said: list[str] = []
    plan = type("Plan", (), {"run": "f1"})()
    assert fleet_run.stop_all(None, plan, "gpus", False, said.append) == 1
    assert said[-1].endswith("not stopped: gpu-b") and any("hs-drive-f1 STILL RUNNING" in s for s in said), said
    assert remote.all_stopped({"a": "inactive", "b": "failed"}) and not remote.all_stopped({"a": "deactivating"})


def test_a_fleet_stop_with_server_keeps_the_jobs_stopped_when_only_a_server_fails(monkeypatch):
    """fab stop --hosts --server ran the server's stop after the host's jobs in one step: a failure there made the
    whole host "NOT stopped" though its jobs were, and the servers' states were never said."""
    from hs_patch.control import fleet_run, remote
    from hs_patch.control.fleet_dashboard import Row
    from hs_patch.control.inventory import Target
    from hs_patch.control.shell import RemoteError

    class Group:  # every host answers; each step runs as FleetGroup.try_each runs it
        def __init__(self, targets):
            self.targets = targets

        def try_each(self, fn):
            return {t.name: fn(None, t) for t in self.targets}

        def close(self):
            pass

    def stop_server(c, t):
        if t.name == "gpu-b":
            raise RemoteError("on gpu-b: `systemctl stop sglang.service` did not finish within 300 s")
        return "inactive"

    monkeypatch.setattr(fleet_run, "group_rows", lambda inv, plan, group, every=False: [
        Row("gpu-a", "gpu-a", "f1"), Row("gpu-b", "gpu-b", "f1")])
    monkeypatch.setattr(fleet_run.FleetGroup, "of", Group)
    monkeypatch.setattr(remote, "stop", lambda c, t, run: {f"hs-drive-{run}": "inactive", f"hs-ship-{run}": "inactive"})
    monkeypatch.setattr(remote, "stop_server", stop_server)
    inv = type("Inv", (), {"target": staticmethod(lambda h: Target(host=h, name=h, service="sglang"))})()
    said: list[str] = []
    assert fleet_run.stop_all(inv, type("Plan", (), {"run": "f1"})(), "gpus", True, said.append) == 1
    assert "gpu-b: hs-drive-f1 stopped, hs-ship-f1 stopped" in said, said
    assert "gpu-a (server): sglang stopped" in said, said
    assert any(s.startswith("gpu-b (server): NOT stopped: on gpu-b: `systemctl stop") for s in said), said
    assert said[-1].endswith("not stopped: gpu-b"), said


def test_each_option_has_the_same_short_flag_in_every_task():
    import fabfile

    shorts: dict[str, set[str]] = {}
    for name in ("extract", "status", "stop", "ship", "verify"):
        for arg in getattr(fabfile, name).get_arguments():
            shorts.setdefault(arg.names[0], set()).update(arg.names[1:] or ["(none)"])
    assert all(len(s) == 1 for s in shorts.values()), shorts
    letters = [s for v in shorts.values() for s in v if s != "(none)"]
    assert len(letters) == len(set(letters)), f"one letter, one option: {shorts}"
    assert shorts["host"] == {"h"} and shorts["hosts"] == {"o"} and shorts["inventory"] == {"i"}


def test_a_run_the_host_does_not_have_is_refused_naming_the_runs_it_has(monkeypatch):
    import fabfile
    from hs_patch.control import remote
    from hs_patch.control.inventory import Target

    t = Target(host="gpu1", state_root="/var/lib/hs-patch/runs")
    monkeypatch.setattr(remote, "runs", lambda c, target: ["kimi-v2", "kimi-v1"])
    with pytest.raises(SystemExit, match=r"no run 'nope' on gpu1 \(under /var/lib/hs-patch/runs\); its runs, newest "
                                         r"first: kimi-v2, kimi-v1"):
        fabfile._pick_run(None, t, "nope")
    assert fabfile._pick_run(None, t, "kimi-v1") == "kimi-v1" and fabfile._pick_run(None, t, None) == "kimi-v2"
    monkeypatch.setattr(remote, "runs", lambda c, target: [])
    with pytest.raises(SystemExit, match="no run 'nope' on gpu1 .*none yet; start one with fab extract"):
        fabfile._pick_run(None, t, "nope")


def test_both_dashboards_follow_until_done_and_end_on_a_silent_host_or_ctrl_c():
    from hs_patch.control.fleet_dashboard import Row, watch as fleet_watch
    from hs_patch.control.poll import Poller

    out = io.StringIO()
    console = Console(file=out, width=300, force_terminal=False)
    views = iter([OSError("timed out")] * 4 + [dict(SNAP, n=1)] + [OSError("reset")] * 2 + [dict(SNAP, n=2)] * 99)

    def fetch():
        v = next(views)
        if isinstance(v, Exception):
            raise v
        return v

    seen = []
    p = poller(gpu1=fetch)
    code = dashboard.follow(p, lambda a, now: seen.append(a["gpu1"]),
                            lambda a, now: dashboard.Ending(0, ["done"]) if a["gpu1"].ok and a["gpu1"].value["n"] == 2
                            else None, console=console, interval=0.005, detached="detached")
    assert code == 0 and out.getvalue().rstrip().endswith("done"), "failures, a view, failures: it follows on"
    assert p.readers[0].drops >= 6, "each failed read drops the link (the next read connects again)"

    def down():
        raise OSError("Connection refused")

    t0 = time.monotonic()
    assert dashboard.watch(poller(gpu1=down), "gpu1", "r1", interval=0.01, dead_after=0.5, console=console) == 2
    assert 0.5 <= time.monotonic() - t0 < 5
    assert re.fullmatch(r"lost the connection to gpu1: no answer for \d s \(Connection refused\)\. The job goes on "
                        r"there; reattach with: fab status --host gpu1 --run r1", last_line(out)), out.getvalue()[-300:]

    class Interrupted(Poller):
        def latest(self):
            raise KeyboardInterrupt

    assert dashboard.watch(Interrupted([Local("gpu1", lambda: SNAP)], interval=1), "gpu1", "r1", interval=0,
                           console=console) == 2
    assert "detached; the job goes on on gpu1" in out.getvalue()
    rows = [Row("gpu1", "gpu1", "r1", "0/2"), Row("gpu2", "gpu2", "r1", "1/2")]
    assert fleet_watch(poller(gpu1=down, gpu2=down), rows, "r1", "fab status --hosts gpu --run r1", interval=0.01,
                       dead_after=0.3, console=console) == 2
    assert re.fullmatch(r"no host answers \(for \d s or more\): is this machine's network up\? The jobs go on "
                        r"there; reattach with: fab status --hosts gpu --run r1", last_line(out)), out.getvalue()[-300:]
    # a host that answers but whose run's status cannot be read is not a lost connection, nor a network that is down
    from hs_patch.control.shell import StatusUnreadable

    def unreadable():
        raise StatusUnreadable("cannot read the run's status on gpu1: no such run")

    assert dashboard.watch(poller(gpu1=unreadable), "gpu1", "r1", interval=0.01, dead_after=0.3, console=console) == 2
    assert re.fullmatch(r"gpu1: answers, but no status read for \d s \(cannot read the run's status on gpu1: no such "
                        r"run\)\. The job goes on there; reattach with: fab status --host gpu1 --run r1",
                        last_line(out)), out.getvalue()[-300:]
    assert fleet_watch(poller(gpu1=unreadable, gpu2=unreadable), rows, "r1", "fab status --hosts gpu --run r1",
                       interval=0.01, dead_after=0.3, console=console) == 3
    assert not any("network up" in x for x in out.getvalue().splitlines()[-3:]) and \
        "gpu2: answers, but no status read for" in out.getvalue(), out.getvalue()[-600:]
    assert last_line(out).startswith("no status from: gpu1, gpu2: their hosts answer, but the run's status cannot be "
                                     "read there (fab verify --host HOST checks the install)"), last_line(out)
    # --once exits as a single host's does: it said 0 whatever the hosts answered
    for fetches, code in (({"gpu1": lambda: SNAP, "gpu2": lambda: SNAP}, 0), ({"gpu1": lambda: SNAP, "gpu2": down}, 3),
                          ({"gpu1": down, "gpu2": down}, 2)):
        assert fleet_watch(poller(**fetches), rows, "r1", "fab status --hosts gpu --run r1", once=True,
                           console=console) == code, fetches


def last_line(out: io.StringIO) -> str:
    return out.getvalue().rstrip().splitlines()[-1]


def test_fab_waits_for_the_server_as_long_as_the_services_role_does():
    """fab extract starts a stopped server and waits for its health: with 1800 s it gave up on a ~600 GB load with
    a first start's JIT that the role's own wait (sglang_service_health_retries x _delay) lets through."""
    import inspect

    import yaml

    import fabfile

    role = yaml.safe_load((ROOT / "roles/sglang_service/defaults/main.yml").read_text())
    wait = role["sglang_service_health_retries"] * role["sglang_service_health_delay"]
    default = inspect.signature(fabfile.extract.body).parameters["server_timeout"].default
    assert default == wait, (default, wait)
    out = _fab("--help", "extract")
    assert f"(default {wait}," in " ".join(out.stdout.split()), out.stdout


def test_ctrl_c_before_the_dashboard_says_what_goes_on_and_exits_130(monkeypatch, tmp_path, capsys):
    """Ctrl-C in the server's health wait (up to an hour) ended fab with exit 1 and not a word: the server goes
    on loading, the driver was never started."""
    import fabfile
    from invoke import Context

    from hs_patch.control.inventory import Target

    def wait_interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(fabfile, "_target", lambda *a: Target(host="gpu1", name="gpu1"))
    monkeypatch.setattr(fabfile, "_connect", wait_interrupted)
    data = tmp_path / "d.jsonl"
    data.write_text("{}\n")
    with pytest.raises(SystemExit) as e:
        fabfile.extract(Context(), host="gpu1", dataset=str(data), run="r1")
    assert e.value.code == 130
    assert "interrupted; what was already started on the host goes on" in capsys.readouterr().err
