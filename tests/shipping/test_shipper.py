"""The shipper: rsync over a real (loopback) sshd, verification at the destination,
deletion only after it, resume after a kill at any point, follow mode and signals."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import loopback_sshd
from hs_patch.host.shipping import link as ship_link, shipper
from hs_patch.samples import store
from lab.sample_files import flip_byte
from lab.ship_runs import (assert_destination_has, assert_shipped_locally, dirs, make_samples, ship_cmd,
                           shipped_records, status)

ROOT = Path(__file__).resolve().parents[2]
@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = loopback_sshd.start(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.fixture
def own_tmp(monkeypatch):
    """A short private directory for the shipper's SSH control directories (hs-ship-*), so a test sees its own
    only: the other test worker's shippers make theirs in /tmp at the same time. Short: it holds a socket."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="hs-t-", dir="/tmp"))
    monkeypatch.setattr(tempfile, "tempdir", str(d))
    monkeypatch.setenv("TMPDIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------ over SSH


def test_ships_over_ssh_verifies_then_deletes_only_listed_files(tmp_path, sshd, own_tmp):
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 4)
    (samples / "stray.safetensors").write_bytes(b"not in the manifest")
    (samples / store.TMPDIR / "half.safetensors").write_bytes(b"being written")
    code = shipper.main(ship_cmd(samples, state, f"{sshd.host}:{dest}", *sshd.ship_args()))
    assert code == shipper.EXIT_OK
    assert_destination_has(dest, written)
    assert_shipped_locally(samples, state, written)
    assert (samples / "stray.safetensors").exists() and (samples / store.TMPDIR / "half.safetensors").exists()
    assert not (dest / "samples" / "stray.safetensors").exists()
    st = status(state)
    assert st["state"] == "done" and st["shipped"] == {"count": 4, "bytes": sum(w.nbytes for w in written)}
    assert st["pending"]["count"] == 0 and st["throughput_bytes_per_s"] > 0
    assert not list(own_tmp.glob("hs-ship-*")), "the SSH control directory was not cleaned up"
    # nothing left to do: a second run changes nothing
    assert shipper.main(ship_cmd(samples, state, f"{sshd.host}:{dest}", *sshd.ship_args())) == shipper.EXIT_OK
    assert len(shipped_records(state)) == 4


def test_an_unknown_host_key_is_refused_and_nothing_is_deleted(tmp_path, sshd, capsys):
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 2)
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"[127.0.0.1]:{sshd.port} {(tmp_path / 'other_key.pub').read_text()}")
    args = ["--ssh-key", str(sshd.key), "--ssh-port", str(sshd.port), "--known-hosts", str(wrong)]
    code = shipper.main(ship_cmd(samples, state, f"{sshd.host}:{dest}", *args))
    err = capsys.readouterr().err
    assert code == shipper.EXIT_ERROR
    assert "cannot open an SSH connection" in err and "known_hosts" in err
    assert all(w.path.exists() for w in written) and not dest.exists()
    assert status(state)["state"] == "failed" and "cannot open" in status(state)["last_error"]


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


