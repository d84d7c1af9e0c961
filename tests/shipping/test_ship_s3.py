"""Shipping to an S3 bucket (issue #37), against a real S3 server: SeaweedFS, started once per test run
(tests/conftest.py ``s3_server``; every S3 test module is in the xdist group "s3", so one worker holds it).
Each test ships under a prefix of its own."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import uuid

import pytest

from hs_patch.host.shipping import bucket, shipper
from hs_patch.samples.files import RANGE, RANGED
from lab import seaweed
from lab.ship_runs import (assert_bucket_has, assert_shipped_locally, dirs, make_samples, objects, ship_cmd,
                           shipped_records, status, store_manifest)

pytestmark = pytest.mark.xdist_group("s3")


@pytest.fixture
def prefix(request) -> str:
    return f"{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"


def test_ships_to_a_bucket_verified_by_the_store_whose_composite_checksum_is_our_ranged_digest(
        tmp_path, s3_server, prefix, capsys):
    samples, state, _ = dirs(tmp_path)
    small = make_samples(samples, 3, ranged=True, sample_ids=True, line_sha256="b" * 64)
    large = make_samples(samples, 1, start=3, tokens=2, hidden=(RANGE * 2 + 4096) // 4, ranged=True)  # 3 parts
    plain = make_samples(samples, 1, start=4)  # a sample from before ranged digests: one PUT with its sha256
    written = small + large + plain
    assert large[0].nbytes > 2 * RANGE and plain[0].sha256[:len(RANGED)] != RANGED
    dest = f"s3://hs-runs/{prefix}"
    assert shipper.main(ship_cmd(samples, state, dest, *s3_server.ship_args())) == shipper.EXIT_OK
    assert_bucket_has(s3_server, prefix, written)
    assert_shipped_locally(samples, state, written)

    # the store's own checksum of the multipart object is the capture writer's ranged digest
    head = s3_server.client().head_object(Bucket="hs-runs", Key=f"{prefix}/samples/{large[0].path.name}",
                                          ChecksumMode="ENABLED")
    ours = base64.b64encode(bytes.fromhex(large[0].sha256[len(RANGED):])).decode()
    assert head["ChecksumSHA256"] == f"{ours}-3", "the composite SHA256 of 64 MiB parts is not sha256r64m:"
    # a single PUT's checksum is the sha256 of the body: its sha256 again is the one-range ranged digest
    head = s3_server.client().head_object(Bucket="hs-runs", Key=f"{prefix}/samples/{small[0].path.name}",
                                          ChecksumMode="ENABLED")
    assert RANGED + hashlib.sha256(base64.b64decode(head["ChecksumSHA256"])).hexdigest() == small[0].sha256
    lines = {r["key"]: r for r in store_manifest(s3_server, prefix)}
    assert {r["sample_id"] for r in lines.values() if "sample_id" in r} == {f"data.jsonl:{i}" for i in (1, 2, 3)}
    assert all(r["etag"] and r["shipped"] for r in lines.values())
    st = status(state)
    assert st["state"] == "done" and st["dest"] == dest and st["shipped"]["count"] == 5
    assert "hsshipper-secret" not in json.dumps(st) + capsys.readouterr().err  # credentials never shown

    # a re-ship checks what the bucket holds (one listing) and has nothing to do
    assert shipper.main(ship_cmd(samples, state, dest, *s3_server.ship_args())) == shipper.EXIT_OK
    assert "hs-ship: done (5 files at the destination checked" in capsys.readouterr().err
    assert len(shipped_records(state)) == 5

    # the state dir lost too (a reboot, with it on tmpfs): the start-up sync records what the bucket holds, with
    # each sample's dataset-line digest, by which a resume over a changed dataset finds its line (the bucket's
    # listing dropped it: a line inserted before them was then taken for one already done)
    for p in sorted(state.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    assert shipper.main(ship_cmd(samples, state, dest, *s3_server.ship_args())) == shipper.EXIT_OK
    recs = {r["key"]: r for r in shipped_records(state)}
    assert len(recs) == 5 and all(r["from"] == "destination" for r in recs.values())
    assert {recs[w.key].get("line_sha256") for w in small} == {"b" * 64}


def test_every_upload_of_a_round_ends_when_one_fails():
    """One upload cut by an outage raised before the others' ends ran, and those end by closing their files: each
    cut left a batch of deleted samples' files open (their RAM in /dev/shm) and file descriptors with them."""
    from hs_patch.host.shipping import bucket_commit

    ended: list[int] = []

    def upload(i: int):
        def finish() -> dict:
            ended.append(i)
            if i == 0:
                raise bucket_commit.LinkError("the store did not answer")
            return {"status": "sent"}
        return finish

    results = [{} for _ in range(4)]
    with pytest.raises(bucket_commit.LinkError, match="did not answer"):
        bucket_commit.finish_all(results, [upload(i) for i in range(4)])
    assert ended == [0, 1, 2, 3] and results[1:] == [{"status": "sent"}] * 3


