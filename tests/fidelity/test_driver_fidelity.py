"""The driver checks every sample it keeps: the production fidelity check, wired in."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from hs_patch.host.fidelity import check as fidelity
from hs_patch.host.fidelity import settings
from hs_patch.host.driver import runstate
from hs_patch.host.driver.run import EXIT_FAILURES, EXIT_OK
from hs_patch.samples import reader, store
from lab.runcheck import ledger, write_chats
from lab import sabotage
from lab.drive_runs import drive, start_standin


@pytest.fixture(scope="module")
def standin(tiny_model_dir, tmp_path_factory):
    srv = start_standin(tiny_model_dir, tmp_path_factory.mktemp("capture"), "0.5.16")
    yield srv
    srv.close()


def test_every_kept_sample_passed_the_same_pass_check(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    ids = write_chats(data, 6, words=40)
    summary = drive(standin, tiny_model_dir, tmp_path, [data], fidelity_fraction=0.5)
    assert summary.exit_code == EXIT_OK
    log = runstate.read_jsonl(tmp_path / "state" / fidelity.FIDELITY_LOG)
    assert sorted(r["sample_id"] for r in log) == sorted(ids) and all(r["ok"] for r in log)
    assert {r["kind"] for r in log} == {"last", "positions"}, "a share is checked at many positions"
    assert summary.status["fidelity"]["passed"] == 6 and summary.status["fidelity"]["rejected"] == 0


def test_wrong_states_are_never_kept_and_k_in_a_row_stop_the_run(standin, tiny_model_dir, tmp_path, monkeypatch):
    """States that do not give the server's tokens (here: the head sees them shifted by one row)
    are removed before adoption, logged, and after K in a row the run stops saying why."""
    real = fidelity.LMHead.post_norm

    def shifted(self, sample, start, stop):
        states, plane = real(self, sample, max(0, start - 1), stop - 1)
        return states, plane

    monkeypatch.setattr(fidelity.LMHead, "post_norm", shifted)
    data = tmp_path / "d.jsonl"
    write_chats(data, 8, words=40)
    summary = drive(standin, tiny_model_dir, tmp_path, [data], concurrency=1, fidelity_max_consecutive=3)
    assert summary.exit_code == EXIT_FAILURES and "fidelity: 3 samples in a row" in summary.message
    assert store.read_manifest(tmp_path / "samples") == {}, "nothing that failed the check reaches the shipper"
    failed = [e for e in ledger(tmp_path / "state") if e["event"] == "failed"]
    assert failed and all(e["stage"] == "fidelity" for e in failed)
    assert not list(Path(standin.engine.capture.directory).glob("*.safetensors"))


def test_a_model_dir_without_its_head_is_refused_at_start_unless_the_check_is_off(standin, tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "tokenizer-only"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    data = tmp_path / "d.jsonl"
    write_chats(data, 1)
    with pytest.raises(runstate.RunError, match="--no-fidelity-check"):
        drive(standin, model, tmp_path, [data])
    assert drive(standin, model, tmp_path / "off", [data], fidelity_check=False).exit_code == EXIT_OK


def test_a_sample_with_a_wrong_plane_is_not_kept_and_every_kept_one_records_its_check(standin, tiny_model_dir,
                                                                                       tmp_path):
    """One sample's layer.1 holds layer 2's input (the real hook in the stand-in, lab.sabotage): the
    driver's check rejects it naming the plane, the others are kept, and each kept sample says how it
    was checked: its header (the driver's settings, through the intent) and its manifest line (the
    result)."""
    data = tmp_path / "d.jsonl"
    ids = write_chats(data, 4, words=40)
    tag = hashlib.sha256(ids[1].encode()).hexdigest()[:8]  # in every request id the driver sends for it
    undo = sabotage.install(case_of=lambda rid: "wrong_layer" if f"-{tag}-" in rid else None)
    try:
        summary = drive(standin, tiny_model_dir, tmp_path, [data], concurrency=1)
    finally:
        undo()
    failed = [e for e in ledger(tmp_path / "state") if e["event"] == "failed"]
    assert [(e["sample_id"], e["stage"]) for e in failed] == [(ids[1], "fidelity")]
    assert "layer.1+attn: layer 1's stored input plus its attention's output is not the residual" in failed[0]["error"]
    (logged,) = [r for r in store.read_jsonl(tmp_path / "state" / "fidelity.jsonl") if not r["ok"]]
    assert any(p.startswith("layer.1: the stored rows, normalised with layer 1's input norm")
               for p in logged["rows"]["problems"]), "the norm relation sees it too"
    assert summary.status["fidelity"]["rejected"] == 1 and summary.status["fidelity"]["check"]["rows_per_chunk"] == 8
    kept = store.read_manifest(tmp_path / "samples")
    assert sorted(e["sample_id"] for e in kept.values()) == sorted(ids[:1] + ids[2:])
    for e in kept.values():
        assert e["fidelity"]["ok"] and e["fidelity"]["check"] == settings.VERSION and e["fidelity"]["rows"] >= 2
        assert e["fidelity"]["gaps"] == 16, "every sample's final state tied to its request at its last 16 positions"
        meta = reader.read_header(tmp_path / "samples" / e["file"]).metadata
        assert json.loads(meta["fidelity_check"]) == {"version": settings.VERSION, "on": True, "rows_per_chunk": 8,
                                                      "fraction": 0.01, "positions": 32, "tie_tolerance": 0.02,
                                                      "gap_positions": 16}
    rejected = [r for r in runstate.read_jsonl(tmp_path / "state" / fidelity.FIDELITY_LOG) if not r["ok"]]
    assert [r["sample_id"] for r in rejected] == [ids[1]] and rejected[0]["rows"]["relations"]["layer.1"]["chi2"] > \
        rejected[0]["rows"]["relations"]["layer.1"]["bound"]


def test_a_resume_under_a_weaker_check_is_refused_unless_accepted_and_each_sample_keeps_its_own(
        standin, tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    write_chats(data, 3, words=40)
    assert drive(standin, tiny_model_dir, tmp_path, [data], limit=1).exit_code == EXIT_OK
    with pytest.raises(runstate.RunError, match="checked more strictly than this start would: the check is off"):
        drive(standin, tiny_model_dir, tmp_path, [data], fidelity_check=False)
    with pytest.raises(runstate.RunError, match="--fidelity-rows 4 .the run used 8.*--accept-weaker-check"):
        drive(standin, tiny_model_dir, tmp_path, [data], fidelity_rows=4, limit=2)
    assert drive(standin, tiny_model_dir, tmp_path, [data], fidelity_rows=4, limit=2,
                 accept_weaker_check=True).exit_code == EXIT_OK
    starts = [e for e in ledger(tmp_path / "state") if e["event"] == "run_start"]
    assert starts[-1]["weaker_check"] == ["--fidelity-rows 4 (the run used 8)"]
    checks = json.loads((tmp_path / "state" / "run.json").read_text())["fidelity_checks"]
    assert [c["check"]["rows_per_chunk"] for c in checks] == [8, 4]
    rows = sorted(json.loads(reader.read_header(tmp_path / "samples" / e["file"]).metadata["fidelity_check"])
                  ["rows_per_chunk"] for e in store.read_manifest(tmp_path / "samples").values())
    assert rows == [4, 8], "each sample says how it was checked"
    assert drive(standin, tiny_model_dir, tmp_path, [data]).exit_code == EXIT_OK  # stronger again: allowed


def test_the_heads_weights_are_read_only_once_a_request_is_sent(standin, tiny_model_dir, tmp_path, monkeypatch):
    """Issue #36: the LM head (4.7 GB in fp32 on Kimi-K2.5) and the embedding are read after the first request, not
    on the way to it; a run that sends nothing never reads them. Their names and shapes are still checked at start."""
    reads = []
    real = fidelity.LMHead.from_model_dir
    monkeypatch.setattr(fidelity.LMHead, "from_model_dir", classmethod(lambda cls, d: reads.append(d) or real(d)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "no answer"}]}\n')
    s = drive(standin, tiny_model_dir, tmp_path / "nothing", [bad])
    assert s.status["samples"]["rejected"] == 1 and reads == []
    good = tmp_path / "good.jsonl"
    write_chats(good, 2)
    assert drive(standin, tiny_model_dir, tmp_path / "two", [good]).exit_code == EXIT_OK
    assert reads == [str(tiny_model_dir)]
    start = next(e for e in ledger(tmp_path / "two" / "state") if e["event"] == "run_start")
    assert {"tokenizer_s", "server_checks_s", "capture_check_s", "prepare_s"} <= set(start["startup"])


def test_a_head_that_does_not_fit_is_refused_at_start_from_its_header(standin, tiny_model_dir, tmp_path):
    import shutil

    model = tmp_path / "other-width"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(cfg, hidden_size=cfg["hidden_size"] * 2)))
    data = tmp_path / "d.jsonl"
    write_chats(data, 1)
    with pytest.raises(runstate.RunError, match="do not fit hidden size"):
        drive(standin, model, tmp_path, [data])
    assert not [e for e in ledger(tmp_path / "state") if e["event"] == "sent"]


def test_weights_unreadable_after_the_start_stop_the_run_saying_why(standin, tiny_model_dir, tmp_path, monkeypatch):
    from hs_patch.host.driver.run import EXIT_ERROR
    from hs_patch.host.model_files import ModelFileError

    def unreadable(cls, d):
        raise ModelFileError(f"{d}/model.safetensors: cannot read 'lm_head.weight' (I/O error)")

    monkeypatch.setattr(fidelity.LMHead, "from_model_dir", classmethod(unreadable))
    data = tmp_path / "d.jsonl"
    write_chats(data, 3)
    s = drive(standin, tiny_model_dir, tmp_path, [data])
    assert s.exit_code == EXIT_ERROR and "cannot read the LM head" in s.message and "I/O error" in s.message
    assert s.status["samples"]["done"] == 0 and not list((tmp_path / "samples").glob("*.safetensors"))