def _wait(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_killed_mid_file_then_resumed_loses_and_duplicates_nothing(tmp_path, sshd, own_tmp):
    """kill -9 the shipper while rsync is writing a file; the restart completes the job."""
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 3, tokens=512, hidden=2048)  # 2 MiB each
    argv = [sys.executable, "-m", "hs_patch.host.shipping.shipper", *ship_cmd(samples, state, f"{sshd.host}:{dest}",
                                                                   *sshd.ship_args(), "--bwlimit", "2000")]
    proc = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE)
    try:
        def receiving() -> bool:  # rsync's temp file or partial file holds some bytes
            return any(p.is_file() and p.stat().st_size > 0 for p in (dest / ".incoming").rglob(".*"))
        _wait(lambda: dest.joinpath(".incoming").is_dir() and receiving(), 30, "rsync to start writing")
        children = _children(proc.pid)  # the SSH master and rsync
        rsyncs = [c for c in children if "rsync" in Path(f"/proc/{c}/cmdline").read_text()]
        assert rsyncs and len(children) == 2, "no rsync child while a transfer is in progress"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    # rsync and the SSH master die with the shipper (nothing goes on behind our back);
    # only the killed shipper's control directory stays (a log, no socket)
    _wait(lambda: not any(Path(f"/proc/{c}").exists() for c in children), 10, "rsync and ssh to exit")
    for leftover in own_tmp.glob("hs-ship-*"):
        assert not (leftover / "cm").exists()
        shutil.rmtree(leftover)
    # nothing was deleted, nothing unverified reached samples/ or the logs
    assert all(w.path.exists() for w in written)
    assert set(store.read_manifest(samples)) == {w.key for w in written}
    assert not shipped_records(state)
    assert not list((dest / "samples").iterdir())
    assert not (dest / store.MANIFEST).exists()
    partial = [p for p in (dest / ".incoming").rglob("*") if p.is_file()]
    assert partial and all(p.stat().st_size < written[0].nbytes for p in partial)

    code = shipper.main(ship_cmd(samples, state, f"{sshd.host}:{dest}", *sshd.ship_args()))
    assert code == shipper.EXIT_OK
    assert_destination_has(dest, written)
    assert_shipped_locally(samples, state, written)


# ------------------------------------------------------------------------------ local destination


class Crash(BaseException):
    """Stands for a kill -9 at a chosen point (nothing in the shipper catches it)."""


def _crash_after(monkeypatch, cls, name: str, when=lambda result, *a: True, before=None):
    real = getattr(cls, name)

    def wrapper(*args, **kwargs):
        result = real(*args, **kwargs)
        if when(result, *args):
            if before:
                before()
            raise Crash(name)
        return result
    monkeypatch.setattr(cls, name, wrapper)


@pytest.mark.parametrize("point", ["after_rsync", "mid_commit", "after_commit", "after_record"])
def test_cut_at_any_step_then_resumed_loses_and_duplicates_nothing(tmp_path, monkeypatch, point):
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 4)
    cfg = shipper.ShipConfig(samples, state, ship_link.parse_dest(str(dest)))
    with monkeypatch.context() as m:
        if point == "after_rsync":
            _crash_after(m, ship_link.Link, "send")
        elif point == "mid_commit":  # the destination moved some files into samples/ and then died
            def move_half():
                for w in written[:2]:
                    os.replace(dest / ".incoming" / w.path.name, dest / "samples" / w.path.name)
            _crash_after(m, ship_link.Link, "send", before=move_half)
        elif point == "after_commit":  # the destination has committed all, nothing recorded here
            _crash_after(m, ship_link.Commit, "wait", when=lambda results, self: isinstance(results, list) and bool(results))
        else:  # shipped.jsonl has the first file, its local copy is still there
            _crash_after(m, store.Manifest, "append", when=lambda result, self, rec: rec["op"] == "shipped")
        with pytest.raises(Crash):
            shipper.ship(cfg)
    assert all(w.path.exists() for w in written[1:]), "local copies deleted before verification"
    committed = {p.name: p.stat().st_ino for p in (dest / "samples").iterdir()}

    assert shipper.ship(cfg) == shipper.EXIT_OK
    assert_destination_has(dest, written)
    assert_shipped_locally(samples, state, written)
    if point in ("after_commit", "after_record"):  # verified again where they were, not re-sent
        assert {p.name: p.stat().st_ino for p in (dest / "samples").iterdir()} == committed


@pytest.mark.parametrize("loss", ["deleted", "damaged"])
def test_a_local_copy_is_not_deleted_on_the_word_of_the_destinations_manifest_alone(tmp_path, monkeypatch, loss):
    """Cut after the destination committed (nothing recorded here), then the destination's copy is
    lost or damaged: the re-run must verify it there and re-send it, not delete the only good copy
    (before: the start-up sync recorded it from the manifest and the local file was deleted, exit 0)."""
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 3)
    cfg = shipper.ShipConfig(samples, state, ship_link.parse_dest(str(dest)))
    with monkeypatch.context() as m:
        _crash_after(m, ship_link.Commit, "wait", when=lambda results, self: isinstance(results, list) and bool(results))
        with pytest.raises(Crash):
            shipper.ship(cfg)
    assert all(w.path.exists() for w in written) and not shipped_records(state)
    lost = dest / "samples" / written[0].path.name
    if loss == "deleted":
        lost.unlink()
    else:
        flip_byte(lost, -1)
    assert shipper.ship(cfg) == shipper.EXIT_OK
    assert_destination_has(dest, written)
    assert_shipped_locally(samples, state, written)


