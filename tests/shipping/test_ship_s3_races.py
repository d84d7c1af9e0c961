"""Two shippers of one S3 prefix (a reassigned shard and its host back) writing the same sample, against the real
S3 server: the other shipper's write is made to land at the worst moment, right after this shipper's upload and
before its verifying HEAD. Under load in CI, two shippers replacing each other's copies in turn each gave up after
--retries rounds (exit 3); a copy replaced after the upload was called a failed verification."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from hs_patch.host.shipping import batches, bucket, bucket_link, shipper
from hs_patch.samples import store
from lab.ship_runs import dirs, make_samples, objects, ship_cmd, shipped_records, store_manifest

pytestmark = pytest.mark.xdist_group("s3")


@pytest.fixture
def prefix(request) -> str:
    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(batches, "RACE_PAUSE", (0.05, 0.1))


def two_versions(tmp_path):
    """One sample as this host (gpu3, run r.gpu2) and the other (gpu2, run r) wrote it: same key, other bytes."""
    samples, state, _ = dirs(tmp_path)
    ours = make_samples(samples, 1, start=10, seed_offset=5, ranged=True, sample_ids=True, run="r.gpu2", host="gpu3",
                        hidden=2048)[0]
    theirs_dir = tmp_path / "gpu2"
    theirs = make_samples(theirs_dir, 1, start=10, ranged=True, sample_ids=True, run="r", host="gpu2", hidden=2048)[0]
    assert ours.key == theirs.key and ours.sha256 != theirs.sha256
    line = next(r for r in store.manifest_records(theirs_dir) if r["op"] == "add")
    return samples, state, ours, theirs, line


def other_shipper_writes(b: bucket.Bucket, theirs: store.Written) -> str:
    """The other shipper's PUT of its copy (unconditional: it won its race), with the checksum it sends."""
    data = theirs.path.read_bytes()
    r = b.s3.put_object(Bucket=b.dest.bucket, Key=b.dest.sample_key(theirs.path.name), Body=data,
                        ChecksumSHA256=bucket.b64(hashlib.sha256(data).digest()))
    return r["ETag"]


def other_shipper_lists(b: bucket.Bucket, line: dict, etag: str) -> None:
    rec = dict(line, op="add", file=f"{bucket.SAMPLES}/{line['file']}", etag=etag, shipped=1.0)
    b.update_manifest(lambda entries: entries.update({line["key"]: rec}) is None)


def replaced_after_each_upload(monkeypatch, theirs: store.Written, etags: list[str]) -> list[int]:
    """After each of this shipper's uploads of the sample, before its HEAD, the other shipper's copy lands."""
    sent: list[int] = []
    real = bucket_link.BucketLink.upload

    def upload(self, b, f, commit, cond):
        finish = real(self, b, f, commit, cond)

        def after():
            res = finish()
            if res["status"] == "sent":
                sent.append(1)
                etags.append(other_shipper_writes(b, theirs))
            return res
        return after
    monkeypatch.setattr(bucket_link.BucketLink, "upload", upload)
    return sent


def test_a_copy_replaced_after_the_upload_is_left_to_the_shipper_that_wrote_it_and_kept_once_it_lists_it(
        tmp_path, s3_server, prefix, monkeypatch, fast, capsys):
    samples, state, ours, theirs, line = two_versions(tmp_path)
    etags: list[str] = []
    sent = replaced_after_each_upload(monkeypatch, theirs, etags)
    waited: list[int] = []
    real_held = bucket_link.BucketLink.held

    def held(self, b, f, stored):
        res = real_held(self, b, f, stored)
        if res["status"] == "raced":  # waiting for its line: the other shipper lists it after the third wait
            waited.append(1)
            if len(waited) == 3:
                other_shipper_lists(b, line, etags[-1])
        return res
    monkeypatch.setattr(bucket_link.BucketLink, "held", held)

    dest = f"s3://hs-runs/{prefix}"
    assert shipper.main(ship_cmd(samples, state, dest, *s3_server.ship_args())) == shipper.EXIT_OK
    err = capsys.readouterr().err
    assert len(sent) == 1 and len(waited) == 3, "replaced a copy another shipper had not listed yet"
    assert "replaced it at the store right after the upload" in err and "its manifest line awaited" in err
    assert "after transfer" not in err and "mismatch" not in err, "a race was counted as a failed transfer"
    assert objects(s3_server, prefix) == {theirs.path.name: theirs.path.read_bytes()}
    assert [(r["key"], r["sha256"], r["host"]) for r in store_manifest(s3_server, prefix)] == \
        [(theirs.key, theirs.sha256, "gpu2")]
    (rec,) = shipped_records(state)
    assert rec["kept"] and rec["sha256"] == theirs.sha256 and not ours.path.exists()


def test_a_copy_its_writer_never_lists_is_replaced_once_the_wait_is_over(
        tmp_path, s3_server, prefix, monkeypatch, fast, capsys):
    """The other shipper died between its PUT and its manifest line: its copy is not waited for for ever."""
    samples, state, ours, theirs, _ = two_versions(tmp_path)
    ours_bytes = ours.path.read_bytes()
    real_held = bucket_link.BucketLink.held

    def held(self, b, f, stored):  # the wait (YIELD_SECONDS) over once it has been waited once
        res = real_held(self, b, f, stored)
        if res["status"] == "raced":
            monkeypatch.setattr(bucket_link, "YIELD_SECONDS", 0.0)
        return res
    monkeypatch.setattr(bucket_link.BucketLink, "held", held)
    real = bucket_link.BucketLink.upload
    sent: list[str] = []

    def upload(self, b, f, commit, cond):  # the other shipper writes after the first upload only
        finish = real(self, b, f, commit, cond)

        def after():
            res = finish()
            sent.append(res["status"])
            if len(sent) == 1:
                other_shipper_writes(b, theirs)
            return res
        return after
    monkeypatch.setattr(bucket_link.BucketLink, "upload", upload)

    dest = f"s3://hs-runs/{prefix}"
    assert shipper.main(ship_cmd(samples, state, dest, *s3_server.ship_args())) == shipper.EXIT_OK
    err = capsys.readouterr().err
    assert sent == ["sent", "sent"] and "its manifest line awaited" in err
    assert objects(s3_server, prefix) == {ours.path.name: ours_bytes}
    assert [(r["key"], r["sha256"]) for r in store_manifest(s3_server, prefix)] == [(ours.key, ours.sha256)]
    (rec,) = shipped_records(state)
    assert not rec.get("kept") and rec["sha256"] == ours.sha256


def test_races_that_never_end_count_as_failed_transfers_after_the_grace_and_the_copy_stays_here(
        tmp_path, s3_server, prefix, monkeypatch, fast, capsys):
    samples, state, ours, theirs, _ = two_versions(tmp_path)
    monkeypatch.setattr(bucket_link, "YIELD_SECONDS", 0.0)
    monkeypatch.setattr(batches, "RACE_GRACE_SECONDS", 0.3)
    sent = replaced_after_each_upload(monkeypatch, theirs, [])
    dest = f"s3://hs-runs/{prefix}"
    assert shipper.main(ship_cmd(samples, state, dest, *s3_server.ship_args())) == shipper.EXIT_UNVERIFIED
    err = capsys.readouterr().err
    assert "decided again shortly" in err and "raced at the destination after transfer 3 of 3" in err
    assert len(sent) >= 3 and ours.path.exists() and shipped_records(state) == []
