"""The capture writer's ranged digest (issue #22): the sha256 of the sha256 digests of a file's 64 MiB
ranges, written and hashed side by side, so a sample's checksum no longer costs one core's sha256 of
the whole file at the end of a burst. The GPU host writes it, every verifier (the reader, the driver's
checks, the shipper's step on the destination) hashes a file the way its recorded digest says, and
samples with a plain sha256 read as before."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from hs_patch.host.shipping import at_destination
from hs_patch.samples import files, reader, store
from hs_patch.server.writer import PassRecord, Writer
from lab.sample_files import flip_byte

def by_definition(data: bytes) -> str:
    ranges = [hashlib.sha256(data[s:s + files.RANGE]).digest() for s in range(0, len(data), files.RANGE)]
    return files.RANGED + hashlib.sha256(b"".join(ranges)).hexdigest()


def big_tensors(tokens: int) -> list[store.TensorBytes]:
    """Two planes of ``tokens`` rows of 7168 bf16 and the ids: buffers whose edges fall inside ranges."""
    g = torch.Generator().manual_seed(tokens)
    planes = [torch.randn(tokens, 7168, generator=g).to(torch.bfloat16) for _ in range(2)]
    return [store.tensor_bytes(f"layer.{i}", p) for i, p in enumerate(planes)] + \
        [store.tensor_bytes("input_ids", torch.arange(tokens, dtype=torch.int64))]


@pytest.mark.parametrize("tokens", [1, 5000])  # one partial range; 143 MB: two whole ranges and a part
def test_a_sample_written_in_ranges_is_the_same_file_and_every_verifier_agrees_on_its_digest(tmp_path, tokens):
    tensors, meta = big_tensors(tokens), {"key": "k", "num_tokens": str(tokens)}
    plain = store.write_temp(tmp_path / "a", "k", tensors, meta)
    ranged = store.write_temp(tmp_path / "b", "k", tensors, meta, ranges=True)
    data = plain.path.read_bytes()
    assert ranged.path.read_bytes() == data and ranged.nbytes == plain.nbytes == len(data)
    assert plain.sha256 == hashlib.sha256(data).hexdigest()
    assert ranged.sha256 == by_definition(data) and ranged.sha256.startswith("sha256r64m:")
    assert files.file_ranged(ranged.path) == files.file_ranged(ranged.path, mapped=True) == (len(data), ranged.sha256)
    assert files.file_digest(ranged.path, ranged.sha256) == (len(data), ranged.sha256)
    assert files.file_digest(plain.path, plain.sha256) == (len(data), plain.sha256)
    assert at_destination.sha256_and_sync(str(ranged.path), ranged.sha256) == (len(data), ranged.sha256)
    assert at_destination.sha256_and_sync(str(plain.path), plain.sha256) == (len(data), plain.sha256)


@pytest.mark.parametrize("size", [0, files.RANGE, files.RANGE + 1])
def test_range_edges_agree_between_the_gpu_host_and_the_destination(tmp_path, size):
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
    want = by_definition(path.read_bytes())
    assert files.file_ranged(path) == files.file_ranged(path, mapped=True) == (size, want)
    assert at_destination.sha256_and_sync(str(path), want) == (size, want)


def test_a_damaged_byte_in_any_range_is_caught_by_every_verifier(tmp_path):
    w = store.write_sample(tmp_path, "k" * 32, big_tensors(5000), {"key": "k" * 32})
    entry = {"file": w.path.name, "bytes": w.nbytes, "sha256": w.sha256}
    assert store.verify_entry(tmp_path, entry) is None
    w2 = store.write_temp(tmp_path, "r", big_tensors(5000), {"key": "r"}, ranges=True)
    entry = {"file": f"{store.TMPDIR}/{w2.path.name}", "bytes": w2.nbytes, "sha256": w2.sha256}
    assert store.verify_entry(tmp_path, entry) is None
    flip_byte(w2.path, files.RANGE + 12345, 1)  # one bit in the second range
    assert "differs from the manifest" in store.verify_entry(tmp_path, entry)
    with pytest.raises(store.SampleError, match="damaged"):
        reader.check_entry(w2.path, entry)
    assert at_destination.sha256_and_sync(str(w2.path), w2.sha256) != (w2.nbytes, w2.sha256)


def test_a_damaged_files_message_tells_its_digest_from_the_manifests(tmp_path):
    """The first 12 characters of a ranged digest are 'sha256r64m:' and one hex digit: the message showed
    two different digests as equal 1 time in 16. And a file longer than recorded grew, it is not truncated."""
    w = store.write_temp(tmp_path, "r", big_tensors(100), {"key": "r"}, ranges=True)
    entry = {"file": f"{store.TMPDIR}/{w.path.name}", "bytes": w.nbytes, "sha256": w.sha256}
    flip_byte(w.path, 100, 1)
    got = files.file_digest(w.path, w.sha256)[1]
    for lookalike in (w.sha256, got[:12] + w.sha256[12:]):  # the recorded one shares the damaged one's first 12
        entry["sha256"] = lookalike
        why = store.verify_entry(tmp_path, entry)
        shown = why.split("sha256 ", 1)[1].split(" differs from the manifest's ")
        assert shown[0] != shown[1] and got.startswith(shown[0]) and lookalike.startswith(shown[1]), why
        assert len(shown[0]) >= len("sha256r64m:") + 16
        with pytest.raises(store.SampleError) as e:
            reader.check_entry(w.path, entry)
        assert shown[0] in str(e.value) and shown[1] in str(e.value) and "damaged" in str(e.value)
    entry["sha256"] = w.sha256
    with open(w.path, "ab") as f:
        f.write(b"xx")
    assert "2 bytes over (grew" in store.verify_entry(tmp_path, entry)
    with pytest.raises(store.SampleError, match="grew"):
        reader.check_entry(w.path, entry)
    os.truncate(w.path, w.nbytes - 3)
    assert "3 bytes short (truncated?)" in store.verify_entry(tmp_path, entry)
    assert files.digests_apart("abcd" * 16, "sha256r64m:" + "abcd" * 16) == ("abcd" * 4, "sha256r64m:" + "abcd" * 4)


def test_a_failed_range_write_fails_the_sample_only_after_every_range_task_ended(tmp_path, monkeypatch):
    """A range task still writing into a descriptor the caller closed (and the kernel gave to another
    file) would write hidden states into the wrong file: the caller waits for all of them first."""
    real, calls, lock = store.pwrite_all, {"started": 0, "ended": 0}, threading.Lock()

    def pwrite_all(fd, data, offset):
        with lock:
            calls["started"] += 1
        try:
            if offset == 0:
                raise OSError(28, "No space left on device")
            time.sleep(0.2)  # the other ranges are still writing when the first one fails
            return real(fd, data, offset)
        finally:
            with lock:
                calls["ended"] += 1

    monkeypatch.setattr(store, "pwrite_all", pwrite_all)
    with pytest.raises(OSError, match="No space"):
        store.write_temp(tmp_path, "k", big_tensors(5000), {"key": "k"}, ranges=True)
    assert calls["started"] >= 3 and calls["ended"] == calls["started"], calls  # three ranges, each waited for
    assert not list((tmp_path / store.TMPDIR).iterdir()), "the temporary file is removed"


def test_the_capture_writer_records_ranged_digests_that_the_reader_verifies(tmp_path):
    w = Writer(str(tmp_path), ["layer.1"], {"format": store.FORMAT, "planes": "layer.1", "hidden_size": "16"},
               workers=2)
    ids = torch.arange(10, dtype=torch.int64)
    plane = ids[:, None].expand(10, 16).to(torch.bfloat16).contiguous()
    w.submit(PassRecord(ids[:4], [plane[:4]], [4], [0], [4], ["whole"]))
    w.submit(PassRecord(ids[4:8], [plane[4:8]], [4], [0], [6], ["chunked"]))
    w.submit(PassRecord(ids[8:], [plane[8:]], [2], [4], [6], ["chunked"]))
    w.close()
    entries = store.manifest_records(tmp_path)
    assert [e["tokens"] for e in entries] == [4, 6]
    assert all(e["sha256"].startswith(files.RANGED) for e in entries), entries
    assert all(files.file_ranged(Path(tmp_path) / e["file"])[1] == e["sha256"] for e in entries)
    assert reader.check_dir(tmp_path, deep=True).clean