def after_first_send(monkeypatch, then) -> None:
    """``then(names)`` once, right after the shipper's first rsync of a batch, before its verification."""
    real_send = ship_link.Link.send
    done: list[bool] = []

    def send(self, src_dir, names, *, recheck=False):
        result = real_send(self, src_dir, names, recheck=recheck)
        if not done:
            done.append(True)
            then(names)
        return result
    monkeypatch.setattr(ship_link.Link, "send", send)


def test_a_file_damaged_in_transit_is_sent_again(tmp_path, monkeypatch):
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 3)
    damaged: list[str] = []

    def damage(names: list[str]) -> None:  # in transit: the sender's mtime, other bytes
        staged = dest / ".incoming" / names[1]
        flip_byte(staged, 100)
        os.utime(staged, ns=(os.stat(staged).st_atime_ns, (samples / names[1]).stat().st_mtime_ns))
        damaged.append(names[1])
    after_first_send(monkeypatch, damage)
    cfg = shipper.ShipConfig(samples, state, ship_link.parse_dest(str(dest)))
    assert shipper.ship(cfg) == shipper.EXIT_OK
    assert_destination_has(dest, written)
    assert_shipped_locally(samples, state, written)
    assert "mismatch" in status(state)["last_error"] and damaged[0] in status(state)["last_error"]


def test_a_copy_another_shipper_lands_over_ours_is_a_race_sent_again_not_a_failed_transfer(tmp_path, monkeypatch,
                                                                                              capsys):
    """The other shipper of this destination (a reassigned shard's host, or the dead host back) lands its copy of
    a sample at rsync's name after ours, and dies before its own step: ours is not called a mismatch (its copy
    deleted, a transfer counted: two such shippers gave up after --retries rounds), it is sent again."""
    from hs_patch.host.shipping import batches

    monkeypatch.setattr(batches, "RACE_PAUSE", (0.05, 0.1))
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 2)
    theirs = make_samples(tmp_path / "other", 2, seed_offset=7)
    landed: list[str] = []

    def theirs_lands(names: list[str]) -> None:
        shutil.copyfile(tmp_path / "other" / names[0], dest / ".incoming" / names[0])  # its own mtime: now
        landed.append(names[0])
    after_first_send(monkeypatch, theirs_lands)
    cfg = shipper.ShipConfig(samples, state, ship_link.parse_dest(str(dest)))
    assert theirs[0].path.name == written[0].path.name
    assert shipper.ship(cfg) == shipper.EXIT_OK
    err = capsys.readouterr().err
    assert landed and f"{landed[0]}: " in err and "decided again shortly" in err
    assert "after transfer" not in err, err
    assert_destination_has(dest, written)
    assert_shipped_locally(samples, state, written)


def test_a_file_that_never_verifies_is_kept_and_reported(tmp_path, capsys):
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 7)
    bad = written[2]
    flip_byte(bad.path, -1)  # the local copy no longer matches its manifest sha256
    # small batches: later batches are sent while earlier ones are verified
    code = shipper.main(ship_cmd(samples, state, str(dest), "--retries", "2", "--batch-files", "2"))
    err = capsys.readouterr().err
    assert code == shipper.EXIT_UNVERIFIED
    assert "transfer 1 of 2" in err and "transfer 2 of 2" in err and "failed verification" in err
    assert bad.path.exists() and bad.key in store.read_manifest(samples)
    assert not (dest / "samples" / bad.path.name).exists() and not (dest / ".incoming" / bad.path.name).exists()
    good = [w for w in written if w is not bad]
    assert_destination_has(dest, good)
    assert_shipped_locally(samples, state, good)
    st = status(state)
    assert st["state"] == "failed" and list(st["failed"]) == [bad.key] and "local copy kept" in st["failed"][bad.key]


