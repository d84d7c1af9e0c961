"""Nothing damaged is ever accepted: the staging-slot race, full disks, torn lines, truncated patches.

The full-disk cases run against a small tmpfs mounted for the test (root only; the mount
is removed by the test itself).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from conftest import extract_site
from hs_patch.engine.releases import TARGET
from hs_patch.host.patching import patcher
from hs_patch.samples import files, reader, store
from hs_patch.server import config, hook
from lab.passes import Batch, play

H = 16


def _pass(h: hook.CaptureHook, lens: list[int], value: float, start: int = 0) -> None:
    n = sum(lens)
    zeros = torch.zeros(n, H, dtype=torch.bfloat16)
    play(h, Batch(lens), torch.arange(start, start + n), {0: torch.full((n, H), value, dtype=torch.bfloat16)},
         zeros, zeros)


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "hs-test", str(path)], check=True)
    try:
        yield path
    finally:  # lazy: a test that failed may still hold a file open there
        subprocess.run(["umount", "--lazy", str(path)], check=True)


def fill(path: Path, nbytes: int) -> None:
    """Write up to ``nbytes`` of filler, stopping quietly when the filesystem is full."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while nbytes > 0:
            nbytes -= os.write(fd, b"\0" * min(nbytes, 4096))
    except OSError:
        pass
    finally:
        os.close(fd)


def test_a_staging_slot_is_not_reused_while_a_job_of_its_pass_still_reads_it(tmp_path, monkeypatch):
    """One write of a pass fails at once (disk full) while another is still writing from the
    slot; the next forward pass waits for that slot. The slot must come back only after the
    slow write ended, and no sample of the failed pass may be in the manifest."""
    h = hook.CaptureHook(config.CaptureConfig(enabled=True, directory=str(tmp_path), layers=(0,), final="none",
                                              slots=1, slot_tokens=64, writers=2), hidden_size=H, metadata={})
    real = store.write_temp
    slow_started, slow_go, slow_done = threading.Event(), threading.Event(), threading.Event()

    def write_temp(directory, key, tensors, meta, **kw):
        if meta["num_tokens"] == "3":
            raise OSError(28, "No space left on device")
        slow_started.set()
        slow_go.wait(10)
        try:
            return real(directory, key, tensors, meta, **kw)
        finally:
            slow_done.set()

    monkeypatch.setattr(store, "write_temp", write_temp)
    _pass(h, [3, 5], 1.0)
    assert slow_started.wait(10)
    acquired = threading.Event()
    done_when_acquired = []

    def next_pass():
        slot = h._acquire()  # what the next forward pass does first
        done_when_acquired.append(slow_done.is_set())
        acquired.set()
        h._free.put(slot)

    t = threading.Thread(target=next_pass)
    t.start()
    time.sleep(0.3)
    assert not acquired.is_set(), "the slot came back while a write still read it"
    slow_go.set()
    t.join(10)
    assert done_when_acquired == [True]
    deadline = time.monotonic() + 10
    while h.writer.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="the sample writer failed"):
        _pass(h, [2], 2.0)
    with pytest.raises(RuntimeError, match="writer had failed"):
        h.close()
    assert store.read_manifest(tmp_path) == {}, "a failed pass leaves nothing in any manifest"
    assert not list(tmp_path.glob("*.safetensors")) and not list((tmp_path / store.TMPDIR).iterdir())


