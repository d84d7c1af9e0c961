"""The capture path survives its own crashes (issue #25, part 2), with the real hook and writer.

- a request captured twice (retried while the server still held it): the first file stays, the
  later write is not moved over it, and what the driver adopts is exactly what its manifest
  line says (sha256 included);
- a SIGKILLed server's leftovers (a partial whole sample, a chunked prompt's open file, a sample
  moved into place but never listed) are removed when the next server starts, and counted;
- a failed manifest append removes the file it would have listed;
- any exception in the writer's coordinator thread stops capture loudly with its cause, at once;
- every file and directory the server creates is owner-only under umask 022.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from hs_patch.host.driver.adopt import adopt
from hs_patch.host.driver.capture_dir import CaptureWatcher
from hs_patch.samples import files, reader, store
from hs_patch.samples.intent import write as write_intent
from hs_patch.server import config, hook, writer
from hs_patch.server.status import STATUS_FILE
from lab.passes import Batch, play

H = 16
ROOT = Path(__file__).resolve().parents[2]


def make_hook(d: Path, **kw) -> hook.CaptureHook:
    cfg = config.CaptureConfig(enabled=True, directory=str(d), layers=(0,), final="both", slots=kw.pop("slots", 2),
                               slot_tokens=64, **kw)
    return hook.CaptureHook(cfg, hidden_size=H, metadata={})


def states(n: int, seed: float) -> tuple[dict[int, torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(int(seed * 1000))
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    pre = (x.float() * 3).to(torch.bfloat16)
    return {0: x}, pre, (pre.float() / 3).to(torch.bfloat16)


def test_a_request_captured_twice_keeps_the_first_file_and_adopt_records_its_own_sha256(tmp_path):
    """The driver's client retried while the stalled server still held the first attempt: both
    attempts are prefilled (the second a few ms later, other bits in its header). Before #25 the
    second replaced the first under the first's manifest line; the run ended 'complete' with a
    sample whose manifest sha256 was not its file's."""
    cap, samples = tmp_path / "capture", tmp_path / "samples"
    samples.mkdir()
    ids = torch.arange(10, 30)
    key = store.sample_key(ids)
    write_intent(cap, key, [1] * 20, {"sample_id": "d.jsonl:1", "run": "r"})
    watcher = CaptureWatcher(cap)
    h = make_hook(cap)
    try:
        for attempt in range(3):
            layers, pre, post = states(20, 0.5 + attempt)  # each attempt's states differ in the last bits
            play(h, Batch([20], rids=[f"hs-r-{attempt}"]), ids, layers, pre, post)
        h.writer.close()
        watcher.read_new()
        entry = watcher.wait(key, 0, 5)
        written = adopt(watcher, entry, samples, sample_id="d.jsonl:1", run="r")
    finally:
        watcher.close()
        h.close()
    adds = [r for r in store.manifest_records(cap) if r.get("op") == "add"]
    assert len(adds) == 1, "the later attempts are not published"
    assert store.verify_entry(samples, store.read_manifest(samples)[key]) is None
    assert written.sha256 == files.file_digest(samples / f"{key}.safetensors", written.sha256)[1]
    dup = [e for e in store.read_jsonl(cap / store.ERRORS) if e["error"] == "duplicate"]
    assert len(dup) == 2 and all(e["key"] == key for e in dup)
    assert json.loads((cap / STATUS_FILE).read_text())["duplicates"] == 2
    assert not list((cap / store.TMPDIR).iterdir())


KILLED_SERVER = textwrap.dedent("""
    import os, sys, threading, time, torch
    from pathlib import Path
    sys.path[:0] = [sys.argv[2], sys.argv[3]]
    from hs_patch.samples import store
    from hs_patch.server import config, hook
    from lab.passes import Batch, play
    d = Path(sys.argv[1])
    h = hook.CaptureHook(config.CaptureConfig(enabled=True, directory=str(d), layers=(0,), final="both", slots=3,
                                              slot_tokens=64), hidden_size=16, metadata={})
    x = lambda n, v: torch.full((n, 16), v, dtype=torch.bfloat16)
    play(h, Batch([8]), torch.arange(8), {0: x(8, 1.0)}, x(8, 2.0), x(8, 0.5))   # listed: kept
    while not store.read_manifest(d):
        time.sleep(0.01)
    moved = threading.Event()
    def add(self, w, **extra):  # killed between the move into place and its manifest line
        moved.set()
        time.sleep(600)
    store.Manifest.add = add
    # one pass: a whole request (moved, never listed) and the first chunk of a longer one (its open file)
    play(h, Batch([5, 40], full=[5, 64]), torch.arange(100, 145), {0: x(45, 3.0)}, x(45, 4.0), x(45, 1.0))
    (d / ".tmp" / "whole.tmp").write_bytes(b"x" * 4096)  # a whole sample cut mid-write
    while not any(p.name.startswith("open-") for p in (d / ".tmp").iterdir()):
        time.sleep(0.01)
    assert moved.wait(30)
    print("ready", flush=True)
    time.sleep(600)
""")


