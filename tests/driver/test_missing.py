"""A run's account of the lines it does not hold when it ends: missing.jsonl and status.json["missing"]."""

from __future__ import annotations

import json

import pytest

from hs_patch.host.driver import missing, runstate
from hs_patch.host.driver.run import EXIT_INCOMPLETE, EXIT_OK
from lab.drive_runs import drive, start_standin
from lab.runcheck import write_chats


@pytest.fixture(scope="module")
def standin(tiny_model_dir, tmp_path_factory):
    srv = start_standin(tiny_model_dir, tmp_path_factory.mktemp("capture"), "0.5.16")
    yield srv
    srv.close()


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


def test_a_complete_run_names_nothing(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "d.jsonl"
    write_chats(data, 3)
    summary = drive(standin, tiny_model_dir, tmp_path, [data])
    assert summary.exit_code == EXIT_OK and summary.message == "complete"
    assert summary.status["missing"] == {"lines": 0, "rejected": 0, "failed": 0, "not_attempted": 0, "never": 0,
                                         "shown": []}
    assert (tmp_path / "state" / missing.FILE).read_text() == ""
