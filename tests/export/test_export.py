"""hs-extract export: every tensor the trainers' OWN readers load equals the source, bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hs_patch.host.export import layout
from hs_patch.host.export.run import export
from hs_patch.host.export.spec import ExportRefused, ExportSpec
from hs_patch.samples import reader, store
from lab.sample_files import flip_byte, write_finished, write_run
from lab.trainers import need

LAYERS = (2, 30, 58)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bits, so equality is bit equality (NaN == NaN, -0 != +0)."""
    t = t.contiguous()
    return t.view(torch.uint8) if t.element_size() == 1 else t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}
                                                                     [t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def sources(src: Path) -> dict[str, reader.Sample]:
    return {s.key: s for s in reader.iter_samples(src)}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    write_run(d, 7, shipped=True)   # a shipped destination: manifest.jsonl + samples/<key>.safetensors
    return d


# --------------------------------------------------------------------------- SpecForge


def specforge_samples(dst: Path) -> list[dict[str, torch.Tensor]]:
    """What SpecForge 0.2.0 trains on: its offline reader's refs, its store's file read, its normalizer."""
    need("specforge")
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore
    from specforge.runtime.data_plane.offline_reader import OfflineManifestReader

    refs = OfflineManifestReader(str(dst), validate_files=True).read()
    fs = LocalFeatureStore()
    out = []
    for ref in refs:
        raw, handle = fs.get(ref)
        out.append({"raw": raw, "norm": normalize_offline_sample(raw, max_len=4096), "path": ref.feature_store_uri})
        fs.release(handle)
    return out


def test_specforge_reads_every_sample_bit_for_bit(src, tmp_path):
    dst = tmp_path / "sf"
    s = export(src, dst, ExportSpec("specforge"), workers=2)
    assert s.state == "complete" and s.exported == 7 and not s.failed
    got = specforge_samples(dst)
    assert len(got) == 7
    want = sources(src)
    for g in got:
        raw = g["raw"]
        sample = want[Path(g["path"]).name[: -len(".ckpt")]]
        n = sample.input_ids.shape[0]
        assert same_bits(raw["input_ids"], sample.input_ids)
        assert same_bits(raw["loss_mask"], sample.tensors["loss_mask"].to(torch.int64))
        assert same_bits(raw["hidden_state"], sample.plane("final.post_norm").reshape(1, n, -1))
        aux = torch.cat([sample.plane(f"layer.{i}") for i in LAYERS], dim=-1).reshape(1, n, -1)
        assert same_bits(raw["aux_hidden_state"], aux)
        # SpecForge's own normalizer sees the same values (it only zeroes the last loss position)
        assert same_bits(g["norm"]["target"], raw["hidden_state"])
        assert same_bits(g["norm"]["hidden_state"], aux)
    info = json.loads((dst / "export.json").read_text())
    assert info["state"] == "complete" and info["final"] == "post_norm" and info["samples"] == 7


def test_specforge_refuses_what_it_cannot_hold(tmp_path):
    four = tmp_path / "four"
    write_run(four, 2, layers=(2, 30, 58, 60))
    with pytest.raises(ExportRefused, match="exactly 3 aux layers"):
        export(four, tmp_path / "a", ExportSpec("specforge"))
    assert export(four, tmp_path / "b", ExportSpec("specforge", layers=[30, 58, 60])).state == "complete"
    pre = tmp_path / "pre"
    write_run(pre, 2, final="pre")
    with pytest.raises(ExportRefused, match="AFTER the final norm"):
        export(pre, tmp_path / "c", ExportSpec("specforge"))
    with pytest.raises(ExportRefused, match="needs --model"):
        export(pre, tmp_path / "d", ExportSpec("specforge", derive_post_norm=True))
    with pytest.raises(ExportRefused, match="no fp8 reader"):
        export(four, tmp_path / "e", ExportSpec("specforge", layers=[2, 30, 58], fp8=True))


def test_derive_post_norm_uses_the_models_norm_weight(tmp_path, tiny_model_dir):
    from hs_patch.host.model_files import model_info, read_tensor, rms_norm

    pre = tmp_path / "pre"
    write_run(pre, 3, final="pre", layers=(1, 2, 3), hidden=64)
    dst = tmp_path / "sf"
    assert export(pre, dst, ExportSpec("specforge", derive_post_norm=True, model=str(tiny_model_dir))).state == \
        "complete"
    w, eps = read_tensor(tiny_model_dir, "model.norm.weight"), model_info(tiny_model_dir).rms_norm_eps
    want = sources(pre)
    for g in specforge_samples(dst):
        sample = want[Path(g["path"]).name[: -len(".ckpt")]]
        derived = rms_norm(sample.plane("final.pre_norm"), w, eps)
        assert same_bits(g["raw"]["hidden_state"][0], derived)



def test_a_model_of_another_width_is_refused_before_any_sample(tmp_path, tiny_model_dir):
    """--model names the served model: its norm weight derives the post-norm state and its depth
    the serving ids; another model's would fail every sample with a bare tensor-size error (and
    'run again' never helps), or record serving ids for the wrong depth."""
    pre = tmp_path / "pre"
    write_run(pre, 3, final="pre", layers=(1, 2, 3), hidden=128)   # the tiny model is 64 wide
    for spec in (ExportSpec("specforge", derive_post_norm=True, model=str(tiny_model_dir)),
                 ExportSpec("speculators", model=str(tiny_model_dir))):
        with pytest.raises(ExportRefused, match="has hidden_size 64, the samples 128"):
            export(pre, tmp_path / spec.format, spec)
        assert not (tmp_path / spec.format).exists()

def test_a_rerun_with_another_models_norm_weight_derives_again_or_is_refused(tmp_path, tiny_model_dir):
    """--derive-post-norm's bytes are the model's norm weight's: a re-run naming another model (a corrected
    --model) kept every file derived with the first one's and said complete."""
    import shutil

    from safetensors.torch import load_file, save_file

    pre = tmp_path / "pre"
    write_run(pre, 2, final="pre", layers=(1, 2, 3), hidden=64)
    other = tmp_path / "other-model"
    shutil.copytree(tiny_model_dir, other)
    for f in other.glob("*.safetensors"):
        t = load_file(f)
        if "model.norm.weight" in t:
            t["model.norm.weight"] = t["model.norm.weight"] * 2
            save_file(t, f, metadata={"format": "pt"})
    dst = tmp_path / "sf"
    assert export(pre, dst, ExportSpec("specforge", derive_post_norm=True, model=str(tiny_model_dir))).state == \
        "complete"
    assert export(pre, dst, ExportSpec("specforge", derive_post_norm=True, model=str(tiny_model_dir))).kept == 2
    with pytest.raises(ExportRefused, match="holds another export"):
        export(pre, dst, ExportSpec("specforge", derive_post_norm=True, model=str(other)))


def test_samples_of_another_model_or_width_in_one_source_fail_as_those_samples(tmp_path):
    """export.json records the first sample's model and width; a sample of another (runs of two models merged
    into one source) was exported beside them, the export complete: wrong states, or a crash in the trainer."""
    src = tmp_path / "run"
    write_run(src, 3, shipped=True)
    other = write_finished(src, [9, 8, 7, 6], shipped=True, meta={"model": "/models/other"}).key
    wider = write_finished(src, [5, 4, 3], shipped=True, hidden=48).key
    for fmt in ("specforge", "speculators"):
        summ = export(src, tmp_path / fmt, ExportSpec(fmt))
        assert summ.state == "incomplete" and summ.exported == 3 and sorted(summ.failed) == sorted([other, wider])
        assert "another model" in summ.failed[other] and "'/models/other'" in summ.failed[other]
        assert "hidden_size '48', not '32'" in summ.failed[wider]


# --------------------------------------------------------------------------- speculators


def speculators_rows(dst: Path, *, fp8: bool = False) -> list[dict[str, torch.Tensor]]:
    """speculators 0.9.0's ArrowDataset over the export (on_missing=raise: nothing generated)."""
    need("speculators")
    from hs_connectors import FP8Transfer
    from speculators.train.data import ArrowDataset

    transfer = FP8Transfer(dst / "hidden_states_fp8") if fp8 else None
    ds = ArrowDataset(max_len=4096, datapath=str(dst), transfer=transfer, on_missing="raise")
    rows = [ds[i] for i in range(len(ds))]
    assert all(isinstance(r, dict) for r in rows), "speculators found a row unavailable"
    return rows


def stacked(sample: reader.Sample) -> torch.Tensor:
    return torch.stack([sample.plane(f"layer.{i}") for i in LAYERS] + [sample.plane("final.pre_norm")], dim=1)


def test_speculators_reads_every_row_bit_for_bit(src, tmp_path):
    dst = tmp_path / "sp"
    assert export(src, dst, ExportSpec("speculators"), workers=2).state == "complete"
    by_ids = {tuple(s.input_ids.tolist()): s for s in sources(src).values()}
    rows = speculators_rows(dst)
    assert len(rows) == 7
    for r in rows:
        sample = by_ids[tuple(r["input_ids"].tolist())]
        st = stacked(sample)
        assert same_bits(r["hidden_states"], st[:, :-1].flatten(1))              # [L, 3H]
        assert same_bits(r["verifier_last_hidden_states"], st[:, -1])            # pre-norm final
        assert same_bits(r["loss_mask"], sample.tensors["loss_mask"].to(torch.int64))
        assert same_bits(r["input_ids"], sample.input_ids)
        assert int(r["lengths"]) == sample.input_ids.shape[0]
    import datasets

    table = datasets.load_from_disk(str(dst))
    assert table.column_names == ["input_ids", "loss_mask", "seq_len"]
    assert [int(x) for x in table.with_format(None)["seq_len"]] == [len(r["input_ids"]) for r in rows]


def test_a_rows_new_loss_mask_reaches_the_table(src, tmp_path):
    """A sample extracted again with the same tokens and another loss mask (a mask fix): the same key and row,
    its file rewritten; the table, kept because no row was added or moved, still held the old mask, and the
    export said complete (speculators reads the mask from the table)."""
    dst = tmp_path / "sp"
    assert export(src, dst, ExportSpec("speculators")).state == "complete"
    sample = next(iter(sources(src).values()))
    ids = sample.input_ids.tolist()
    write_finished(src, ids, shipped=True, loss_mask=[1] * len(ids), seed=99)
    summ = export(src, dst, ExportSpec("speculators"))
    assert summ.state == "complete" and summ.exported == 1
    rows = {tuple(r["input_ids"].tolist()): r for r in speculators_rows(dst)}
    assert rows[tuple(ids)]["loss_mask"].tolist() == [1] * len(ids)
    assert len(rows) == 7


def test_a_source_mask_damaged_after_its_export_fails_the_table_not_with_a_traceback(src, tmp_path, capsys):
    """The table reads every row's mask from the source again; one damaged since its export raised inside
    datasets' generator: a DatasetGenerationError traceback, export.json left in-progress."""
    import struct

    from hs_patch.host.extract_cli import main

    dst = tmp_path / "sp"
    assert export(src, dst, ExportSpec("speculators")).state == "complete"
    assert layout.read_info(dst)["dtype"] == layout.read_info(dst)["capture_dtype"] == "bfloat16"
    path = next((src / "samples").glob("*.safetensors"))
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    start = 8 + n + json.loads(raw[8:8 + n])["loss_mask"]["data_offsets"][0]
    flip_byte(path, start, 0x01)
    write_finished(src, [11, 12, 13], shipped=True)  # a new row: the table is built again
    code = main(["export", "--format", "speculators", str(src), str(dst)])
    err = capsys.readouterr().err
    assert code == 3 and "the speculators table" in err and "loss mask changed since it was exported" in err
    assert layout.read_info(dst)["state"] == "incomplete"


def test_speculators_fp8_is_hs_connectors_quantizer_bit_for_bit(src, tmp_path):
    need("hs_connectors")
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8
    from safetensors.torch import load_file

    dst = tmp_path / "sp8"
    assert export(src, dst, ExportSpec("speculators", fp8=True)).state == "complete"
    assert not (dst / "hidden_states").exists(), "fp8 files must not sit where the default file backend reads"
    entries = layout.live_entries(dst)
    want = sources(src)
    rel_err = []
    for key, e in entries.items():
        raw = load_file(str(dst / e["file"]))
        q, scale = quantize_tensor_to_fp8(stacked(want[key]))    # hs_connectors' own quantizer
        assert same_bits(raw["hidden_states"], q) and same_bits(raw["hidden_states_scales"], scale)
        assert set(raw) == {"token_ids", "hidden_states", "hidden_states_scales"}
        deq = dequantize_fp8_tensor(q, scale)
        rel_err.append(float((deq.float() - stacked(want[key]).float()).norm() / stacked(want[key]).float().norm()))
    rows = speculators_rows(dst, fp8=True)            # FP8Transfer dequantizes transparently
    by_ids = {tuple(s.input_ids.tolist()): s for s in want.values()}
    for r in rows:
        st = stacked(by_ids[tuple(r["input_ids"].tolist())])
        deq = dequantize_fp8_tensor(*quantize_tensor_to_fp8(st))
        assert same_bits(r["hidden_states"], deq[:, :-1].flatten(1))
        assert same_bits(r["verifier_last_hidden_states"], deq[:, -1])
    assert max(rel_err) < 0.05   # e4m3 with per-token scales: ~2-3% relative error on Gaussian states


def test_speculators_refuses_post_norm_only(tmp_path):
    post = tmp_path / "post"
    write_run(post, 2, final="post")
    with pytest.raises(ExportRefused, match="cannot be derived"):
        export(post, tmp_path / "x", ExportSpec("speculators"))


# --------------------------------------------------------------------------- resume, idempotence, stale files


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_rerun_redoes_only_damage_and_leaves_nothing_stale(src, tmp_path, fmt):
    dst = tmp_path / fmt
    assert export(src, dst, ExportSpec(fmt)).exported == 7
    again = export(src, dst, ExportSpec(fmt))
    assert (again.exported, again.kept, again.state) == (0, 7, "complete")
    entries = layout.live_entries(dst)
    victim = sorted(entries)[3]
    path = dst / entries[victim]["file"]
    flip_byte(path, -3, 0x40)
    stray = dst / ("samples/old-run.ckpt" if fmt == "specforge" else "hidden_states/hs_99.safetensors")
    stray.write_bytes(b"left by an older export")
    fixed = export(src, dst, ExportSpec(fmt))
    assert (fixed.exported, fixed.kept, fixed.swept) == (1, 6, 1) and not stray.exists()
    assert store.verify_entry(dst, layout.live_entries(dst)[victim]) is None
    # a sample removed from the source leaves the export; speculators' rows stay dense
    gone = sorted(entries)[1]
    store.Manifest(src).remove(gone)
    write_finished(src, [9, 8, 7, 6], seed=99, shipped=True)
    after = export(src, dst, ExportSpec(fmt))
    assert after.removed == 1 and after.exported == 1 and after.state == "complete"
    live = layout.live_entries(dst)
    assert gone not in live and len(live) == 7
    if fmt == "specforge":
        assert len(specforge_samples(dst)) == 7 and not (dst / f"samples/{gone}.ckpt").exists()
    else:
        assert sorted(e["row"] for e in live.values()) == list(range(7))
        assert len(list((dst / "hidden_states").glob("hs_*.safetensors"))) == 7
        rows = speculators_rows(dst)     # its own token-id check pairs every row with its file
        assert sorted(tuple(r["input_ids"].tolist()) for r in rows) == \
            sorted(tuple(s.input_ids.tolist()) for s in sources(src).values())


def test_damaged_source_fails_that_sample_only(src, tmp_path):
    entries = store.read_manifest(src)
    key = sorted(entries)[0]
    p = src / entries[key]["file"]
    flip_byte(p, -1, 1)
    s = export(src, tmp_path / "sf", ExportSpec("specforge"))
    assert s.state == "incomplete" and list(s.failed) == [key] and "damaged" in s.failed[key]
    assert s.exported == 6
    assert json.loads((tmp_path / "sf" / "export.json").read_text())["state"] == "incomplete"


@pytest.mark.parametrize("damage", ["missing", "header"])
def test_a_damaged_first_sample_fails_that_sample_only(src, tmp_path, damage):
    """The export reads what it holds from one sample's header: a damaged or missing first file
    (by key) must fail as that sample, as any other does, not refuse the whole export."""
    entries = store.read_manifest(src)
    key = min(entries)
    p = src / entries[key]["file"]
    if damage == "missing":
        p.unlink()
    else:
        p.write_bytes(b"\0" * 64 + p.read_bytes()[64:])
    s = export(src, tmp_path / "sf", ExportSpec("specforge"))
    assert s.state == "incomplete" and list(s.failed) == [key] and s.exported == 6


class Crash(BaseException):
    """A SIGKILL stand-in: nothing after it runs, no handler catches it."""


def _crash_when(monkeypatch, hit) -> None:
    import os

    real = os.replace

    def replace(a, b):
        if hit(str(b)):
            raise Crash(b)
        return real(a, b)

    monkeypatch.setattr(os, "replace", replace)


def test_speculators_rows_never_pair_with_moved_files_after_a_crash(src, tmp_path, monkeypatch):
    """Rows move when a sample leaves the source; a crash at the first move must not leave the
    old table loadable (its row would pair with another sample's file)."""
    import datasets

    dst = tmp_path / "sp"
    export(src, dst, ExportSpec("speculators"))
    live = layout.live_entries(dst)
    store.Manifest(src).remove(min(live, key=lambda k: live[k]["row"]))   # row 0: the last row moves into it
    with monkeypatch.context() as m:
        _crash_when(m, lambda b: "/hidden_states/hs_" in b)
        with pytest.raises(Crash):
            export(src, dst, ExportSpec("speculators"))
    with pytest.raises(FileNotFoundError):
        datasets.load_from_disk(str(dst))
    assert export(src, dst, ExportSpec("speculators")).state == "complete"
    assert len(speculators_rows(dst)) == 6


def test_speculators_table_is_whole_after_a_crash_while_it_is_replaced(src, tmp_path, monkeypatch):
    """New samples make a new table; a crash after its data files are in place and before its
    state.json must not leave the old state.json naming the old files (fewer rows) for a resume
    to call complete."""
    import datasets

    keys = sorted(store.read_manifest(src))
    half = tmp_path / "half"
    write_run(half, 4, shipped=True)
    dst = tmp_path / "sp"
    export(half, dst, ExportSpec("speculators"))
    write_run(half, 7, shipped=True)   # the same first 4 samples again (appended as adds) and 3 more
    real_save = datasets.Dataset.save_to_disk
    with monkeypatch.context() as m:
        m.setattr(datasets.Dataset, "save_to_disk", lambda self, path, **kw: real_save(self, path, max_shard_size=200))
        _crash_when(m, lambda b: b.endswith("/state.json"))
        with pytest.raises(Crash):
            export(half, dst, ExportSpec("speculators"))
    s = export(half, dst, ExportSpec("speculators"))
    assert s.state == "complete" and s.info["samples"] == 7 and len(keys) == 7
    assert len(datasets.load_from_disk(str(dst))) == 7 and len(speculators_rows(dst)) == 7


def test_a_killed_table_build_is_removed_by_the_next_run(src, tmp_path):
    """A SIGKILL while the table is built leaves DST/.tmp/table.<pid> (its rows twice: the cache
    and the table); the next run, holding the export's lock, removes it."""
    import datasets

    dst = tmp_path / "sp"
    export(src, dst, ExportSpec("speculators"))
    left = dst / ".tmp" / "table.4242" / "cache"
    left.mkdir(parents=True)
    (left / "data.arrow").write_bytes(b"rows of a killed run" * 100)
    assert export(src, dst, ExportSpec("speculators")).state == "complete"
    assert not list((dst / ".tmp").glob("table.*"))
    assert len(datasets.load_from_disk(str(dst))) == 7

def test_destination_must_be_new_or_the_same_export(src, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ExportRefused, match="not empty"):
        export(src, other, ExportSpec("specforge"))
    dst = tmp_path / "sp"
    export(src, dst, ExportSpec("speculators"))
    with pytest.raises(ExportRefused, match="another export"):
        export(src, dst, ExportSpec("speculators", fp8=True))



def test_another_source_never_deletes_what_an_export_holds(src, tmp_path):
    """Exporting run B into run A's export (to merge them) deleted A's samples from it as 'gone
    from the source'; the same run moved elsewhere (nothing gone) is still exported in place."""
    dst = tmp_path / "sp"
    export(src, dst, ExportSpec("speculators"))
    other = tmp_path / "other"
    write_run(other, 2, shipped=True)
    with pytest.raises(ExportRefused, match="lacks 5 of its samples"):
        export(other, dst, ExportSpec("speculators"))
    assert len(layout.live_entries(dst)) == 7 and len(list((dst / "hidden_states").glob("hs_*"))) == 7
    moved = tmp_path / "moved"
    src.rename(moved)
    s = export(moved, dst, ExportSpec("speculators"))
    assert (s.state, s.kept, s.removed) == ("complete", 7, 0)

def test_raw_capture_without_loss_mask_is_refused(tmp_path):
    raw = tmp_path / "raw"
    t = torch.tensor([1, 2, 3])
    key = store.sample_key(t)
    planes = store.plane_names([2, 30, 58], "both")
    w = store.write_tensors(raw, key, {"input_ids": t, **{p: torch.zeros(3, 8, dtype=torch.bfloat16) for p in planes}},
                            {"format": store.FORMAT, "key": key, "num_tokens": "3", "planes": ",".join(planes),
                             "layers": "2,30,58", "final": "both", "dtype": "bfloat16", "hidden_size": "8"})
    store.Manifest(raw).add(w)
    s = export(raw, tmp_path / "x", ExportSpec("specforge"))
    assert s.state == "incomplete" and "no loss_mask" in s.failed[key]
    # the driver's captures carry their loss mask from the start: the capture dir is told by the server's status
    # file (its samples not yet checked by the fidelity check, or failed it)
    (raw / "hook_status.json").write_text("{}")
    with pytest.raises(ExportRefused, match="is the server's capture directory"):
        export(raw, tmp_path / "y", ExportSpec("specforge"))


def test_cli_export_and_exit_codes(src, tmp_path, capsys):
    from hs_patch.host.extract_cli import main

    assert main(["export", "--format", "speculators", "--json", "--workers", "1", str(src), str(tmp_path / "sp")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state"] == "complete" and out["exported"] == 7
    assert main(["export", "--format", "specforge", "--layers", "2,30", str(src), str(tmp_path / "sf")]) == 1
    assert "exactly 3" in capsys.readouterr().err


def test_cli_export_of_a_missing_or_empty_source_says_which(tmp_path, capsys):
    from hs_patch.host.extract_cli import main

    (tmp_path / "file").write_text("")
    (tmp_path / "empty").mkdir()
    for src, says in (("missing", "missing does not exist"), ("file", "file is not a directory"),
                      ("empty", "no samples in manifest.jsonl")):
        assert main(["export", "--format", "speculators", str(tmp_path / src), str(tmp_path / "out")]) == 1
        assert says in capsys.readouterr().err, src
    assert not (tmp_path / "out").exists(), "nothing is written for a refused source"


def test_workers_of_a_killed_export_exit_too(tmp_path):
    """SIGKILL (or the OOM killer) on hs-extract export: its worker processes must not wait forever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "run"
    write_run(src, 40, lengths=(300, 200), hidden=512, shipped=True)

    def children(pid: int) -> list[int]:
        out = []
        for d in Path("/proc").iterdir():
            try:
                if d.name.isdigit() and int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid \
                        and b"spawn_main" in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
        return out

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    p = subprocess.Popen([sys.executable, "-m", "hs_patch.host.extract_cli", "export", "--format", "speculators",
                          "--workers", "2", str(src), str(tmp_path / "sp")], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers) < 2 and time.monotonic() < deadline and p.poll() is None:
            workers = children(p.pid)
            time.sleep(0.05)
        assert len(workers) == 2, "the export did not start its two workers"
        p.send_signal(signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(Path(f"/proc/{w}").exists() for w in workers):
            time.sleep(0.2)
        left = [w for w in workers if Path(f"/proc/{w}").exists() and b"Z" not in
                (Path(f"/proc/{w}/stat").read_bytes().rsplit(b")", 1)[1][:3])]
        assert not left, f"workers {left} outlived their export"
    finally:
        if p.poll() is None:
            p.kill()
        for w in workers:
            try:
                os.kill(w, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("fmt", ["specforge", "speculators"])
def test_a_full_destination_stops_the_export_and_a_rerun_finishes_it(src, tmp_path, monkeypatch, capsys, fmt):
    """ENOSPC: every later sample would be read whole (and its sha256 checked) only to fail the same
    way, one line each; the export stops there, says the destination is full, and resumes."""
    import errno

    from hs_patch.host.export import writers
    from hs_patch.host.extract_cli import main

    name = "write_specforge" if fmt == "specforge" else "write_speculators"
    real, calls = getattr(writers, name), []

    def write(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **kw)

    dst = tmp_path / fmt
    with monkeypatch.context() as m:
        m.setattr(writers, name, write)
        assert main(["export", "--format", fmt, "--workers", "1", str(src), str(dst)]) == 3
    cap = capsys.readouterr()
    assert len(calls) == 3, "no sample is tried after the destination filled up"
    assert f"{dst} is full" in cap.err and "4 samples not tried" in cap.err and "train:" not in cap.out
    assert main(["export", "--format", fmt, "--workers", "1", "--json", str(src), str(dst)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["state"], out["exported"], out["kept"]) == ("complete", 5, 2)
