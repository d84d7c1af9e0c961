"""Sample store v1, the background writer, back-pressure, and the capture configuration."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hs_patch.samples import reader, store
from hs_patch.server import config, hook, checks as server_checks
from hs_patch.server.writer import PassRecord, Writer
from lab.passes import Batch, play
from lab.sample_files import flip_byte

H = 16


def planes_for(n: int, k: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, generator=g).to(torch.bfloat16) for _ in range(k)]


def write_one(directory: Path, ids: list[int], names=("layer.2", "final.pre_norm")) -> store.Written:
    t = torch.tensor(ids, dtype=torch.int64)
    key = store.sample_key(t)
    tensors = [store.tensor_bytes("input_ids", t)]
    tensors += [store.tensor_bytes(n, p) for n, p in zip(names, planes_for(len(ids), len(names)))]
    meta = {"format": store.FORMAT, "key": key, "num_tokens": str(len(ids)), "planes": ",".join(names),
            "hidden_size": str(H), "dtype": "bfloat16"}
    w = store.write_sample(directory, key, tensors, meta)
    store.Manifest(directory).add(w, tokens=len(ids))
    return w


def test_sample_round_trip_with_the_safetensors_library(tmp_path):
    w = write_one(tmp_path, [5, 6, 7, 8])
    loaded = load_file(str(w.path))  # the reference reader accepts our zero-copy writer's files
    assert set(loaded) == {"input_ids", "layer.2", "final.pre_norm"}
    s = reader.read_sample(w.path, entry=store.read_manifest(tmp_path)[w.key])
    assert s.input_ids.tolist() == [5, 6, 7, 8] and s.plane("layer.2").shape == (4, H)
    # zero waste: header + ids + planes, nothing else
    header = w.path.read_bytes()[:8]
    assert w.nbytes == w.path.stat().st_size == 8 + int.from_bytes(header, "little") + 4 * 8 + 2 * 4 * H * 2
    assert store.sample_key([5, 6, 7, 8]) == store.sample_key(torch.tensor([5, 6, 7, 8])) == w.key


def test_damage_is_detected(tmp_path):
    good = write_one(tmp_path, [1, 2, 3])
    flipped = write_one(tmp_path, [4, 5, 6])
    lost = write_one(tmp_path, [7, 8, 9])
    flip_byte(flipped.path, -1)
    lost.path.unlink()
    (tmp_path / "stray.safetensors").write_bytes(good.path.read_bytes())
    rep = reader.check_dir(tmp_path)
    assert rep.ok == [good.key] and list(rep.bad) == [flipped.key] and rep.missing == [lost.key]
    assert rep.unlisted == ["stray"] and not rep.clean
    assert "damaged" in rep.bad[flipped.key]
    # a file whose tokens do not hash to its name is refused even without a manifest
    renamed = tmp_path / "other"
    renamed.mkdir()
    (renamed / f"{'0' * 32}.safetensors").write_bytes(good.path.read_bytes())
    meta_ok = reader.read_sample(renamed / f"{'0' * 32}.safetensors")
    assert meta_ok.key == good.key  # the key lives in the header, the name is just a name


def test_manifest_folds_removals_and_survives_a_torn_last_line(tmp_path):
    a, b = write_one(tmp_path, [1]), write_one(tmp_path, [2])
    m = store.Manifest(tmp_path)
    m.remove(a.key, reason="test")
    with open(tmp_path / store.MANIFEST, "a") as f:
        f.write('{"op": "add", "key": "tor')  # crash in the middle of an append
    assert list(store.read_manifest(tmp_path)) == [b.key]
    (tmp_path / store.MANIFEST).write_text('garbage\n{"op": "remove", "key": "x"}\n')
    with pytest.raises(store.SampleError, match="unreadable manifest line"):
        store.read_manifest(tmp_path)


def test_check_dir_follows_entries_into_a_subdirectory(tmp_path):
    """A shipping destination lists files as samples/<key>.safetensors next to manifest.jsonl."""
    src = tmp_path / "src"
    a, b = write_one(src, [1, 2]), write_one(src, [3, 4])
    dest = tmp_path / "dest"
    (dest / "samples").mkdir(parents=True)
    m = store.Manifest(dest)
    for w in (a, b):
        (dest / "samples" / w.path.name).write_bytes(w.path.read_bytes())
        m.append({**store.read_manifest(src)[w.key], "file": f"samples/{w.path.name}"})
    (dest / "samples" / "stray.safetensors").write_bytes(b"x")
    rep = reader.check_dir(dest)
    assert rep.ok == sorted([a.key, b.key]) and rep.unlisted == ["stray"] and not rep.missing
    (dest / "samples" / a.path.name).unlink()
    assert reader.check_dir(dest, deep=False).missing == [a.key]


def test_a_failed_write_leaves_no_sample(tmp_path, monkeypatch):
    """Disk full in the middle of a file: no sample appears, the temp file is removed."""
    real = store.os.write
    calls = []

    def write(fd, data):
        calls.append(1)
        if len(calls) > 2:
            raise OSError(28, "No space left on device")
        return real(fd, bytes(memoryview(data)[:100]))  # short writes first

    monkeypatch.setattr(store.os, "write", write)
    with pytest.raises(OSError, match="No space"):
        write_one(tmp_path, list(range(50)))
    assert not list(tmp_path.glob("*.safetensors")) and not list((tmp_path / store.TMPDIR).iterdir())
    monkeypatch.setattr(store.os, "write", real)
    bad = store.TensorBytes("layer.0", "BF16", (2, H), [memoryview(bytearray(10))])
    with pytest.raises(store.SampleError, match="bytes given"):
        store.write_sample(tmp_path, "k", [bad], {})


def record(ids: list[int], seq_lens, prefix_lens, rids=None, k: int = 2, full=None, **kw) -> PassRecord:
    t = torch.tensor(ids, dtype=torch.int64)
    full = full or [p + n for p, n in zip(prefix_lens, seq_lens)]
    return PassRecord(t, planes_for(len(ids), k), seq_lens, prefix_lens, full, rids, **kw)


def test_writer_chains_chunks_by_request_id_not_position(tmp_path):
    """With request ids, a continuation only joins the open request with the same id."""
    w = Writer(str(tmp_path), ["layer.1", "layer.2"], {"format": store.FORMAT, "planes": "layer.1,layer.2",
                                                      "hidden_size": str(H)})
    w.submit(record([1, 2, 3, 4, 5], [2, 3], [0, 0], rids=["x", "y"], full=[2, 5]))  # y cut after 3 of 5
    w.submit(record([6, 7], [2], [3], rids=["z"], full=[5]))          # prefix 3 but another request
    w.submit(record([8, 9], [2], [3], rids=["y"], full=[5]))          # y's next chunk... after z: y was lost
    w.close()
    keys = set(store.read_manifest(tmp_path))
    assert keys == {store.sample_key([1, 2])}, "a cut prompt is never a sample until its last chunk is in"
    assert w.stats.merged == 0
    errors = [json.loads(e) for e in (tmp_path / store.ERRORS).read_text().splitlines()]
    assert [(e["error"], e["rid"]) for e in errors] == [("partial_prefill", "z"), ("chunk_lost", "y"),
                                                         ("partial_prefill", "y")]
    assert not list((tmp_path / store.TMPDIR).iterdir()), "the lost prompt's partial file is removed"


def test_writer_failure_stops_capture_loudly(tmp_path):
    h = hook.CaptureHook(config.CaptureConfig(enabled=True, slot_tokens=64, directory=str(tmp_path / "d"), layers=(0,),
                                              final="none", slots=1), hidden_size=H, metadata={})
    (tmp_path / "d" / store.TMPDIR).write_text("not a directory")  # every write now fails
    zeros = torch.zeros(3, H, dtype=torch.bfloat16)
    play(h, Batch([3]), torch.tensor([1, 2, 3]), {0: zeros}, zeros, zeros)
    deadline = time.monotonic() + 10
    while h.writer.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="the sample writer failed"):
        h.begin(Batch([3]), torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError, match="writer had failed"):
        h.writer.close()
    status = json.loads((tmp_path / "d" / "hook_status.json").read_text())
    assert status["error"] and status["errors"] == 1


def ones(n: int) -> tuple[dict[int, torch.Tensor], torch.Tensor, torch.Tensor]:
    x = torch.ones(n, H, dtype=torch.bfloat16)
    return {0: x}, x, x


def test_back_pressure_waits_then_fails_loudly(tmp_path):
    """One staging buffer and a blocked writer: the next pass waits, then the server fails
    loudly after HS_CAPTURE_STALL_SECONDS; nothing is dropped on the way."""
    gate = threading.Event()
    h = hook.CaptureHook(config.CaptureConfig(enabled=True, slot_tokens=64, directory=str(tmp_path), layers=(0,), final="none",
                                              slots=1, stall_seconds=5), hidden_size=H, metadata={})
    # 5 s: pass 2's slot comes back only once its write (an fsync on a disk the other test worker shares) ends
    real_start = h.writer._start
    h.writer._start = lambda rec: (gate.wait(20), real_start(rec))[1]
    for n in (2, 3):
        if n == 3:
            threading.Timer(0.2, gate.set).start()  # the writer catches up while pass 2 waits
        play(h, Batch([n]), torch.arange(n), *ones(n))
    assert h.waits == 1 and h.wait_seconds > 0.1
    deadline = time.monotonic() + 10
    while h._free.qsize() == 0 and time.monotonic() < deadline:  # pass 2 written
        time.sleep(0.01)
    gate.clear()
    play(h, Batch([4]), torch.arange(4), *ones(4))
    with pytest.raises(RuntimeError, match="HS_CAPTURE_STALL_SECONDS"):
        h.begin(Batch([5]), torch.arange(5))
    gate.set()
    h.close()
    assert len(store.read_manifest(tmp_path)) == 3


def test_back_pressure_warning_is_rate_limited(tmp_path, caplog):
    """Every wait is counted, but a busy writer does not flood the server log."""
    h = hook.CaptureHook(config.CaptureConfig(enabled=True, slot_tokens=64, directory=str(tmp_path), layers=(0,), final="none",
                                              slots=1), hidden_size=H, metadata={})
    real_start = h.writer._start
    h.writer._start = lambda rec: (time.sleep(0.2), real_start(rec))[1]
    with caplog.at_level("WARNING", logger="hs_patch"):
        for n in range(2, 7):
            play(h, Batch([n]), torch.arange(n), *ones(n))
    h.close()
    busy = [r for r in caplog.records if "staging buffers are busy" in r.getMessage()]
    assert h.waits >= 3 and len(busy) == 1  # 4 unless this thread was held up longer than a write
    assert len(store.read_manifest(tmp_path)) == 5


def test_config_from_env_explains_bad_values():
    assert config.from_env({}) == config.CaptureConfig()
    c = config.from_env({"HS_CAPTURE": "1", "HS_CAPTURE_LAYERS": "1, 5,9", "HS_CAPTURE_FINAL": "both"})
    assert c.enabled and c.layers == (1, 5, 9) and c.final == "both"
    for env, msg in [({"HS_CAPTURE": "yes"}, "use 1"), ({"HS_CAPTURE_LAYERS": "3,2"}, "ascending"),
                     ({"HS_CAPTURE_LAYERS": "a"}, "comma-separated"), ({"HS_CAPTURE_FINAL": "x"}, "choose one"),
                     ({"HS_CAPTURE_DIR": "rel/dir"}, "absolute"), ({"HS_CAPTURE_SLOTS": "0"}, ">= 1"),
                     ({"HS_CAPTURE_STALL_SECONDS": "-1"}, "> 0")]:
        with pytest.raises(config.ConfigError, match=msg):
            config.from_env(env)


@pytest.mark.parametrize("raw,layers", [("1 2", (1, 2)), ("1,2", (1, 2)), (" 2, 30 ,58\t60 ", (2, 30, 58, 60)),
                                        ("7", (7,))])
def test_capture_layers_are_separated_by_commas_or_whitespace(raw, layers):
    assert config.parse_layers(raw) == layers
    with pytest.raises(config.ConfigError, match="ascending"):
        config.parse_layers("2 1")


def test_server_refusals_name_the_flag():
    ok = {"pp_size": 1, "radix_cache": False, "prefill_graph": "disabled", "moe_a2a_backend": "none"}
    assert server_checks.refusals(ok) == []
    for bad, flag in [({"dp_attention": True}, "--enable-dp-attention"), ({"mixed_chunk": True}, "--enable-mixed-chunk"),
                      ({"two_batch_overlap": True}, "--enable-two-batch-overlap"),
                      ({"moe_a2a_backend": "deepep"}, "--moe-a2a-backend none"),
                      ({"input_scattered": True}, "--enable-attn-tp-input-scattered"),
                      ({"prefill_graph": "piecewise"}, "--enable-piecewise-cuda-graph")]:
        (msg,) = server_checks.refusals({**ok, **bad})
        assert flag in msg
