"""The writer runs several passes' writes at once and still settles them in pass order.

Under chunked prefill a pass is usually one request: writing passes one after another
capped capture at one core's sha256 (the GPU proof measured 0.80 of pristine SGLang with
prompts chunked at 2048). These tests hold one pass's write with a gate and show what
runs meanwhile and what must wait: a later pass writes, but nothing of it is published
before the earlier pass; a chunked prompt's parts may be written out of order but it is
finished only after all of them; and a partial file is closed and removed only when no
running write can still touch it (an fd closed under a running pwrite could be reused by
another file).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

import torch

from hs_patch.samples import reader, store
from hs_patch.server.inplace import InPlaceSample
from hs_patch.server.writer import PassRecord, Writer

H = 16
PLANES = ["layer.1", "final.pre_norm"]
META = {"format": store.FORMAT, "planes": ",".join(PLANES), "hidden_size": str(H)}


def rows(ids: list[int]) -> list[torch.Tensor]:
    """Each token's rows hold its id (plane k: id + 1000 k), so misplaced rows show."""
    t = torch.tensor(ids, dtype=torch.float32)[:, None].expand(len(ids), H)
    return [(t + 1000 * k).to(torch.bfloat16).contiguous() for k in range(len(PLANES))]


def record(ids: list[int], seq_lens: list[int], prefix_lens: list[int], full: list[int],
           rids: list[str]) -> PassRecord:
    return PassRecord(torch.tensor(ids, dtype=torch.int64), rows(ids), seq_lens, prefix_lens, full, rids)