def test_a_virtual_host_addressed_bucket_works_too(tmp_path, s3_server, prefix, monkeypatch):
    """--s3-addressing virtual: requests go to BUCKET.s3.hs.test (resolved here to the server; SeaweedFS
    serves the bucket named by the host, -s3.domainName)."""
    real = socket.getaddrinfo
    hosts = []

    def resolve(host, *a, **k):
        if isinstance(host, str) and host.endswith("." + seaweed.DOMAIN):
            hosts.append(host)
            host = s3_server.address
        return real(host, *a, **k)
    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    samples, state, _ = dirs(tmp_path)
    written = make_samples(samples, 2, ranged=True)
    args = ["--s3-endpoint", f"http://{seaweed.DOMAIN}:{seaweed.S3_PORT}", "--s3-addressing", "virtual",
            "--s3-credentials", str(s3_server.credentials_file())]
    assert shipper.main(ship_cmd(samples, state, f"s3://hs-runs/{prefix}", *args)) == shipper.EXIT_OK
    assert set(hosts) == {f"hs-runs.{seaweed.DOMAIN}"}, "not virtual-host addressed"
    assert_bucket_has(s3_server, prefix, written)


def test_wrong_credentials_and_a_missing_bucket_are_refused_clearly_and_nothing_counts_as_shipped(
        tmp_path, s3_server, prefix, capsys):
    samples, state, _ = dirs(tmp_path)
    written = make_samples(samples, 2, ranged=True)
    wrong = s3_server.credentials_file((seaweed.SHIPPER[0], "not-the-secret"), name="wrong")
    cases = [(f"s3://hs-runs/{prefix}", s3_server.ship_args(wrong), "403 SignatureDoesNotMatch: the store does not accept these credentials"),
             (f"s3://hs-runs/{prefix}", s3_server.ship_args(s3_server.credentials_file(("nobody", "x" * 20), "none")),
              "InvalidAccessKeyId: the store does not accept these credentials"),
             # the least-privileged identity may not even see another bucket: 403, and the words say both
             (f"s3://no-such-bucket/{prefix}", s3_server.ship_args(), "has the policy), or that bucket does not exist"),
             (f"s3://hs-runs/{prefix}", ["--s3-endpoint", s3_server.endpoint, "--s3-credentials",
                                         str(s3_server.credentials_file(seaweed.ADMIN, "admin")), "--s3-region",
                                         "us-east-1", "--s3-addressing", "path"], None)]
    for dest, args, words in cases[:3]:
        assert shipper.main(ship_cmd(samples, state, dest, *args)) == shipper.EXIT_ERROR
        err = capsys.readouterr().err
        assert words in err and "nothing unverified was deleted" in err, err
        assert "not-the-secret" not in err and "x" * 20 not in err
        assert not shipped_records(state) and all(w.path.exists() for w in written)
        assert status(state)["state"] == "failed"
    assert not objects(s3_server, prefix), "a refused shipper put something in the bucket"
    # a missing bucket is never created, even with credentials that could (the admin's)
    dest, args, _ = cases[3]
    assert shipper.main(ship_cmd(samples, state, f"s3://not-created/{prefix}", *args)) == shipper.EXIT_ERROR
    assert "does not exist" in capsys.readouterr().err
    assert "not-created" not in {b["Name"] for b in s3_server.client().list_buckets()["Buckets"]}


@pytest.mark.parametrize("argv, words", [
    (["--s3-addressing", "sideways"], "invalid choice"),
    (["--s3-endpoint", "s3.example.com"], "give http://HOST[:PORT] or https://HOST[:PORT]"),
    (["--s3-endpoint", "https://key:secret@s3.example.com"], "must not hold credentials"),
    (["--s3-concurrency", "0"], "between 1 and 64"),
    (["--ssh-port", "2222"], "the SSH options and --bwlimit mean nothing there"),
])
def test_bad_s3_options_exit_2_and_say_what_to_fix(tmp_path, capsys, argv, words):
    samples, state, _ = dirs(tmp_path)
    samples.mkdir()
    try:
        code = shipper.main(ship_cmd(samples, state, "s3://hs-runs/p", *argv))
    except SystemExit as e:  # argparse's own refusal
        code = e.code
    assert code == shipper.EXIT_USAGE and words in capsys.readouterr().err