def test_a_full_dump_filesystem_stops_capture_with_every_listed_sample_intact(tmp_path):
    with small_tmpfs(tmp_path / "shm", "256k") as shm:
        h = hook.CaptureHook(config.CaptureConfig(enabled=True, directory=str(shm), layers=(0,), final="pre",
                                                  slots=2, slot_tokens=64), hidden_size=H, metadata={})
        for i in range(200):
            try:
                play(h, Batch([40]), torch.arange(i * 40, i * 40 + 40),
                     {0: torch.full((40, H), float(i), dtype=torch.bfloat16)},
                     torch.full((40, H), -float(i), dtype=torch.bfloat16), torch.zeros(40, H, dtype=torch.bfloat16))
            except RuntimeError as e:
                assert "the sample writer failed" in str(e)
                break
            time.sleep(0.01)
        else:
            pytest.fail("256 KiB never filled")
        with contextlib.suppress(RuntimeError):
            h.close()
        files.read_jsonl(shm / store.MANIFEST)  # strict: no torn line anywhere
        rep = reader.check_dir(shm)
        assert rep.ok and not rep.bad and not rep.missing, rep
        for key in rep.ok:  # and each is exactly the pass it claims to be
            s = reader.read_sample(store.sample_path(shm, key))
            i = int(s.input_ids[0]) // 40
            assert torch.equal(s.plane("layer.0"), torch.full((40, H), float(i), dtype=torch.bfloat16))


def test_an_append_on_a_full_disk_leaves_no_torn_line(tmp_path):
    with small_tmpfs(tmp_path / "shm", "64k") as shm:
        log = files.JsonLog(shm / "log.jsonl")
        log.append({"n": 0})
        fill(shm / "filler", 1 << 30)
        before = (shm / "log.jsonl").read_bytes()
        with pytest.raises(OSError):
            for n in range(1, 10000):
                log.append({"n": n, "pad": "y" * 200})
        assert files.read_jsonl(shm / "log.jsonl")  # parses strictly
        assert (shm / "log.jsonl").read_bytes().startswith(before)
        assert (shm / "log.jsonl").read_bytes().endswith(b"\n")
        with pytest.raises(OSError):
            files.write_text_atomic(shm / "status.json", "z" * 100_000)
        assert not [p for p in shm.iterdir() if p.name.endswith(".tmp")]


def test_a_torn_last_line_from_a_killed_writer_is_cut_before_the_next_append(tmp_path):
    path = tmp_path / "manifest.jsonl"
    log = files.JsonLog(path)
    log.append({"op": "add", "key": "a"})
    with open(path, "ab") as f:
        f.write(b'{"op": "add", "key": "tor')  # SIGKILL mid-line
    log.append({"op": "add", "key": "b"})
    assert [r["key"] for r in files.read_jsonl(path)] == ["a", "b"]


def test_short_writes_are_completed_and_a_zero_write_raises(tmp_path, monkeypatch):
    real = os.write
    monkeypatch.setattr(files.os, "write", lambda fd, data: real(fd, bytes(memoryview(data)[:7])))
    files.write_text_atomic(tmp_path / "x.json", json.dumps({"k": "v" * 100}))
    assert json.loads((tmp_path / "x.json").read_text()) == {"k": "v" * 100}
    monkeypatch.setattr(files.os, "write", lambda fd, data: 0)
    with pytest.raises(OSError, match="wrote nothing"):
        files.write_text_atomic(tmp_path / "y.json", "{}")
    assert not (tmp_path / "y.json").exists() and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("free_kib", [0, 4, 16, 64, 128, 200, 256, 300, 400])
def test_hs_patch_apply_on_a_nearly_full_disk_never_reports_a_truncated_file(free_kib, release_sources, tmp_path):
    """deepseek_v2.py is ~300 KB: at every free-space size, apply either patches fully or
    fails leaving the pristine file untouched; never 'patched' for a short file."""
    with small_tmpfs(tmp_path / "shm", "8m") as shm:
        site = extract_site("0.5.9", shm / "site")
        target = site / TARGET
        pristine = target.read_bytes()
        st = os.statvfs(shm)
        fill(shm / "pad", st.f_bavail * st.f_frsize - free_kib * 1024)
        try:
            res = patcher.apply(site)
        except OSError:
            assert target.read_bytes() == pristine
            assert not list(target.parent.glob(".*.tmp"))
            return
        assert res["changed"] and patcher.verify(site)["state"] == "patched"
