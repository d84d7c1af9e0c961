"""The driver's whole fidelity check on fp8 samples (HS_CAPTURE_DTYPE=fp8, issue #35): the stand-in server's real
hook quantizes every plane, keeps the LM head's input at the prompts' last rows in bf16 (check.post_norm), and the
driver's check (row checks within the fp8 envelope, same-pass top-1 and logit gaps on those bf16 rows) keeps the
right samples and rejects a wrong plane."""

from __future__ import annotations

import hashlib

import pytest

from hs_patch.host.driver import runstate
from hs_patch.host.fidelity import check as fidelity
from hs_patch.samples import reader, store
from hs_patch.server import fp8
from lab import sabotage
from lab.drive_runs import drive, start_standin
from lab.runcheck import ledger, write_chats


@pytest.fixture(scope="module")
def standin(tiny_model_dir, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HS_CAPTURE_DTYPE", "fp8")  # read once, when the stand-in's hook is made
        srv = start_standin(tiny_model_dir, tmp_path_factory.mktemp("capture"), "0.5.16")
    yield srv
    srv.close()


def test_fp8_samples_pass_the_drivers_check_and_a_wrong_plane_is_rejected(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    ids = write_chats(data, 5, words=40)
    tag = hashlib.sha256(ids[1].encode()).hexdigest()[:8]
    undo = sabotage.install(case_of=lambda rid: "wrong_layer" if f"-{tag}-" in rid else None)
    try:
        summary = drive(standin, tiny_model_dir, tmp_path, [data], fidelity_fraction=0.5)
    finally:
        undo()
    log = {r["sample_id"]: r for r in runstate.read_jsonl(tmp_path / "state" / fidelity.FIDELITY_LOG)}
    assert sorted(log) == sorted(ids)
    bad = log[ids[1]]
    assert not bad["ok"] and any("layer.1: the stored rows, normalised" in p for p in bad["rows"]["problems"]), bad
    good = [log[i] for i in ids if i != ids[1]]
    assert all(r["ok"] for r in good), [r for r in good if not r["ok"]]
    assert {r["kind"] for r in good} <= {"last", "positions"} and all(r["plane"] == store.CHECK_TENSOR for r in good)
    assert all(r["gaps"] > 0 for r in good), "the logit gaps are compared on the bf16 check rows"
    kept = list(reader.iter_samples(tmp_path / "samples"))
    assert len(kept) == 4 and summary.status["fidelity"]["passed"] == 4
    for s in kept:
        assert s.fp8 and s.metadata["format"] == store.FORMAT_FP8 and s.metadata[fp8.META] == fp8.SCHEME
        assert s.tensors[store.CHECK_TENSOR].dtype.itemsize == 2  # bf16: what the engine computed
    assert summary.status["fidelity"]["rejected"] == 1
    failed = [e for e in ledger(tmp_path / "state") if e["event"] == "failed"]
    assert [(e["sample_id"], e["stage"]) for e in failed] == [(ids[1], "fidelity")]
    assert "layer.1+attn: layer 1's stored input plus its attention's output is not the residual" in failed[0]["error"]
