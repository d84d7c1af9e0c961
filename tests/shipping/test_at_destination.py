"""The verify-and-commit step run on the destination, called in-process: what it commits is
exactly the file it hashed, whatever other shippers' rsyncs do in ``.incoming/`` meanwhile."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

import pytest

from hs_patch.host.shipping import at_destination


def _request(name: str, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    entry = {"op": "add", "key": name.split(".")[0], "file": name, "bytes": len(data), "sha256": digest}
    return {"file": name, "bytes": len(data), "sha256": digest, "entry": entry}


def destination(tmp_path: Path) -> Path:
    """An empty destination ROOT, as the shipper's first check leaves it."""
    root = tmp_path / "dest"
    (root / at_destination.INCOMING).mkdir(parents=True)
    (root / at_destination.SAMPLES).mkdir()
    return root


def two_copies_staged(root: Path, staged_bytes: str) -> tuple[str, bytes, bytes, Path]:
    """One sample's name, this shipper's bytes and the other's, and rsync's name in .incoming/ holding one."""
    name = "k.safetensors"
    ours, theirs = b"A" * 4096, b"B" * 4096
    staged = root / at_destination.INCOMING / name
    staged.write_bytes(ours if staged_bytes == "ours" else theirs)
    return name, ours, theirs, staged


def test_a_file_another_rsync_lands_while_one_is_hashed_is_not_committed_under_the_hashed_ones_sha(
        tmp_path, monkeypatch):
    """Two shippers on one destination (a dead host back after its shard was given to another):
    one rsync renames its NAME into .incoming/ while the other's verify step hashes the NAME there.
    Before: the step hashed the path, then moved whatever was at the path by then into samples/,
    listed under the sha256 of the file it had hashed (a torn pair counted as shipped)."""
    root = destination(tmp_path)
    name, ours, theirs, staged = two_copies_staged(root, "ours")
    real = at_destination.sha256_and_sync

    def hashed_then_another_rsync_lands(path: str, like: str = ""):
        result = real(path, like)
        if not staged.exists() or staged.read_bytes() != theirs:  # rsync: temp file, then rename
            landing = staged.with_name(f".{name}.Xy12Ab")
            landing.write_bytes(theirs)
            os.replace(landing, staged)
        return result
    monkeypatch.setattr(at_destination, "sha256_and_sync", hashed_then_another_rsync_lands)
    answer = at_destination.commit(str(root), [_request(name, ours)])
    assert answer["results"][0]["status"] == "ok"
    listed = json.loads((root / at_destination.MANIFEST).read_text())
    in_place = (root / at_destination.SAMPLES / name).read_bytes()
    assert hashlib.sha256(in_place).hexdigest() == listed["sha256"] == hashlib.sha256(ours).hexdigest()
    # the other shipper's arrival is left for its own verify step
    assert staged.read_bytes() == theirs


def test_a_file_taken_by_a_killed_verify_step_is_removed_and_sent_again(tmp_path):
    root = destination(tmp_path)
    data = b"C" * 100
    taken = root / at_destination.INCOMING / (at_destination.VERIFYING + "k.safetensors")
    taken.write_bytes(data)
    answer = at_destination.commit(str(root), [_request("k.safetensors", data)])
    assert answer["results"][0]["status"] == "missing" and not taken.exists()
    assert not (root / at_destination.SAMPLES / "k.safetensors").exists()


def test_a_full_destination_leaves_no_partial_manifest_and_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    """ENOSPC while the manifest is rewritten. Before: the partial temp manifest stayed (one more per
    retry, each holding space the next try needed) and the shipper showed a Python traceback."""
    root = tmp_path / "dest"
    (root / at_destination.INCOMING).mkdir(parents=True)
    data = b"D" * 100
    (root / at_destination.INCOMING / "k.safetensors").write_bytes(data)
    real_fsync = os.fsync

    def full(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(28, "No space left on device")
        real_fsync(fd)
    monkeypatch.setattr(at_destination.os, "fsync", full)
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"root": str(root), "files": [_request("k.safetensors", data)]})))
    with pytest.raises(SystemExit) as e:
        at_destination.main()
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "No space left on device" in err and "the destination is full" in err
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")], "a partial manifest was left behind"
    # once there is space again, the next step commits it (it was moved into samples/ already)
    monkeypatch.setattr(at_destination.os, "fsync", real_fsync)
    (root / ".manifest.jsonl.99999.tmp").write_bytes(b"left by a killed step")
    answer = at_destination.commit(str(root), [_request("k.safetensors", data)])
    assert answer["results"][0]["status"] == "ok" and answer["manifest"] == 1
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]


def test_a_file_sent_again_for_a_line_the_manifest_already_has_is_made_durable(tmp_path, monkeypatch):
    """The destination's copy lost, the manifest line intact: the copy sent again is renamed into
    samples/ and the shipper then deletes its own. Before: samples/ was fsynced only when the
    manifest changed, so that rename could be lost with power while the manifest listed it."""
    root = destination(tmp_path)
    data = b"E" * 100
    req = _request("k.safetensors", data)
    (root / at_destination.INCOMING / "k.safetensors").write_bytes(data)
    at_destination.commit(str(root), [req])
    (root / at_destination.SAMPLES / "k.safetensors").unlink()
    (root / at_destination.INCOMING / "k.safetensors").write_bytes(data)
    synced: list[str] = []
    real = at_destination.fsync_dir
    monkeypatch.setattr(at_destination, "fsync_dir", lambda path: (synced.append(path), real(path)))
    assert at_destination.commit(str(root), [req])["results"][0]["status"] == "ok"
    assert str(root / at_destination.SAMPLES) in synced