def test_a_sigkilled_servers_leftovers_are_removed_and_counted_when_the_next_one_starts(tmp_path):
    """SGLang SIGKILLs its scheduler when the hook fails, so the writer's own clean-up never runs.
    On /dev/shm its leftovers are RAM that the driver's back-pressure counts."""
    d = tmp_path / "capture"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SERVER, str(d), str(ROOT), str(ROOT / "tests")],
                            stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while "ready" not in lines and time.monotonic() < deadline:
            lines.append(proc.stdout.readline().strip())
        assert "ready" in lines, lines
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    listed = store.read_manifest(d)
    files = sorted(p.name for p in d.glob("*.safetensors"))
    assert len(files) == 2 and len(listed) == 1, (files, listed)
    left = sum(p.stat().st_size for p in (d / store.TMPDIR).iterdir()) + \
        sum(p.stat().st_size for p in d.glob("*.safetensors") if p.stem not in listed)
    h = make_hook(d)  # the next server
    try:
        status = json.loads((d / STATUS_FILE).read_text())
    finally:
        h.close()
    assert not list((d / store.TMPDIR).iterdir())
    assert sorted(p.stem for p in d.glob("*.safetensors")) == sorted(listed), "the listed sample is kept"
    assert status["cleaned_at_start"] == {"partial_files": 2, "unlisted_samples": 1, "bytes": left}
    (rec,) = [e for e in store.read_jsonl(d / store.ERRORS) if e["error"] == "leftovers_removed"]
    assert rec["unlisted_samples"] == 1 and rec["keys"] == [store.sample_key(torch.arange(100, 105))]
    assert reader.check_dir(d).clean


def test_a_failed_manifest_append_leaves_no_sample_in_place(tmp_path, monkeypatch):
    d = tmp_path / "capture"
    h = make_hook(d)

    def full(self, w, **extra):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store.Manifest, "add", full)
    try:
        play(h, Batch([6]), torch.arange(6), *states(6, 1.0))
        deadline = time.monotonic() + 10
        while h.writer.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        with pytest.raises(RuntimeError, match="writer had failed, so passes after its failure were not written"):
            h.close()  # it tells the truth (issue #33): before, it returned normally
    assert isinstance(h.writer.error, OSError)
    assert not list(d.glob("*.safetensors")), "a sample in place that no manifest line describes"


def test_an_exception_in_the_writers_coordinator_stops_capture_at_once_with_its_cause(tmp_path, monkeypatch):
    """No trigger is known; defence in depth. Before #25 the thread ended silently: the forward
    pass then waited for a staging buffer until HS_CAPTURE_STALL_SECONDS and failed blaming the
    disk, hook_status.json showed no error, and the passes it had accepted were lost unsaid."""
    d = tmp_path / "capture"
    h = make_hook(d, slots=1, stall_seconds=30)

    def settle(self, p):
        raise KeyError("a bug in the coordinator")

    monkeypatch.setattr(writer.Writer, "_settle", settle)
    try:
        play(h, Batch([6]), torch.arange(6), *states(6, 1.0))  # takes the only staging buffer
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="coordinator thread failed .KeyError: 'a bug in the coordinator'"):
            for i in range(100):  # the next passes: at once, not after the stall limit
                play(h, Batch([6]), torch.arange(10 + i, 16 + i), *states(6, 2.0))
        assert time.monotonic() - t0 < 5
        def failed_records() -> list:
            return [e for e in store.read_jsonl(d / store.ERRORS) if e["error"] == "writer_failed"] \
                if (d / store.ERRORS).exists() else []

        deadline = time.monotonic() + 5  # the dying thread writes both right after it set the error, status first
        while time.monotonic() < deadline and not (
                json.loads((d / STATUS_FILE).read_text())["error"] and failed_records()):
            time.sleep(0.01)
        assert "a bug in the coordinator" in json.loads((d / STATUS_FILE).read_text())["error"]
        (rec,) = failed_records()
        assert "KeyError" in rec["why"]
        # the pass whose settling failed was lost: it is counted (issue #33: '0 prefill passes' was said)
        assert rec["passes_lost"] >= 1 and "prefill passes it had accepted are not written" in \
            json.loads((d / STATUS_FILE).read_text())["error"]
    finally:
        monkeypatch.undo()
        try:
            h.close(timeout=5)
        except RuntimeError:
            pass


def test_every_file_and_directory_the_server_creates_is_owner_only_under_umask_022(tmp_path):
    """Started outside the role's unit (by hand, a custom unit, the stand-in) the server had the
    capture dir 0755 and the hidden states, the manifest, hook_status.json 0644."""
    os.umask(0o022)  # the conftest fixture restores the test process's umask
    d = tmp_path / "new" / "capture"
    h = make_hook(d)
    try:
        play(h, Batch([6]), torch.arange(6), *states(6, 1.0))
        play(h, Batch([40], full=[50]), torch.arange(100, 140), *states(40, 2.0))  # an open chunked prompt
        deadline = time.monotonic() + 30  # the first sample published, the open prompt's file begun
        while time.monotonic() < deadline and not (any(d.glob("*.safetensors")) and any((d / store.TMPDIR).glob("*"))):
            time.sleep(0.05)
        created, loose = [tmp_path / "new"], []
        for p in (tmp_path / "new").rglob("*"):
            try:
                mode = p.stat().st_mode
            except FileNotFoundError:  # renamed by the writer meanwhile: its new name is listed too
                continue
            created.append(p)
            if mode & 0o077:
                loose.append(f"{p} {stat.filemode(mode)}")
    finally:
        h.close()
    assert not loose, loose
    assert any(p.suffix == ".safetensors" for p in created) and any(p.name == "hook_status.json" for p in created)
    assert any(p.parent.name == store.TMPDIR for p in created), "the open prompt's file was checked too"