def _start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "hs_patch.host.shipping.shipper", *argv], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_follow_ships_new_samples_until_the_driver_is_done(tmp_path):
    samples, state, dest = dirs(tmp_path)
    first = make_samples(samples, 2)
    proc = _start(ship_cmd(samples, state, str(dest), "--follow", "--poll", "0.1"))
    try:
        _wait(lambda: len(shipped_records(state)) == 2, 20, "the first samples to ship")
        assert proc.poll() is None and status(state)["state"] in ("waiting", "shipping")
        later = make_samples(samples, 3, start=2)  # the last samples and the marker arrive together
        (state / shipper.DONE_MARKER).write_text("")
        assert proc.wait(20) == shipper.EXIT_OK, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert_destination_has(dest, first + later)
    assert_shipped_locally(samples, state, first + later)
    assert status(state)["state"] == "done"


def test_sigterm_finishes_the_current_batch_then_exits(tmp_path):
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 4, tokens=256, hidden=1024)  # 0.5 MiB each
    proc = _start(ship_cmd(samples, state, str(dest), "--follow", "--batch-files", "2", "--bwlimit", "800"))
    try:
        _wait(lambda: any(p.is_file() and p.stat().st_size > 0 for p in dest.glob(".incoming/.*")), 20,
              "the first batch to be in flight")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == shipper.EXIT_OK
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert "finishing the current batch" in proc.stderr.read()
    assert_destination_has(dest, written[:2])
    assert_shipped_locally(samples, state, written[:2])
    assert all(w.path.exists() for w in written[2:])
    st = status(state)
    assert st["state"] == "stopped" and st["pending"]["count"] == 2
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK  # resume
    assert_destination_has(dest, written)


# ------------------------------------------------------------------------------ CLI


def test_help_says_where_it_reads_and_writes_how_to_resume_and_the_exit_codes():
    out = subprocess.run([sys.executable, "-m", "hs_patch.host.shipping.shipper", "ship", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    for text in ("manifest.jsonl", "shipped.jsonl", "shipper_status.json", "driver.done", "resume:",
                 "exit codes:", "StrictHostKeyChecking=yes", ".incoming"):
        assert text in out


def test_bad_arguments_exit_2_and_say_what_to_fix(tmp_path, capsys):
    samples, state, dest = dirs(tmp_path)
    make_samples(samples, 1)
    cases = [
        (ship_cmd(tmp_path / "nope", state, str(dest)), "is not a directory"),
        (ship_cmd(samples, state, "storage:"), "give [user@]host:path"),
        (ship_cmd(samples, state, str(dest), "--ssh-port", "22"), "local directory"),
        (ship_cmd(samples, state, "h:/x", "--known-hosts", str(tmp_path / "none")), "ssh-keyscan"),
        (ship_cmd(samples, state, str(dest), "--batch-files", "0"), "--batch-files must be at least 1"),
        (ship_cmd(samples, state, str(dest), "--until-file", str(tmp_path / "done")), "only means something"),
    ]
    for argv, message in cases:
        assert shipper.main(argv) == shipper.EXIT_USAGE
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        shipper.main(ship_cmd(samples, state, str(dest), "--batch-bytes", "lots"))
    assert e.value.code == shipper.EXIT_USAGE


def test_one_shipper_per_state_dir_and_a_busy_lock_is_not_bad_configuration(tmp_path, capsys):
    """Exit 1, not 2: under fab the follow unit is not restarted after exit 2, so a unit (re)started
    while an operator's manual hs-extract ship held the lock stayed down for the rest of the run."""
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 1)
    state.mkdir()
    with open(state / shipper.LOCK_FILE, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_ERROR
    assert "another shipper" in capsys.readouterr().err
    assert written[0].path.exists()
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK  # once it is free


def test_a_destination_manifest_line_without_bytes_is_named_not_a_crash(tmp_path, capsys):
    """Before: the start-up sync recorded {"bytes": null} in shipped.jsonl and the status write
    crashed with a TypeError traceback, at every start after (the record stays)."""
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 2)
    dest.mkdir()
    odd = {"op": "add", "key": "abc", "file": "samples/abc.safetensors", "sha256": "0" * 64}
    (dest / store.MANIFEST).write_text(json.dumps(odd) + "\n")
    state.mkdir()
    (state / shipper.SHIPPED_LOG).write_text(json.dumps({"op": "shipped", "key": "old", "file": "old.safetensors",
                                                         "bytes": None, "sha256": None, "t": 1}) + "\n")
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK
    assert "lists abc without bytes or sha256" in capsys.readouterr().err
    assert all(not w.path.exists() for w in written)
    assert {r["key"] for r in shipped_records(state)} == {"old"} | {w.key for w in written}
    assert status(state)["shipped"]["bytes"] == sum(w.nbytes for w in written)


def test_a_shipper_stopped_by_a_signal_with_samples_left_does_not_say_done(tmp_path, monkeypatch, capsys):
    """Before: exit 0 and "hs-ship: done" with samples still unshipped (only the status file said stopped)."""
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 2)
    real_connect = shipper.Shipper.connect

    def connect_then_sigterm(self, link):
        ok = real_connect(self, link)
        self.stop_requested = True  # what the SIGTERM handler sets
        return ok
    monkeypatch.setattr(shipper.Shipper, "connect", connect_then_sigterm)
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK
    err = capsys.readouterr().err
    assert "hs-ship: done" not in err and "stopped by a signal with 2 samples still to ship" in err
    assert all(w.path.exists() for w in written) and status(state)["state"] == "stopped"


