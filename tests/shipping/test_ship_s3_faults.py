"""Shipping to an S3 bucket under faults (issue #37), against the run's real S3 server (SeaweedFS in a network
namespace of its own: tests/lab/seaweed.py). Every test ends with every sample at the store exactly once, each
object's bytes hashed again and compared with its line in the driver's manifest, nothing deleted here unverified."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hs_patch.host.driver import runstate
from hs_patch.host.shipping import bucket, bucket_link, shipper
from hs_patch.samples import store
from hs_patch.samples.files import RANGE
from lab import waiting
from lab.ship_runs import (assert_bucket_has, assert_shipped_locally, digest_of, dirs, make_samples, objects,
                           ship_cmd, shipped_records, status, store_manifest)

pytestmark = pytest.mark.xdist_group("s3")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def prefix(request) -> str:
    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def slow_link(s3_server):
    """The link to the store at 200 Mbit/s (25 MB/s): a 134 MB sample's upload lasts seconds, long enough to
    cut it in the middle."""
    s3_server.shape("200mbit")
    yield s3_server
    s3_server.unshape()


def large(samples: Path, start: int, n: int = 1, **kw) -> list[store.Written]:
    """Samples of three 64 MiB ranges (a multipart upload of three parts), with the capture writer's digest."""
    return make_samples(samples, n, start=start, tokens=2, hidden=(RANGE * 2 + 4096) // 4, ranged=True, **kw)


def wait(what: str, predicate, timeout: float = 120, every: float = 0.1):
    return waiting.wait(what, predicate, timeout, every)


def state_of(state: Path) -> dict:
    try:
        return status(state)
    except (OSError, ValueError):
        return {}


def uploads_open(state: Path) -> int:
    """Multipart uploads the shipper started and has not ended (its journal)."""
    path = state / bucket_link.UPLOADS
    recs = store.read_jsonl(path) if path.exists() else []
    return len({r["upload_id"] for r in recs if r["op"] == "start"} - {r["upload_id"] for r in recs if r["op"] == "end"})


def popen_ship(samples: Path, state: Path, dest: str, *args: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "hs_patch.host.shipping.shipper", *ship_cmd(samples, state, dest, *args)]
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str]:
    try:
        code = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, proc.stderr.read()


def no_uploads_left(server, prefix: str, bucket_name: str = "hs-runs") -> None:
    left = server.client().list_multipart_uploads(Bucket=bucket_name, Prefix=prefix).get("Uploads") or []
    assert not left, f"multipart uploads left at the store, holding space: {left}"


def test_a_reship_notices_objects_replaced_truncated_or_deleted_and_the_deep_check_bit_rot(
        tmp_path, s3_server, prefix, capsys):
    """The cheap check (every start: one listing, size and ETag against those recorded when verified) finds an
    object replaced, one truncated, one deleted; the store's own disk flipped under an object leaves size and
    ETag alone, and only --verify-deep (a GET of each, hashed) finds it. Each found is dropped from the
    manifest and recorded lost, so the driver's next start extracts it again."""
    samples, state, _ = dirs(tmp_path)
    written = make_samples(samples, 5, ranged=True, sample_ids=True, hidden=4096)
    dest, args = f"s3://hs-runs/{prefix}", s3_server.ship_args()
    assert shipper.main(ship_cmd(samples, state, dest, *args)) == shipper.EXIT_OK
    admin, key = s3_server.client(), lambda w: f"{prefix}/samples/{w.path.name}"
    body = admin.get_object(Bucket="hs-runs", Key=key(written[0]))["Body"].read()
    admin.put_object(Bucket="hs-runs", Key=key(written[0]), Body=body[:100] + bytes([body[100] ^ 1]) + body[101:])
    admin.put_object(Bucket="hs-runs", Key=key(written[1]), Body=body[:1000])
    admin.delete_object(Bucket="hs-runs", Key=key(written[2]))
    capsys.readouterr()
    assert shipper.main(ship_cmd(samples, state, dest, *args)) == shipper.EXIT_UNVERIFIED
    err = capsys.readouterr().err
    assert f"{written[0].path.name} at {dest} is damaged: replaced since it was verified" in err, err
    assert f"{written[1].path.name} at {dest} is damaged: size 1000" in err
    assert f"{written[2].path.name} at {dest} is damaged: missing" in err
    assert "3 samples shipped earlier are damaged or missing at the destination" in err
    assert {r["key"] for r in store_manifest(s3_server, prefix)} == {w.key for w in written[3:]}
    assert set(runstate.load_done(samples, state / runstate.SHIPPED).by_key) == {w.key for w in written[3:]}

    # bit rot on the store's disk: one byte of an object's stored chunk flipped in SeaweedFS's volume file
    victim = (samples / written[3].path.name)
    flip_at_store(s3_server, body_of(s3_server, key(written[3])))
    assert shipper.main(ship_cmd(samples, state, dest, *args)) == shipper.EXIT_OK  # size and ETag unchanged
    capsys.readouterr()
    assert shipper.main(ship_cmd(samples, state, dest, *args, "--verify-deep")) == shipper.EXIT_UNVERIFIED
    err = capsys.readouterr().err
    assert f"{victim.name} at {dest} is damaged: the store cannot read it back (500" in err, err
    assert {r["key"] for r in store_manifest(s3_server, prefix)} == {written[4].key}
    assert status(state)["checked"] == dict(status(state)["checked"], files=2, deep=True, damaged=1)