def test_s3_options_with_an_rsync_destination_and_bad_urls_are_refused(tmp_path, capsys):
    samples, state, dest = dirs(tmp_path)
    samples.mkdir()
    assert shipper.main(ship_cmd(samples, state, str(dest), "--s3-region", "eu-west-1")) == shipper.EXIT_USAGE
    assert "--s3-* options mean nothing" in capsys.readouterr().err
    for url in ("s3://Bad_Bucket/p", "s3://ab/p", "s3://hs-runs/a//b", "s3://hs-runs/../x"):
        assert shipper.main(ship_cmd(samples, state, url)) == shipper.EXIT_USAGE, url
        assert "give s3://BUCKET/PREFIX" in capsys.readouterr().err or url.endswith(("b", "x"))


def test_checksum_matches_takes_only_the_manifests_digest():
    data = b"x" * 1000
    d = hashlib.sha256(data).digest()
    ranged_one = RANGED + hashlib.sha256(d).hexdigest()
    assert bucket.checksum_matches(bucket.b64(d), 1000, ranged_one)
    assert bucket.checksum_matches(bucket.b64(d), 1000, d.hex())
    assert not bucket.checksum_matches(bucket.b64(d) + "-1", 1000, d.hex())      # a composite is no plain sha256
    assert not bucket.checksum_matches(None, 1000, d.hex())                     # the store kept no checksum
    parts = [hashlib.sha256(b"a").digest(), hashlib.sha256(b"b").digest()]
    composite = hashlib.sha256(b"".join(parts)).digest()
    two = RANGED + composite.hex()
    assert bucket.checksum_matches(bucket.b64(composite) + "-2", RANGE + 1, two)
    assert not bucket.checksum_matches(bucket.b64(composite) + "-3", RANGE + 1, two)  # not 64 MiB parts
    assert not bucket.checksum_matches(bucket.b64(composite), RANGE + 1, two)


def test_help_names_the_s3_destination_and_its_options(capsys):
    with pytest.raises(SystemExit):
        shipper.main(["ship", "--help"])
    out = capsys.readouterr().out
    for words in ("s3://BUCKET/PREFIX", "--s3-endpoint", "--s3-addressing", "--s3-credentials", "--s3-concurrency",
                  "--verify-deep", "LoadCredential"):
        assert words in out, words


def test_what_a_killed_run_left_on_a_free_subnet_is_removed_before_the_subnet_is_used(tmp_path):
    """A run killed before its ``down`` leaves its veth (holding this side's address), its netns and maybe weed
    itself: the next run's address would route there and its server would never answer (a CI run failed so).
    The lock of that subnet is free, so the next ``up`` removes them by name, with what still runs inside."""
    import subprocess
    import time

    if why := seaweed.available():
        pytest.skip(why)
    # tags with letters no pid-derived tag has (hex digits only): never the names of the run's own server
    probe = seaweed.Seaweed(tmp_path, tag="tst1")
    probe._claim_subnet()  # the first free subnet, as the next run would take it
    subnet, host_address = probe.subnet, probe.host_address
    probe._lock.close()
    stale = seaweed.Seaweed(tmp_path, tag="tst2")
    sleeper = None
    try:
        subprocess.run(["ip", "netns", "add", stale.netns], check=True)
        subprocess.run(["ip", "link", "add", stale.host_veth, "type", "veth", "peer", "name", stale.server_veth,
                             "netns", stale.netns], check=True)
        subprocess.run(["ip", "addr", "add", f"{host_address}/30", "dev", stale.host_veth], check=True)
        sleeper = subprocess.Popen(["ip", "netns", "exec", stale.netns, "sleep", "120"], start_new_session=True)
        deadline = time.monotonic() + 10
        while not subprocess.run(["ip", "netns", "pids", stale.netns], capture_output=True, text=True).stdout.split():
            assert time.monotonic() < deadline, "the stand-in for a left weed never entered the netns"
            time.sleep(0.05)
        fresh = seaweed.Seaweed(tmp_path, tag="tst3")
        fresh._claim_subnet()
        try:
            assert fresh.subnet == subnet, "the stale subnet was skipped instead of reclaimed"
            links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
            assert stale.host_veth not in links
            assert stale.netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert sleeper.wait(10) == -9, "what ran in the stale netns was not stopped"
        finally:
            fresh.down()
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(10)
        subprocess.run(["ip", "link", "del", stale.host_veth], capture_output=True)
        subprocess.run(["ip", "netns", "del", stale.netns], capture_output=True)