@pytest.mark.parametrize("option", [("--poll", "nan"), ("--poll", "inf"), ("--backoff-max", "nan"),
                                    ("--backoff-max", "inf")])
def test_a_poll_or_backoff_that_is_not_a_finite_number_is_refused(tmp_path, capsys, option):
    """Before: --poll nan passed the '<= 0' check and --follow spun at full CPU rewriting its status
    (pause(nan) returns at once); --backoff-max nan retried a failing destination without a pause."""
    samples, state, dest = dirs(tmp_path)
    make_samples(samples, 1)
    done = tmp_path / "driver.done"
    done.write_text("")  # so that a shipper that accepts the value ends (the test fails, not hangs)
    argv = ship_cmd(samples, state, str(dest), "--follow", "--until-file", str(done), *option)
    assert shipper.main(argv) == shipper.EXIT_USAGE
    assert "must be finite numbers > 0" in capsys.readouterr().err


def test_a_sample_listed_here_whose_file_is_gone_counts_as_shipped_when_the_destination_holds_it(tmp_path):
    """The state directory lost and the local manifest's removes too (files gone): the start-up sync's
    records still settle them (a 'from: destination' record no longer deletes a file that is here,
    but one already gone is not 'listed, never shipped')."""
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 2)
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK
    adds = [line for line in (samples / store.MANIFEST).read_text().splitlines() if '"remove"' not in line]
    (samples / store.MANIFEST).write_text("\n".join(adds) + "\n")
    (state / shipper.SHIPPED_LOG).unlink()
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK
    assert_shipped_locally(samples, state, written)


@pytest.mark.parametrize("where", ["samples", "its parent", "inside it", "loopback parent"])
def test_a_destination_that_overlaps_the_samples_directory_is_refused(tmp_path, capsys, where):
    """--dest RUN while the samples are in RUN/samples: DEST/samples/ is the samples directory, the
    verify step 'moves' each file onto itself and the shipper then deletes it. Before: exit 0, "done",
    every sample deleted and no copy anywhere (--dest the samples directory: its manifest rewritten)."""
    samples, state, _ = dirs(tmp_path)
    written = make_samples(samples, 2)
    dest = {"samples": str(samples), "its parent": str(tmp_path), "inside it": str(samples / "out"),
            "loopback parent": f"root@127.0.0.1:{tmp_path}"}[where]
    assert shipper.main(ship_cmd(samples, state, dest)) == shipper.EXIT_USAGE
    assert "overlap" in capsys.readouterr().err
    assert all(w.path.exists() for w in written)
    assert set(store.read_manifest(samples)) == {w.key for w in written}
