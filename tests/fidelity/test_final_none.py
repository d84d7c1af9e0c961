"""HS_CAPTURE_FINAL=none (a documented choice: no final state stored) under the default fidelity check:
the row checks still check every stored plane and decide; a right sample is kept, a wrong one is not."""

from __future__ import annotations

import hashlib

from hs_patch.host.driver.run import EXIT_OK
from hs_patch.samples import store
from lab import sabotage
from lab.drive_runs import drive, start_standin
from lab.runcheck import ledger, write_chats


def test_without_a_final_state_the_row_checks_decide(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HS_CAPTURE_FINAL", "none")
    srv = start_standin(tiny_model_dir, tmp_path / "capture", "0.5.16")
    try:
        data = tmp_path / "d.jsonl"
        ids = write_chats(data, 3, words=40)
        tag = hashlib.sha256(ids[1].encode()).hexdigest()[:8]
        undo = sabotage.install(case_of=lambda rid: "zeros" if f"-{tag}-" in rid else None)
        try:
            summary = drive(srv, tiny_model_dir, tmp_path, [data], concurrency=1, fidelity_fraction=0.5)
        finally:
            undo()
    finally:
        srv.close()
    kept = store.read_manifest(tmp_path / "samples")
    assert sorted(e["sample_id"] for e in kept.values()) == sorted([ids[0], ids[2]]), ledger(tmp_path / "state")
    # the LM head's input kept at the last 16 positions (HS_CAPTURE_CHECK_ROWS) of the prompt's last part is
    # checked too: here that part is shorter than 16 (chunks of 48), so it keeps what it has
    assert all(e["fidelity"]["ok"] and e["fidelity"]["kind"] in ("last", "positions") and e["fidelity"]["rows"] >= 2
               and 0 < e["fidelity"]["gaps"] <= 16 for e in kept.values()), [e["fidelity"] for e in kept.values()]
    failed = [e for e in ledger(tmp_path / "state") if e["event"] == "failed"]
    assert [(e["sample_id"], e["stage"]) for e in failed] == [(ids[1], "fidelity")]
    assert "all zeros" in failed[0]["error"]
    assert summary.exit_code != EXIT_OK  # one line failed