def test_a_copy_another_shipper_landed_at_rsyncs_name_is_left_to_it_not_deleted_as_a_mismatch(tmp_path):
    """Two shippers of one ROOT with one sample (a reassigned shard and its host back): the other's rsync landed
    its copy over this one's before this one's step ran. That step deleted it as a mismatch and the other's then
    found nothing: both counted failed transfers, and could give up after --retries rounds. Told apart by the
    mtime rsync --times gives the copy: the sender's (or truncated to the second by the filesystem) or not."""
    root = destination(tmp_path)
    name, ours, theirs, staged = two_copies_staged(root, "theirs")
    os.utime(staged, ns=(1, 1_700_000_000_123_456_789))
    mine = dict(_request(name, ours), mtime_ns=1_700_000_005_000_000_001)
    answer = at_destination.commit(str(root), [mine])
    assert answer["results"][0]["status"] == "raced" and staged.read_bytes() == theirs
    theirs_req = dict(_request(name, theirs), mtime_ns=1_700_000_000_123_456_789)
    assert at_destination.commit(str(root), [theirs_req])["results"][0]["status"] == "ok"
    # this shipper's copy with its own mtime, kept to the second by the filesystem: its own
    staged.write_bytes(ours)
    os.utime(staged, ns=(1, 1_700_000_005_000_000_000))
    assert at_destination.commit(str(root), [mine])["results"][0]["status"] == "kept"
    # a damaged copy of its own (its mtime) is still a mismatch, deleted to be sent again
    staged.write_bytes(b"C" * 4096)
    os.utime(staged, ns=(1, 1_700_000_005_000_000_001))
    (root / at_destination.SAMPLES / name).unlink()
    (root / at_destination.MANIFEST).unlink()
    assert at_destination.commit(str(root), [mine])["results"][0]["status"] == "mismatch" and not staged.exists()


def test_a_step_the_shipper_stopped_waiting_for_ends_itself_and_frees_the_lock(tmp_path):
    """Over SSH the shipper's timeout kills only its ssh: the step went on (here: waiting behind another
    step's lock, as behind a deep check of a full ROOT) and would hold the lock for the next round's step.
    It now ends itself ``seconds`` (+ GRACE_SECONDS) after its start, as the shipper's limit says."""
    import fcntl
    import subprocess
    import sys
    import time

    from hs_patch.host.shipping.link import REMOTE_SOURCE

    root = destination(tmp_path)
    request = {"root": str(root), "files": [], "list": True, "check": "cheap", "seconds": 1}
    with open(root / at_destination.LOCK, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)   # another step, still running
        t = time.monotonic()
        p = subprocess.run([sys.executable, "-c", REMOTE_SOURCE], input=json.dumps(request).encode(),
                           capture_output=True, timeout=60)
        took = time.monotonic() - t
    assert p.returncode != 0 and not p.stdout, "it gave up without an answer"
    assert took < 1 + at_destination.GRACE_SECONDS + 20, took
    del request["seconds"]   # no limit asked (an older shipper): it waits for the lock as before, then answers
    p = subprocess.run([sys.executable, "-c", REMOTE_SOURCE], input=json.dumps(request).encode(),
                       capture_output=True, timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout)["entries"] == []


def test_a_manifest_line_that_is_not_json_stops_the_shipper_with_the_line_named_and_nothing_dropped(
        tmp_path, monkeypatch, capsys):
    """A line edited by hand that is not JSON gave a traceback, which the shipper took for an outage and retried
    for ever; rewriting the manifest without it would have dropped a sample's line unseen."""
    from hs_patch.host.shipping.link import LinkError

    root = destination(tmp_path)
    data = b"D" * 100
    (root / at_destination.INCOMING / "k.safetensors").write_bytes(data)
    manifest = root / at_destination.MANIFEST
    before = b'{"op":"add","key":"a","file":"samples/a.safetensors"}\n{"op":"add","key":"b",\n'
    manifest.write_bytes(before)
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"root": str(root), "files": [_request("k.safetensors", data)]})))
    with pytest.raises(SystemExit) as e:
        at_destination.main()
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err, err
    assert err.startswith(f"hs-verify: refused: {manifest}: line 2 is not JSON"), err
    assert manifest.read_bytes() == before, "the manifest was rewritten"
    # as the shipper sees it: the step's stderr through Commit.wait, with a long root and a line of bytes, where the
    # words that make it permanent once fell out of the message's last 600 characters
    import sys

    from hs_patch.host.shipping.link import Commit

    deep = tmp_path / ("r" * 100) / ("kimi-" + "x" * 59) / "gpu-host-07"
    deep.mkdir(parents=True)
    (deep / at_destination.MANIFEST).write_bytes("é".encode() * 200 + b"\n")
    commit = Commit([sys.executable, at_destination.__file__], {"root": str(deep), "files": []}, "storage", 60)
    with pytest.raises(LinkError) as e:
        commit.wait()
    assert e.value.permanent and "line 1 is not JSON" in str(e.value), str(e.value)
    assert at_destination.entries_of([b"", b'{"op":"add","key":"a"}']) == {"a": {"op": "add", "key": "a"}}
