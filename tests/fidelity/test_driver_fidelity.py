"""The driver checks every sample it keeps: the production fidelity check, wired in."""

from __future__ import annotations

from pathlib import Path

import pytest

from hs_patch import store
from hs_patch.host.fidelity import check as fidelity
from hs_patch.host.driver import runstate
from hs_patch.host.driver.run import EXIT_FAILURES, EXIT_OK
from lab.runcheck import ledger, write_chats
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
