"""The shipper rides out storage outages of any length, and never redoes or replaces what the
destination already holds (a GPU-host reboot empties /dev/shm and maybe the state too)."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path


from lab import loopback_sshd
from hs_patch.control import remote
from hs_patch.control.inventory import Target
from hs_patch.host.shipping import link as ship_link, shipper
from hs_patch.samples import store
from lab.ship_runs import assert_destination_has, dirs, make_samples, ship_cmd, shipped_records, status

ROOT = Path(__file__).resolve().parents[2]


def _wait(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _status(state: Path) -> dict:
    try:
        return status(state)
    except (OSError, ValueError):
        return {}


def _restart_sshd(server: loopback_sshd.LoopbackSshd) -> None:
    """The same sshd (port, keys) again, as a storage host coming back."""
    mark = server.log.stat().st_size
    with open(server.log, "ab") as out:
        server.proc = subprocess.Popen(server.proc.args, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    _wait(lambda: b"Server listening" in server.log.read_bytes()[mark:], 15, "sshd to listen again")


def _ssh_master(pid: int) -> list[int]:
    out = []
    for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        if "ControlMaster=yes" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace").replace("\0", " "):
            out.append(int(c))
    return out


def test_an_outage_longer_than_any_retry_count_is_ridden_out(tmp_path):
    """The storage host goes away (sshd down, the SSH connection cut) for well over the old five
    failures; the shipper waits, says so in its status, loses and deletes nothing, and ships the
    rest when it comes back."""
    server = loopback_sshd.start(tmp_path / "sshd")
    samples, state, dest = dirs(tmp_path)
    first = make_samples(samples, 2)
    argv = [sys.executable, "-m", "hs_patch.host.shipping.shipper",
            *ship_cmd(samples, state, f"{server.host}:{dest}", *server.ship_args(), "--follow", "--poll", "0.1",
                      "--backoff-max", "0.3")]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: len(shipped_records(state)) == 2, 30, "the first samples to ship")
        server.stop()                      # the storage host is down ...
        for pid in _ssh_master(proc.pid):  # ... and the shipper's connection to it is gone
            subprocess.run(["kill", "-9", str(pid)], check=True)
        later = make_samples(samples, 3, start=2)
        _wait(lambda: (_status(state).get("outage") or {}).get("failures", 0) >= 12, 60, "12 failed tries")
        st = _status(state)
        assert proc.poll() is None, "the shipper gave up during an outage"
        assert st["state"] == "waiting_for_destination" and st["outage"]["since"] <= time.time()
        assert st["outage"]["retry_in_s"] <= 0.3 and st["last_error"]
        assert all(w.path.exists() for w in later) and len(shipped_records(state)) == 2
        _restart_sshd(server)
        _wait(lambda: len(shipped_records(state)) == 5, 60, "the rest to ship after the outage")
        (state / shipper.DONE_MARKER).write_text("")
        assert proc.wait(30) == shipper.EXIT_OK
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        server.stop()
    assert "nothing is lost, retrying" in err and "the destination is back after" in err
    assert_destination_has(dest, first + later)
    assert _status(state)["state"] == "done" and _status(state)["outage"] is None


def test_a_destination_that_fails_at_start_is_waited_for(tmp_path):
    """Local destination whose parent is unavailable (a storage mount gone): the check at start fails,
    is retried, and shipping begins once the destination is back."""
    samples, state, _ = dirs(tmp_path)
    written = make_samples(samples, 2)
    mount = tmp_path / "mnt"
    mount.symlink_to(tmp_path / "nowhere")  # dangling: the destination cannot be created
    argv = [sys.executable, "-m", "hs_patch.host.shipping.shipper",
            *ship_cmd(samples, state, str(mount / "run"), "--backoff-max", "0.2")]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (_status(state).get("outage") or {}).get("failures", 0) >= 7, 30, "7 failed tries at start")
        assert proc.poll() is None and _status(state)["state"] == "waiting_for_destination"
        (tmp_path / "nowhere").mkdir()  # the mount is back
        assert proc.wait(30) == shipper.EXIT_OK, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert_destination_has(mount / "run", written)


def test_refusals_that_waiting_cannot_cure_are_permanent():
    for text in ("Host key verification failed.", "alice@h: Permission denied (publickey).",
                 "ssh: Could not resolve hostname storage: Name or service not known"):
        assert ship_link.LinkError(text).permanent, text
    for text in ("ssh: connect to host 127.0.0.1 port 2: Connection refused", "Connection timed out",
                 "rsync: mkdir \"/srv/x/.incoming\" failed: Permission denied (13)",
                 "verification on h:/x failed (exit 1): OSError: [Errno 5] Input/output error"):
        assert not ship_link.LinkError(text).permanent, text


class FakeConnection:
    host = "gpu"

    def __init__(self):
        self.commands: list[str] = []

    def run(self, cmd, **kw):
        self.commands.append(cmd)
        return type("R", (), {"stdout": "inactive\n", "stderr": "", "failed": False, "exited": 0})()


def test_the_shipper_unit_restarts_on_failure_but_not_on_bad_configuration():
    from hs_patch.control.shell import Shell

    c, t = FakeConnection(), Target("gpu")
    remote.start_jobs(Shell(c, t), t, "r1", [])
    drive = next(x for x in c.commands if "systemd-run --unit=hs-drive-r1" in x)
    ship = next(x for x in c.commands if "systemd-run --unit=hs-ship-r1" in x)
    assert "--property=Restart=on-failure" in shlex.split(ship)
    assert "--property=RestartPreventExitStatus=2 3" in shlex.split(ship)  # bad configuration; unverifiable samples
    assert "--property=Restart=on-abnormal" in shlex.split(drive) and "on-failure" not in drive


def test_after_a_reboot_the_destination_manifest_counts_as_done_and_is_never_replaced(tmp_path, capsys):
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 3, sample_ids=True, line_sha256="a" * 64)
    cfg = shipper.ShipConfig(samples, state, ship_link.parse_dest(str(dest)))
    assert shipper.ship(cfg) == shipper.EXIT_OK
    # with the digest of each sample's dataset line: a resume over a changed dataset finds them by it
    assert [r["line_sha256"] for r in shipped_records(state)] == ["a" * 64] * 3
    before = {p.name: (p.stat().st_ino, store.file_sha256(p)) for p in (dest / "samples").iterdir()}
    manifest_before = (dest / store.MANIFEST).read_bytes()

    # reboot: /dev/shm is empty, and this time the state directory is lost as well
    for d in (samples, state):
        for p in sorted(d.rglob("*"), reverse=True):
            p.unlink() if p.is_file() else p.rmdir()
    # the shipper's start-up sync records what the destination holds, with sample ids
    assert shipper.ship(cfg) == shipper.EXIT_OK
    recs = shipped_records(state)
    assert {r["key"] for r in recs} == {w.key for w in written} and all(r["from"] == "destination" for r in recs)
    assert sorted(r["sample_id"] for r in recs) == sorted(f"data.jsonl:{i + 1}" for i in range(3))
    assert [r["line_sha256"] for r in recs] == ["a" * 64] * 3

    # a redo of the same samples with other bytes (made before the sync could tell the driver) is not
    # shipped over the verified copies: the destination keeps them, the redo is dropped here
    redo = make_samples(samples, 3, sample_ids=True, seed_offset=7)
    assert {w.key for w in redo} == {w.key for w in written} and redo[0].sha256 != written[0].sha256
    assert shipper.ship(cfg) == shipper.EXIT_OK
    assert {p.name: (p.stat().st_ino, store.file_sha256(p)) for p in (dest / "samples").iterdir()} == before
    assert (dest / store.MANIFEST).read_bytes() == manifest_before
    assert not any(w.path.exists() for w in redo) and not store.read_manifest(samples)
    kept = [r for r in shipped_records(state) if r.get("kept")]
    assert len(kept) == 3 and {r["sha256"] for r in kept} == {w.sha256 for w in written}
    assert capsys.readouterr().err.count("the destination already holds this sample (shipped before this host "
                                         "lost its local state): its copy is kept, the local redo is dropped") == 3


def test_a_dead_hosts_return_says_another_host_shipped_its_reassigned_samples(tmp_path, capsys):
    """gpu2 was cut off; gpu1 finished its shard (run r.gpu2) into r/gpu2 at the destination. gpu2 comes
    back and its shipper brings the same samples, extracted by itself: the destination keeps gpu1's,
    and the words say who shipped them, not that this host lost its local state."""
    dest = tmp_path / "dest"
    other = make_samples(tmp_path / "gpu1", 2, sample_ids=True, run="r.gpu2", host="gpu1", shard="1/3")
    assert shipper.ship(shipper.ShipConfig(tmp_path / "gpu1", tmp_path / "s1", ship_link.parse_dest(str(dest)))) == \
        shipper.EXIT_OK
    mine = make_samples(tmp_path / "gpu2", 2, sample_ids=True, seed_offset=3, run="r", host="gpu2", shard="1/3")
    assert {w.key for w in mine} == {w.key for w in other} and mine[0].sha256 != other[0].sha256
    capsys.readouterr()
    assert shipper.ship(shipper.ShipConfig(tmp_path / "gpu2", tmp_path / "s2", ship_link.parse_dest(str(dest)))) == \
        shipper.EXIT_OK
    err = capsys.readouterr().err
    assert err.count("the destination already holds this sample, shipped by host gpu1 of run r.gpu2 (this shard was "
                     "given to another host while this one was out): that copy is kept, this host's is dropped") == 2, err
    assert "lost its local state" not in err
    assert {e["sha256"] for e in store.read_manifest(dest).values()} == {w.sha256 for w in other}


def test_the_dashboard_says_storage_is_unreachable_and_nothing_is_lost():
    import io

    from rich.console import Console

    from hs_patch.control import dashboard
    from lab.snapshots import SNAP, poller

    snap = dict(SNAP, shipper=dict(SNAP["shipper"], state="waiting_for_destination", last_error="Connection refused",
                                   outage={"since": 0, "seconds": 420.0, "failures": 17, "retry_in_s": 60.0}))
    out = io.StringIO()
    dashboard.watch(poller(gpu1=lambda: snap), "gpu1", "r1", once=True, console=Console(file=out, width=140, force_terminal=False))
    text = out.getvalue()
    assert "STORAGE UNREACHABLE" in text and "unreachable for 420s (17 tries; next in 60s)" in text
    assert "nothing is lost" in text and "Connection refused" in text


def test_a_refusal_under_follow_is_tried_again_until_fixed_and_a_one_off_shipper_exits(tmp_path, capsys):
    """A refusal that waiting cannot cure (here the destination's verify step: a manifest line that is not JSON) used
    to end the --follow shipper with exit 1, and its unit (Restart=on-failure) started it again every few seconds:
    the storage host tried without a pause (an SSH refusal: its sshd may ban the address). Now the follow shipper
    says refused_by_destination and tries again every --refused-retry seconds, and goes on by itself once fixed."""
    from hs_patch.host.shipping import batches

    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 2)
    dest.mkdir()
    bad = dest / store.MANIFEST
    bad.write_text('{"op":"add","key":"a",\n')
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_ERROR   # one-off: exits, as before
    assert "hs-verify: refused" in capsys.readouterr().err

    (state / shipper.DONE_MARKER).write_text("")   # the driver is done: the follow shipper ends once all is shipped
    argv = [sys.executable, "-m", "hs_patch.host.shipping.shipper",
            *ship_cmd(samples, state, str(dest), "--follow", "--poll", "0.1", "--refused-retry", "0.3")]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (_status(state).get("outage") or {}).get("failures", 0) >= 2, 30, "two refused tries")
        s = _status(state)
        assert proc.poll() is None, "the follow shipper ended on a refusal"
        assert s["state"] == batches.REFUSED and s["outage"]["refused"] and s["outage"]["retry_in_s"] == 0.3, s
        assert "line 1 is not JSON" in s["last_error"]
        bad.write_text("")   # fixed at the destination
        assert proc.wait(30) == shipper.EXIT_OK
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert_destination_has(dest, written)
    assert "refused by the destination (try 1)" in err and "waiting cannot cure this" in err


def test_the_dashboards_say_storage_refuses():
    import io

    from rich.console import Console

    from hs_patch.control import dashboard, fleet_dashboard
    from hs_patch.control.fleet_dashboard import Rates, Row
    from lab.snapshots import SNAP, poller

    snap = dict(SNAP, shipper=dict(SNAP["shipper"], state="refused_by_destination",
                                   last_error="hs-ingest-gate: refused: another hs-patch",
                                   outage={"since": 0, "seconds": 900.0, "failures": 4, "retry_in_s": 300.0,
                                           "refused": True, "last_error": "hs-ingest-gate: refused: another hs-patch"}))
    out = io.StringIO()
    dashboard.watch(poller(gpu1=lambda: snap), "gpu1", "r1", once=True, console=Console(file=out, width=200, force_terminal=False))
    text = " ".join(out.getvalue().split())
    assert "STORAGE REFUSES, fix it" in text and "storage refuses (4 tries; next in 300s)" in text
    assert "waiting cannot cure this; fix it and shipping resumes by itself" in text
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False).print(
        fleet_dashboard.render([Row("gpu1", "gpu1", "r1", "0/1")], {"gpu1": snap}, "r1", Rates()))
    assert "STORAGE REFUSES" in out.getvalue()