def body_of(server, key: str) -> bytes:
    return server.client().get_object(Bucket="hs-runs", Key=key)["Body"].read()


def flip_at_store(server, data: bytes) -> None:
    """Flip one byte of ``data`` where SeaweedFS keeps it on disk (its volume files: bit rot under the store)."""
    marker = data[len(data) // 2:len(data) // 2 + 64]
    for dat in (server.directory / "data").rglob("*.dat"):
        raw = dat.read_bytes()
        at = raw.find(marker)
        if at >= 0:
            with open(dat, "r+b") as f:
                f.seek(at + 7)
                b = f.read(1)
                f.seek(at + 7)
                f.write(bytes([b[0] ^ 0x20]))
            return
    raise AssertionError("the object's bytes were not found in the store's volume files")


def test_a_resume_skips_only_what_the_store_verified(tmp_path, s3_server, prefix, monkeypatch):
    """Cut after the uploads, before the manifest is written: the next run sends nothing the store holds
    verified (a HEAD each), and sends again the one replaced at the store meanwhile."""
    samples, state, _ = dirs(tmp_path)
    written = make_samples(samples, 3, ranged=True) + large(samples, 3)
    dest = f"s3://hs-runs/{prefix}"
    cfg = shipper.ShipConfig(samples, state, bucket.parse_url(dest), s3=bucket.S3Options(
        endpoint=s3_server.endpoint, region="us-east-1", addressing="path",
        credentials=str(s3_server.credentials_file())))

    class Crash(BaseException):
        pass

    def crash(self, change, tries=30):
        raise Crash("killed before the manifest")
    with monkeypatch.context() as m:
        m.setattr(bucket.Bucket, "update_manifest", crash)
        with pytest.raises(Crash):
            shipper.ship(cfg)
    assert sorted(objects(s3_server, prefix)) == sorted(w.path.name for w in written)
    assert all(w.path.exists() for w in written) and not shipped_records(state)
    s3_server.client().put_object(Bucket="hs-runs", Key=f"{prefix}/samples/{written[1].path.name}", Body=b"other")

    sent = []
    real = bucket.Bucket.call

    def count(self, what, fn, **kw):
        if what.startswith("PUT") or what.startswith("starting the upload"):
            sent.append(what)
        return real(self, what, fn, **kw)
    monkeypatch.setattr(bucket.Bucket, "call", count)
    assert shipper.ship(cfg) == shipper.EXIT_OK
    assert sent == [f"PUT {prefix}/samples/{written[1].path.name}"], sent
    assert_bucket_has(s3_server, prefix, written)
    assert_shipped_locally(samples, state, written)


def test_the_store_over_its_quota_is_waited_out_and_nothing_is_lost(tmp_path, s3_server, prefix):
    samples, state, _ = dirs(tmp_path)
    dest, args = f"s3://hs-quota/{prefix}", s3_server.ship_args()
    first = make_samples(samples, 2, ranged=True, tokens=16, hidden=32768)  # 1 MiB each
    assert shipper.main(ship_cmd(samples, state, dest, *args)) == shipper.EXIT_OK
    later = make_samples(samples, 2, start=2, ranged=True, tokens=16, hidden=32768)
    # over its quota: SeaweedFS makes the bucket read-only once its usage is reported (a few seconds)
    wait("the bucket to refuse writes over its quota", lambda: refuses_writes(s3_server, "hs-quota", prefix), 60, 1)
    proc = popen_ship(samples, state, dest, *args, "--backoff-max", "0.5")
    try:
        wait("the shipper to wait for the store", lambda: (state_of(state).get("outage") or {}).get("failures", 0) >= 3,
             60)
        st = state_of(state)
        assert proc.poll() is None and st["state"] in ("waiting_for_destination", "shipping") and st["outage"]
        assert "the store answered 500" in st["last_error"] and "over a quota" in st["last_error"], st["last_error"]
        assert len(shipped_records(state)) == 2 and all(w.path.exists() for w in later)
    finally:
        s3_server.quota("hs-quota", 0)  # space again: the quota removed
        code, err = finish(proc, 120)
    assert code == shipper.EXIT_OK, err[-3000:]
    assert "the destination is back after" in err
    assert_bucket_has(s3_server, prefix, first + later, "hs-quota")
    assert_shipped_locally(samples, state, first + later)


def refuses_writes(server, bucket_name: str, prefix: str) -> bool:
    server.quota(bucket_name, 1)
    try:
        server.client().put_object(Bucket=bucket_name, Key=f"{prefix}/probe", Body=b"x")
    except Exception:
        return True
    server.client().delete_object(Bucket=bucket_name, Key=f"{prefix}/probe")
    return False


def test_the_server_killed_mid_multipart_and_restarted_loses_nothing(tmp_path, slow_link, prefix):
    server = slow_link
    samples, state, _ = dirs(tmp_path)
    written = make_samples(samples, 2, ranged=True) + large(samples, 2)
    dest = f"s3://hs-runs/{prefix}"
    proc = popen_ship(samples, state, dest, *server.ship_args(), "--backoff-max", "1", "--s3-concurrency", "2")
    try:
        wait("a multipart upload to start", lambda: uploads_open(state) == 1, 60)
        time.sleep(2)  # parts in flight
        server.kill()
        wait("the shipper to notice", lambda: (state_of(state).get("outage") or {}).get("failures", 0) >= 2, 120)
        assert not any(r["file"] == written[2].path.name for r in shipped_records(state))
        assert all(w.path.exists() for w in written[2:])
    finally:
        if server.proc.poll() is not None:
            server.start()  # the same server, on the same data
        code, err = finish(proc, 180)
    assert code == shipper.EXIT_OK, err[-3000:]
    assert_bucket_has(server, prefix, written)
    assert_shipped_locally(samples, state, written)
    assert uploads_open(state) == 0
    no_uploads_left(server, prefix)


def test_the_shipper_sigkilled_mid_upload_resumes_and_aborts_what_it_left(tmp_path, slow_link, prefix):
    server = slow_link
    samples, state, _ = dirs(tmp_path)
    written = large(samples, 0) + make_samples(samples, 2, start=1, ranged=True)
    dest = f"s3://hs-runs/{prefix}"
    proc = popen_ship(samples, state, dest, *server.ship_args(), "--s3-concurrency", "2")
    try:
        wait("a multipart upload to start", lambda: uploads_open(state) == 1, 60)
        time.sleep(1.5)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert uploads_open(state) == 1 and all(w.path.exists() for w in written)
    assert server.client().list_multipart_uploads(Bucket="hs-runs", Prefix=prefix).get("Uploads")
    assert shipper.main(ship_cmd(samples, state, dest, *server.ship_args())) == shipper.EXIT_OK
    assert_bucket_has(server, prefix, written)
    assert_shipped_locally(samples, state, written)
    assert uploads_open(state) == 0
    no_uploads_left(server, prefix)


def test_two_hosts_ship_one_run_into_one_bucket_and_a_reassigned_shard_beside_its_host(tmp_path, s3_server, prefix):
    """gpu1 and gpu2 ship their parts of run r (r/gpu1, r/gpu2) at once; gpu3, which took gpu2's shard while
    gpu2 was cut off, ships the same samples (its own bytes) into r/gpu2 at the same time. Each sample is at the
    store once, its bytes those of the manifest line that lists it, which is a line of the driver's manifest of
    the host that shipped it; the other host's copy is dropped there, not listed."""
    hosts = {"gpu1": (0, 0, "r"), "gpu2": (10, 0, "r"), "gpu3": (10, 5, "r.gpu2")}
    made, lines = {}, {}
    for host, (start, seed, run) in hosts.items():
        made[host] = make_samples(tmp_path / host / "samples", 6, start=start, seed_offset=seed, ranged=True,
                                  sample_ids=True, run=run, host=host, hidden=2048)
        lines[host] = {r["key"]: r for r in store.manifest_records(tmp_path / host / "samples") if r["op"] == "add"}
    assert {w.key for w in made["gpu2"]} == {w.key for w in made["gpu3"]}
    part = {"gpu1": "r/gpu1", "gpu2": "r/gpu2", "gpu3": "r/gpu2"}
    procs = {h: popen_ship(tmp_path / h / "samples", tmp_path / h / "state", f"s3://hs-runs/{prefix}/{part[h]}",
                           *s3_server.ship_args(), "--batch-files", "2") for h in hosts}
    ends = {h: finish(p, 120) for h, p in procs.items()}
    bad = {h: e for h, (code, e) in ends.items() if code != shipper.EXIT_OK}
    if bad:  # each failing host's whole stderr (an assert's message would be cut short)
        pytest.fail("\n".join(f"--- {h}:\n{e[-6000:]}" for h, e in bad.items()))
    assert_bucket_has(s3_server, f"{prefix}/r/gpu1", made["gpu1"])
    listed = {r["key"]: r for r in store_manifest(s3_server, f"{prefix}/r/gpu2")}
    assert sorted(listed) == sorted(w.key for w in made["gpu2"]) and len(store_manifest(s3_server, f"{prefix}/r/gpu2")) == 6
    held = objects(s3_server, f"{prefix}/r/gpu2")
    for key, rec in listed.items():
        driver_line = lines[rec["host"]][key]
        assert rec["sha256"] == driver_line["sha256"] and rec["sample_id"] == driver_line["sample_id"]
        data = held[f"{key}.safetensors"]
        assert (len(data), digest_of(data, rec["sha256"])) == (driver_line["bytes"], driver_line["sha256"])
    for h in hosts:  # every host's samples count as shipped there (its own or the store's kept copy), deleted
        recs = shipped_records(tmp_path / h / "state")
        assert sorted(r["key"] for r in recs) == sorted(w.key for w in made[h])
        assert all(not w.path.exists() for w in made[h])
        kept = [r for r in recs if r.get("kept")]
        assert all(r["sha256"] == listed[r["key"]]["sha256"] for r in kept)
    no_uploads_left(s3_server, prefix)


@pytest.mark.slow
def test_the_link_cut_for_20_s_and_for_200_s_mid_upload_loses_nothing(tmp_path, slow_link, prefix):
    """The store's side of the link taken down (its packets dropped: a storage host gone from the network) in
    the middle of a multipart upload, for 20 s, then for 200 s; a follow shipper rides both out and ships all."""
    server = slow_link
    samples, state, _ = dirs(tmp_path)
    dest = f"s3://hs-runs/{prefix}"
    written = large(samples, 0) + make_samples(samples, 2, start=1, ranged=True)
    proc = popen_ship(samples, state, dest, *server.ship_args(), "--follow", "--poll", "0.2", "--backoff-max", "3",
                      "--s3-concurrency", "2")
    try:
        for round_, seconds in enumerate((20, 200)):
            wait("a multipart upload to start", lambda: uploads_open(state) >= 1, 120)
            time.sleep(1.5)
            server.cut()
            cut_at = time.monotonic()
            try:
                wait("the shipper to see the outage", lambda: state_of(state).get("outage"), seconds + 120, 0.5)
                before = len(shipped_records(state))
                time.sleep(max(0.0, seconds - (time.monotonic() - cut_at)))
                st = state_of(state)
                assert proc.poll() is None and st["outage"], st
                assert len(shipped_records(state)) == before and all(w.path.exists() for w in written[-3:])
            finally:
                server.mend()
            wait("the rest to ship after the link is back",
                 lambda: len(shipped_records(state)) == len(written), 300, 0.5)
            if round_ == 0:
                written += large(samples, 10) + make_samples(samples, 2, start=11, ranged=True)
        (state / shipper.DONE_MARKER).write_text("")
        code, err = finish(proc, 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code == shipper.EXIT_OK, err[-3000:]
    assert err.count("the destination is back after") >= 2, err[-3000:]
    assert_bucket_has(server, prefix, written)
    assert_shipped_locally(samples, state, written)
    assert uploads_open(state) == 0
    no_uploads_left(server, prefix)
    assert json.loads((state / shipper.STATUS_FILE).read_text())["state"] == "done"
    assert os.path.exists(samples / store.MANIFEST)