def until(cond, what: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class GatedPut:
    """Holds the in-place write of rows starting at ``hold_start`` until ``go`` is set; records errors."""

    def __init__(self, w: Writer, hold_start: int):
        self.real, self.hold_start = w._put, hold_start
        self.go, self.held, self.started, self.errors = threading.Event(), threading.Event(), [], []
        w._put = self

    def __call__(self, sample, start, slices):
        self.started.append(start)
        if start == self.hold_start:
            self.held.set()
            assert self.go.wait(10)
        try:
            return self.real(sample, start, slices)
        except BaseException as e:
            self.errors.append(e)
            raise


def tmp_files(d: Path) -> list[Path]:
    return list((d / store.TMPDIR).iterdir()) if (d / store.TMPDIR).exists() else []


def test_a_later_pass_writes_while_an_earlier_one_is_held_and_is_published_after_it(tmp_path, monkeypatch):
    w = Writer(str(tmp_path), PLANES, META, workers=2)
    real, go, started, written = store.write_temp, threading.Event(), [], []

    def write_temp(directory, key, tensors, meta, **kw):
        started.append(meta["num_tokens"])
        if meta["num_tokens"] == "2":
            assert go.wait(10)
        out = real(directory, key, tensors, meta, **kw)
        written.append(meta["num_tokens"])
        return out

    monkeypatch.setattr(store, "write_temp", write_temp)
    w.submit(record([1, 2], [2], [0], [2], ["a"]))
    w.submit(record([3, 4, 5], [3], [0], [3], ["b"]))
    until(lambda: "3" in written, "the second pass's write to end while the first is held")
    until(lambda: "2" in started, "the first pass's write to be held")
    assert "2" not in written
    time.sleep(0.2)
    assert store.read_manifest(tmp_path) == {}, "nothing of a later pass is published before an earlier one"
    go.set()
    w.close()
    assert [r["tokens"] for r in store.manifest_records(tmp_path)] == [2, 3]  # pass order
    assert reader.check_dir(tmp_path).clean and not tmp_files(tmp_path)


def test_a_chunked_prompt_whose_parts_are_written_out_of_order_is_finished_after_all_of_them(tmp_path):
    w = Writer(str(tmp_path), PLANES, META, workers=2)
    gate = GatedPut(w, hold_start=0)
    w.submit(record([11, 12, 13], [3], [0], [5], ["x"]))   # first chunk of a 5-token prompt: held
    w.submit(record([14, 15], [2], [3], [5], ["x"]))        # its last chunk
    assert gate.held.wait(10)
    until(lambda: 3 in gate.started, "the last chunk's write to run while the first is held")
    time.sleep(0.2)
    assert store.read_manifest(tmp_path) == {} and w.stats.merged == 0
    gate.go.set()
    w.close()
    (key,) = store.read_manifest(tmp_path)
    s = reader.read_sample(store.sample_path(tmp_path, key))
    assert s.input_ids.tolist() == [11, 12, 13, 14, 15] and int(s.metadata["parts"]) == 2
    for name, want in zip(PLANES, rows([11, 12, 13, 14, 15])):
        assert torch.equal(s.plane(name), want), name
    assert w.stats.merged == 1 and not gate.errors and reader.check_dir(tmp_path).clean


def test_a_failed_pass_removes_a_partial_file_only_after_a_later_pass_stopped_writing_into_it(tmp_path, monkeypatch):
    w = Writer(str(tmp_path), PLANES, META, workers=3)
    gate = GatedPut(w, hold_start=3)
    real = store.write_temp

    def write_temp(directory, key, tensors, meta, **kw):
        if meta["num_tokens"] == "2":
            assert gate.held.wait(10)  # fails while pass 2 writes into x
            raise OSError(28, "No space left on device")
        return real(directory, key, tensors, meta, **kw)

    monkeypatch.setattr(store, "write_temp", write_temp)
    # pass 1: a whole prompt whose write fails, and the first chunk of x; pass 2: x's next chunk (held)
    w.submit(record([1, 2, 21, 22, 23], [2, 3], [0, 0], [2, 6], ["a", "x"]))
    w.submit(record([24, 25, 26], [3], [3], [6], ["x"]))
    assert gate.held.wait(10)
    until(lambda: w.error is not None, "the failure to stop the writer")
    time.sleep(0.2)
    assert len(tmp_files(tmp_path)) == 1, "x's partial file is still being written: not closed under the write"
    gate.go.set()
    with pytest.raises(RuntimeError, match="writer had failed"):
        w.close()
    assert not gate.errors, "no write ran into a closed file"
    assert store.read_manifest(tmp_path) == {} and not list(tmp_path.glob("*.safetensors"))
    assert not tmp_files(tmp_path) and w.stats.errors == 1


def test_a_lost_chunk_is_removed_only_after_its_running_write_ended(tmp_path):
    w = Writer(str(tmp_path), PLANES, META, workers=2)
    gate = GatedPut(w, hold_start=0)
    w.submit(record([31, 32, 33], [3], [0], [6], ["x"]))  # x's first chunk, held
    w.submit(record([41, 42], [2], [0], [2], ["y"]))      # x does not continue: its next chunk is lost
    assert gate.held.wait(10)
    until(lambda: len(tmp_files(tmp_path)) == 2, "y's write")
    time.sleep(0.2)
    assert store.read_manifest(tmp_path) == {}
    gate.go.set()
    w.close()
    assert not gate.errors
    assert [r["tokens"] for r in store.manifest_records(tmp_path)] == [2]
    errors = store.read_jsonl(tmp_path / store.ERRORS)
    assert [e["error"] for e in errors] == ["chunk_lost"] and not tmp_files(tmp_path)


def test_chunks_of_one_prompt_written_by_many_threads_at_once_are_all_counted(tmp_path):
    """The in-place file counts the bytes its chunks wrote; with passes writing at once that count
    is updated from several threads (an unlocked += lost updates: "a chunk is missing")."""
    from concurrent.futures import ThreadPoolExecutor

    row = torch.ones(1, H, dtype=torch.bfloat16)
    with ThreadPoolExecutor(8) as pool:
        for rep in range(40):
            s = InPlaceSample(tmp_path, f"t{rep}", PLANES, 256, H, "BF16")
            list(pool.map(lambda r: [s.put(k, r, store.raw_bytes("x", row)) for k in range(len(PLANES))], range(256)))
            assert s.written == len(PLANES) * 256 * H * 2
            s.abandon()


def test_the_status_file_is_current_as_soon_as_the_writer_is_idle(tmp_path):
    """hook_status.json was rewritten at most every 2 s, and only when a pass came: after a burst it kept
    a count from the middle of it until the next request (fab status, the GPU sweep's per-row waits read
    it). Now the writer rewrites it when its last pass settled and its last chunked prompt is finished."""
    w = Writer(str(tmp_path), PLANES, META, workers=2)
    status = tmp_path / "hook_status.json"
    w.submit(record([1, 2], [2], [0], [2], ["a"]))
    w.submit(record([11, 12, 13], [3], [0], [5], ["x"]))   # a chunked prompt: finished after its last pass
    w.submit(record([14, 15], [2], [3], [5], ["x"]))

    def current() -> bool:
        doc = json.loads(status.read_text())
        return doc["samples"] == 2 and doc["merged"] == 1 and doc["queued"] == 0 and doc["passes"] == 3

    until(current, "hook_status.json to show every sample written, with the writer idle", seconds=1.5)
    w.close()


def test_the_status_file_shows_where_the_last_passs_time_went(tmp_path):
    """The GPU sweep splits a burst's tail (last response to last sample listed) with it: the last pass's
    copies landing, its writes and hash, its publishing (issue #22)."""
    w = Writer(str(tmp_path), PLANES, META, workers=2)
    w.submit(record([11, 12, 13], [3], [0], [5], ["x"]))
    last = record([14, 15, 1, 2, 3], [2, 3], [3, 0], [5, 3], ["x", "a"])
    last.wait = lambda: time.sleep(0.2)  # copies that land 0.2 s after the hook handed the pass over
    w.submit(last)
    w.close()
    doc = json.loads((tmp_path / "hook_status.json").read_text())["last_pass"]
    assert doc["queued"] == round(last.queued, 3) and doc["tokens"] == 5 and doc["samples"] == 2
    assert 0.2 <= doc["landed_s"] < 5 and 0 <= doc["written_s"] < 5 and 0 <= doc["published_s"] < 5


def test_a_chunked_prompt_is_finished_while_its_last_pass_still_writes_and_published_when_that_pass_settles(
        tmp_path, monkeypatch):
    """Its finishing (header, one hashing read of the whole file) waited for the whole pass to settle, then
    ran alone: on the GPU the last sample of a burst came 0.55-0.6 s after the last response (issue #22).
    It now runs in the job that writes the last chunk, beside the pass's other writes; the sample is still
    published only when the pass settles, in pass order."""
    w = Writer(str(tmp_path), PLANES, META, workers=4)
    real_write, real_complete = store.write_temp, w.contents.complete
    go, completed = threading.Event(), threading.Event()

    def write_temp(directory, key, tensors, meta, **kw):
        if meta["num_tokens"] == "2":  # the whole sample in the chunked prompt's last pass: held
            assert go.wait(10)
        return real_write(directory, key, tensors, meta, **kw)

    def complete(part):
        out = real_complete(part)
        completed.set()
        return out

    monkeypatch.setattr(store, "write_temp", write_temp)
    w.contents.complete = complete
    w.submit(record([11, 12, 13], [3], [0], [5], ["x"]))                 # first chunk of a 5-token prompt
    w.submit(record([14, 15, 1, 2], [2, 2], [3, 0], [5, 2], ["x", "a"]))  # its last chunk + a whole sample
    assert completed.wait(10), "the chunked prompt was not finished while its pass's other write ran"
    time.sleep(0.2)
    assert store.read_manifest(tmp_path) == {}, "published before its pass settled"
    go.set()
    w.close()
    assert [(r["tokens"], r["parts"]) for r in store.manifest_records(tmp_path)] == [(5, 2), (2, 1)]
    assert w.stats.merged == 1 and reader.check_dir(tmp_path).clean and not tmp_files(tmp_path)


def test_the_staging_buffer_of_a_prompts_last_chunk_is_given_back_before_its_file_is_hashed(tmp_path):
    """The finishing job reads the file, not the staging buffer: the buffer goes back once the rows are
    written, so the forward pass never waits on a hash."""
    w = Writer(str(tmp_path), PLANES, META, workers=2)
    real_complete, go, released = w.contents.complete, threading.Event(), threading.Event()

    def complete(part):
        assert go.wait(10)
        return real_complete(part)

    w.contents.complete = complete
    w.submit(record([11, 12, 13], [3], [0], [5], ["x"]))
    last = record([14, 15], [2], [3], [5], ["x"])
    last.release = released.set
    w.submit(last)
    assert released.wait(10), "the buffer was held while the file was hashed"
    go.set()
    w.close()
    assert [r["tokens"] for r in store.manifest_records(tmp_path)] == [5] and reader.check_dir(tmp_path).clean
