"""Dataset reading: format detection, normalization, and every kind of bad line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hs_patch.host import dataset

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "data" / "tiny_chat.jsonl"
EXAMPLE_REJECTS = {13: "bad_json", 14: "not_utf8", 15: "bad_json", 16: "unknown_format", 17: "empty",
                   28: "no_assistant_turn", 29: "bad_role", 30: "bad_field", 31: "bad_field", 32: "bad_field",
                   33: "ambiguous_format"}


def test_bundled_example_reads_as_documented():
    items = list(dataset.read([str(EXAMPLE)]))
    rejects = {r.line: r.reason for r in items if isinstance(r, dataset.Reject)}
    records = [r for r in items if isinstance(r, dataset.Record)]
    assert rejects == EXAMPLE_REJECTS
    assert len(records) == 21 and dataset.count_lines([str(EXAMPLE)]) == 32  # line 12 is blank
    assert {r.format for r in records} == {"messages", "conversations", "input_ids"}
    assert all(r.sample_id == f"tiny_chat.jsonl:{r.line}" for r in records)


def test_formats_are_normalized():
    sharegpt = dataset.parse_line(json.dumps({"id": 7, "conversations": [
        {"from": "system", "value": "s"}, {"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}).encode(),
        "f.jsonl", 3)
    assert sharegpt.messages == [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "a"}]
    assert (sharegpt.sample_id, sharegpt.source_id, sharegpt.format) == ("f.jsonl:3", "7", "conversations")
    parts = dataset.parse_line(json.dumps({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"}]}).encode(), "f.jsonl", 1)
    assert parts.messages[0]["content"] == "ab"
    toks = dataset.parse_line(b'{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}', "f.jsonl", 1)
    assert (toks.input_ids, toks.loss_mask) == ([1, 2, 3], [0, 1, 1])
    assert dataset.parse_line(b'{"input_ids": [4]}', "f.jsonl", 1).loss_mask is None


@pytest.mark.parametrize("line,reason", [
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},'
     b' {"role": "assistant", "content": "a"}]}', "bad_field"),
    (b'{"messages": [{"role": "gpt", "content": "openai roles only"}]}', "bad_role"),
    (b'{"messages": "not a list"}', "bad_field"),
    (b'{"input_ids": [1, -2]}', "bad_field"),
    (b'{"input_ids": [1, 2], "loss_mask": [0, 0]}', "no_assistant_turn"),
    (b'{"input_ids": []}', "empty"),
    (b'{"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]}', "bad_field"),
])
def test_bad_lines(line, reason):
    with pytest.raises(dataset.Invalid) as e:
        dataset.parse_line(line, "f.jsonl", 1)
    assert e.value.reason == reason


def test_reject_log_counts_each_line_once_across_restarts(tmp_path):
    log = dataset.RejectLog(tmp_path / "rejects.jsonl")
    log.add(dataset.Reject("a.jsonl", 3, "bad_json", "x"))
    log.add(dataset.Reject("a.jsonl", 3, "bad_json", "x"))
    again = dataset.RejectLog(tmp_path / "rejects.jsonl")  # a restarted run re-reads the dataset
    again.add(dataset.Reject("a.jsonl", 3, "bad_json", "x"))
    again.add(dataset.Reject("a.jsonl", 4, "empty", "y"))
    lines = [json.loads(x) for x in (tmp_path / "rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["reason"]) for r in lines] == [(3, "bad_json"), (4, "empty")]
    assert again.total == 2 and again.by_reason == {"bad_json": 1, "empty": 1}


def test_sources_must_exist_and_have_distinct_names(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in "ab":
        (tmp_path / d / "x.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="rename one"):
        dataset.check_sources([str(tmp_path / "a" / "x.jsonl"), str(tmp_path / "b" / "x.jsonl")])
    with pytest.raises(FileNotFoundError, match="--data"):
        dataset.check_sources([str(tmp_path / "nope.jsonl")])
