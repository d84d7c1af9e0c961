"""Dataset reading: format detection, normalization, and every kind of bad line."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import time
import tracemalloc
from pathlib import Path

import pytest

from hs_patch.host.driver import datafile, dataset

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_chat.jsonl"
EXAMPLE_REJECTS = {13: "bad_json", 14: "not_utf8", 15: "bad_json", 16: "unknown_format", 17: "empty",
                   28: "no_assistant_turn", 29: "bad_role", 30: "bad_field", 31: "bad_field", 32: "bad_field",
                   33: "ambiguous_format"}


def test_bundled_example_reads_as_documented():
    items = list(dataset.read([str(EXAMPLE)]))
    rejects = {r.line: r.reason for r in items if isinstance(r, dataset.Reject)}
    records = [r for r in items if isinstance(r, dataset.Record)]
    assert rejects == EXAMPLE_REJECTS
    assert len(records) == 21 and dataset.count_lines([str(EXAMPLE)]) == datafile.Counts(lines=32, blank=1)
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
    thinking = dataset.parse_line(json.dumps({"messages": [
        {"role": "user", "content": "q", "reasoning_content": "not an answer's: dropped"},
        {"role": "assistant", "content": "a", "reasoning_content": [{"type": "text", "text": "r"}]},
        {"role": "assistant", "content": "b", "reasoning_content": None}]}).encode(), "f.jsonl", 1)
    sharegpt_reasoning = dataset.parse_line(json.dumps({"conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "reasoning_content": "r"}]}).encode(), "f", 1)
    assert sharegpt_reasoning.messages[1] == {"role": "assistant", "content": "a"}   # OpenAI messages only
    assert thinking.messages == [{"role": "user", "content": "q"},
                                 {"role": "assistant", "content": "a", "reasoning_content": "r"},
                                 {"role": "assistant", "content": "b"}]


@pytest.mark.parametrize("line,reason", [
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]},'
     b' {"role": "assistant", "content": "a"}]}', "bad_field"),
    (b'{"messages": [{"role": "gpt", "content": "openai roles only"}]}', "bad_role"),
    (b'{"messages": "not a list"}', "bad_field"),
    (b'{"input_ids": [1, -2]}', "bad_field"),
    (b'{"input_ids": [1, 2], "loss_mask": [0, 0]}', "no_assistant_turn"),
    (b'{"input_ids": []}', "empty"),
    (b'{"conversations": [{"from": "human", "value": 3}, {"from": "gpt", "value": "a"}]}', "bad_field"),
    (b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", '
     b'"reasoning_content": 5}]}', "bad_field"),
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
    # what counts is this pass's: a restart that finds line 3 fixed rejects line 4 only
    third = dataset.RejectLog(tmp_path / "rejects.jsonl")
    third.add(dataset.Reject("a.jsonl", 4, "empty", "y"))
    assert third.total == 1 and third.by_reason == {"empty": 1} and list(third.now) == [("a.jsonl", 4)]
    assert len((tmp_path / "rejects.jsonl").read_text().splitlines()) == 2


def test_sources_must_exist_and_have_distinct_names(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in "ab":
        (tmp_path / d / "x.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="rename one"):
        dataset.check_sources([str(tmp_path / "a" / "x.jsonl"), str(tmp_path / "b" / "x.jsonl")])
    with pytest.raises(FileNotFoundError, match="--data"):
        dataset.check_sources([str(tmp_path / "nope.jsonl")])
    with pytest.raises(ValueError, match=r"is a directory: give the JSONL files in it \(e.g. --data .*/a/\*.jsonl\)"):
        dataset.check_sources([str(tmp_path / "a")])
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(ValueError, match="is empty"):
        dataset.check_sources([str(tmp_path / "empty.jsonl")])


CHAT = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def _read(path: Path, max_chars: int = 1 << 20) -> list:
    return list(dataset.read([str(path)], max_chars))


def test_a_deeply_nested_line_is_rejected_with_file_and_line_and_the_rest_goes_on(tmp_path):
    data = tmp_path / "deep.jsonl"
    data.write_text(json.dumps(CHAT) + "\n" + "[" * 200_000 + "]" * 200_000 + "\n" +
                    '{"messages": ' + "[" * 5000 + "\n" + json.dumps(CHAT) + "\n")
    items = _read(data)
    assert [type(i).__name__ for i in items] == ["Record", "Reject", "Reject", "Record"]
    assert (items[1].sample_id, items[1].reason) == ("deep.jsonl:2", "bad_json")
    assert "nested too deeply" in items[1].detail and "nested too deeply" in items[2].detail
    assert items[3].sample_id == "deep.jsonl:4"


@pytest.mark.parametrize("where", ["content", "part", "id"])
def test_a_lone_surrogate_is_rejected_as_invalid_text(where):
    turn = {"role": "user", "content": "caf\ud800e"}
    if where == "part":
        turn["content"] = [{"type": "text", "text": "x\udfff"}]
    rec = {"id": "ok", "messages": [turn if where != "id" else {"role": "user", "content": "q"},
                                    {"role": "assistant", "content": "a"}]}
    if where == "id":
        rec["id"] = "bad\udc00"
    line = json.dumps(rec).encode()  # ensure_ascii: the surrogate is an escape, valid JSON
    assert b"\\ud" in line or b"\\udc" in line or b"\\udf" in line
    with pytest.raises(dataset.Invalid) as e:
        dataset.parse_line(line, "f.jsonl", 1)
    assert e.value.reason == "invalid_text" and "lone surrogate" in str(e.value)


def test_a_huge_line_is_rejected_unread_in_bounded_time_and_memory(tmp_path):
    data = tmp_path / "huge.jsonl"
    big = {"messages": [{"role": "user", "content": "x" * (50 << 20)}, {"role": "assistant", "content": "a"}]}
    data.write_text(json.dumps(CHAT) + "\n" + json.dumps(big) + "\n" + json.dumps(CHAT) + "\n")
    tracemalloc.start()
    t0 = time.monotonic()
    items = _read(data, max_chars=1 << 20)
    seconds = time.monotonic() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert [type(i).__name__ for i in items] == ["Record", "Reject", "Record"]
    assert items[1].reason == "too_long" and "52428" in items[1].detail and "--max-line-chars" in items[1].detail
    assert peak < 40 << 20, f"{peak} bytes held for a 50 MB line"  # never the whole line
    assert seconds < 30
    assert dataset.count_lines([str(data)], 1 << 20) == datafile.Counts(lines=3, blank=0)


def test_the_default_line_limit_follows_max_tokens():
    assert dataset.line_limit(32768) == 256 * 32768 and dataset.line_limit(16) == 1 << 20
    assert dataset.line_limit(32768, 5000) == 5000


@pytest.mark.parametrize("kind", ["gzip", "bzip2", "xz"])
def test_compressed_files_are_read_by_their_content(tmp_path, kind):
    text = (json.dumps(CHAT) + "\n\n" + json.dumps(CHAT) + "\n").encode()
    packed = {"gzip": gzip.compress, "bzip2": bz2.compress, "xz": lzma.compress}[kind](text)
    data = tmp_path / "chats.jsonl.gz"  # the name says gz whatever it is: the magic bytes decide
    data.write_bytes(packed)
    assert datafile.compression(data) == kind
    assert [i.sample_id for i in _read(data)] == ["chats.jsonl.gz:1", "chats.jsonl.gz:3"]
    assert dataset.count_lines([str(data)]) == datafile.Counts(lines=2, blank=1)


def test_a_truncated_gzip_fails_loudly_after_the_lines_it_could_read(tmp_path):
    data = tmp_path / "cut.jsonl.gz"
    data.write_bytes(gzip.compress(("\n".join(json.dumps(CHAT) for _ in range(2000)) + "\n").encode())[:-200])
    got = []
    with pytest.raises(datafile.DataFileError, match=r"cut.jsonl.gz cannot be read after line \d+"):
        for item in dataset.read([str(data)]):
            got.append(item)
    assert got and all(isinstance(i, dataset.Record) for i in got)


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending_and_a_bom_work_and_blank_lines_keep_their_numbers(tmp_path, ending):
    data = tmp_path / "e.jsonl"
    line = json.dumps(CHAT).encode()
    data.write_bytes(b"\xef\xbb\xbf" + line + ending + ending + b"  " + ending + line + ending + line)
    assert [i.sample_id for i in _read(data)] == ["e.jsonl:1", "e.jsonl:4", "e.jsonl:5"]
    assert all(isinstance(i, dataset.Record) for i in _read(data))
    assert dataset.count_lines([str(data)]) == datafile.Counts(lines=3, blank=2)


def test_invalid_utf8_is_a_reject_with_the_byte_position(tmp_path):
    data = tmp_path / "latin1.jsonl"
    bad = b'{"messages": [{"role": "user", "content": "caf\xe9"}]}'
    data.write_bytes(bad + b"\n" + json.dumps(CHAT).encode() + b"\n")
    items = _read(data)
    at = bad.index(b"\xe9")
    assert items[0].reason == "not_utf8" and f"byte {at} " in items[0].detail
    assert isinstance(items[1], dataset.Record)


def test_a_json_array_file_says_how_to_convert_it():
    for text in ('[{"messages": []}, {"messages": []}]', "["):
        with pytest.raises(dataset.Invalid, match=r"jq -c '\.\[\]'"):
            dataset.parse_line(text, "a.json", 1)
