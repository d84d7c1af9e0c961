"""A run's account of the lines it does not hold when it ends (missing.jsonl, status.json["missing"]),
and a run queued behind another on the same capture dir."""

from __future__ import annotations

import json
import os
import threading
import time

from hs_patch.host.driver import missing, runstate
from hs_patch.host.driver.run import CAPTURE_LOCK, EXIT_INCOMPLETE, EXIT_OK, EXIT_SIGNAL, Driver
from lab.drive_runs import config, drive
from lab.runcheck import write_chats


def test_a_run_names_each_line_it_does_not_hold_and_which_can_never_be_extracted(standin, tiny_model_dir, tmp_path):
    """A bad line is rejected; a line whose id is over the intent's 16 KiB of provenance fails at the
    intent on every run: neither can be extracted as it is, and the run's summary says so."""
    data = tmp_path / "d.jsonl"
    write_chats(data, 5)
    lines = data.read_text().splitlines()
    lines[2] = json.dumps({**json.loads(lines[2]), "id": "x" * 20000})
    data.write_text("\n".join(lines + ["{not json"]) + "\n")
    state = tmp_path / "state"
    for run in (1, 2):
        summary = drive(standin, tiny_model_dir, tmp_path, [data])
        assert (summary.exit_code, summary.state) == (EXIT_INCOMPLETE, "finished"), summary.message
        m = summary.status["missing"]
        assert (m["lines"], m["rejected"], m["failed"], m["not_attempted"], m["never"]) == (2, 1, 1, 0, 2), m
        assert "2 line(s) not held (1 rejected, 1 failed, 2 of them can never be extracted as they are: " \
               "missing.jsonl says which and why)" in summary.message, summary.message
        entries = {e["sample_id"]: e for e in runstate.read_jsonl(state / missing.FILE)}
        assert set(entries) == {"d.jsonl:3", "d.jsonl:6"} and [e["sample_id"] for e in m["shown"]] == \
            ["d.jsonl:6", "d.jsonl:3"]
        failed = entries["d.jsonl:3"]
        assert failed["why"].startswith("failed at intent: cannot write the sample's intent") and \
            "provenance metadata over 16384 bytes" in failed["why"] and failed["retry"] is False
        assert failed["runs_failed"] == run and (f"(failed in {run} runs)" in failed["why"]) == (run > 1)
        assert entries["d.jsonl:6"]["why"].startswith("rejected: bad_json (not valid JSON") and \
            entries["d.jsonl:6"]["retry"] is False


def test_a_line_fixed_after_its_reject_is_held_and_no_longer_missing(standin, tiny_model_dir, tmp_path):
    """missing.jsonl tells the operator to change a rejected line; once changed, the next run extracts it, and the
    run is complete: the old reject was kept and listed for ever (fab exited 1 on every run, naming a line that was
    already held)."""
    data = tmp_path / "d.jsonl"
    write_chats(data, 3)
    good = data.read_text().splitlines()
    data.write_text("\n".join(good[:1] + ["{not json"] + good[1:]) + "\n")
    first = drive(standin, tiny_model_dir, tmp_path, [data])
    assert first.message.startswith("complete but for bad input") and first.status["missing"]["rejected"] == 1
    fixed = json.loads(good[0])
    fixed["messages"][0]["content"] += " (fixed)"
    data.write_text("\n".join(good[:1] + [json.dumps(fixed)] + good[1:]) + "\n")
    again = drive(standin, tiny_model_dir, tmp_path, [data])
    assert (again.exit_code, again.message) == (EXIT_OK, "complete"), again.message
    assert again.status["samples"]["done"] == 4 and again.status["samples"]["rejected"] == 0
    assert (tmp_path / "state" / missing.FILE).read_text() == ""
    assert len(runstate.read_jsonl(tmp_path / "state" / runstate.REJECTS)) == 1  # the history stays


def test_a_complete_run_names_nothing(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    write_chats(data, 3)
    summary = drive(standin, tiny_model_dir, tmp_path, [data])
    assert summary.exit_code == EXIT_OK and summary.message == "complete"
    assert summary.status["missing"] == {"lines": 0, "rejected": 0, "failed": 0, "not_attempted": 0, "never": 0,
                                         "shown": []}
    assert (tmp_path / "state" / missing.FILE).read_text() == ""


def test_a_queued_run_waits_for_the_capture_dir_and_runs_when_it_is_free(standin, tiny_model_dir, tmp_path):
    """One server, one capture dir, one driver at a time: with --queue (fab's fleet jobs: a reassigned
    shard behind the host's own) a second run waits, state queued naming the holder, instead of
    failing; stopped while it waits, it ends having started nothing."""

    data = tmp_path / "d.jsonl"
    write_chats(data, 2)
    capture = standin.engine.capture.directory
    held = runstate.take_lock(f"{capture}/{CAPTURE_LOCK}", "capture dir", "run own")
    try:
        for stop in (True, False):
            cfg = config(standin.url, capture, tiny_model_dir, tmp_path / str(stop), [data], queue=True, host_name="g")
            driver, got = Driver(cfg), {}
            t = threading.Thread(target=lambda: got.update(s=driver.run()))
            t.start()
            status = tmp_path / str(stop) / "state" / runstate.STATUS
            deadline = time.monotonic() + 30
            while not (status.exists() and json.loads(status.read_text())["state"] == "queued"):
                assert time.monotonic() < deadline and t.is_alive(), "the run never said it was queued"
                time.sleep(0.05)
            assert f"is in use by pid {os.getpid()} (run own)" in json.loads(status.read_text())["message"]
            assert not (tmp_path / str(stop) / "state" / runstate.LEDGER).exists(), "nothing starts while queued"
            if stop:
                driver.request_stop("stopped by SIGTERM", EXIT_SIGNAL)
                t.join(30)
                assert (got["s"].state, got["s"].exit_code) == ("stopped", EXIT_SIGNAL)
                assert not (tmp_path / str(stop) / "state" / runstate.LEDGER).exists()
                continue
            os.close(held)
            held = None
            t.join(120)
            assert got["s"].exit_code == EXIT_OK and got["s"].status["samples"]["done"] == 2
    finally:
        if held is not None:
            os.close(held)
