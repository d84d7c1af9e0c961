"""A resume over a dataset that changed: lines appended, removed, changed, moved, another file (reconcile.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hs_patch.host.driver import runstate
from hs_patch.host.driver.run import EXIT_OK
from hs_patch.samples import store
from lab.drive_runs import drive
from lab.runcheck import ledger, write_chats


def chats(path: Path, n: int) -> list[str]:
    write_chats(path, n)
    return path.read_text().splitlines()


def since_last_start(state: Path) -> list[dict]:
    events = ledger(state)
    return events[max(i for i, e in enumerate(events) if e["event"] == "run_start"):]


def held_ids(samples: Path) -> dict[str, str]:
    """key -> sample id of each sample in the samples dir's manifest."""
    return {k: e["sample_id"] for k, e in store.read_manifest(samples).items()}


def vanished(state: Path) -> list[dict]:
    return runstate.read_jsonl(state / "vanished.jsonl")


def test_appended_removed_and_changed_lines_keep_every_sample_still_there(standin, tiny_model_dir, tmp_path):
    """On 784b656 five lines appended while a run read its file made the same command refuse ('Resume it with the
    same parameters, or start a new run with another --run NAME'), and a new run starts from nothing."""
    data, state, samples = tmp_path / "chats.jsonl", tmp_path / "state", tmp_path / "samples"
    lines = chats(data, 8)
    assert drive(standin, tiny_model_dir, tmp_path, [data], limit=6).exit_code == EXIT_OK  # then it stopped
    first = held_ids(samples)
    key_of = {sid: k for k, sid in first.items()}
    # one sample shipped and gone from the samples dir: the shipper's record carries its line's digest
    shipped = key_of["chats.jsonl:3"]
    entry = store.read_manifest(samples)[shipped]
    (samples / entry["file"]).unlink()
    store.Manifest(samples).remove(shipped, reason="shipped")
    with open(state / "shipped.jsonl", "a") as f:
        f.write(json.dumps({"op": "shipped", "key": shipped, "sha256": entry["sha256"], "sample_id": entry["sample_id"],
                            "line_sha256": entry["line_sha256"]}) + "\n")

    # line 2 removed, line 5 changed, three lines appended (and lines 7, 8 never read before)
    extra = chats(tmp_path / "more.jsonl", 11)[8:]
    changed = json.loads(lines[4])
    changed["messages"][1]["content"] += " (fixed)"
    now = [lines[0], lines[2], lines[3], json.dumps(changed), lines[5], lines[6], lines[7], *extra]
    data.write_text("\n".join(now) + "\n")
    summary = drive(standin, tiny_model_dir, tmp_path, [data])
    s = summary.status["samples"]
    assert summary.exit_code == EXIT_OK and (s["total"], s["done_before"], s["done_now"]) == (10, 4, 6), s
    sent = {e["sample_id"] for e in since_last_start(state) if e["event"] == "sent"}
    assert sent == {"chats.jsonl:4", "chats.jsonl:6", "chats.jsonl:7", "chats.jsonl:8", "chats.jsonl:9",
                    "chats.jsonl:10"}  # the changed line, the two never read, the three appended
    gone = vanished(state)
    assert sorted(v["sample_id"] for v in gone) == ["chats.jsonl:2", "chats.jsonl:5"]
    assert {v["key"] for v in gone} == {key_of["chats.jsonl:2"], key_of["chats.jsonl:5"]}
    assert all(v["key"] in held_ids(samples) for v in gone), "a vanished line's sample is kept, never deleted"
    start = since_last_start(state)[0]
    assert [c["name"] for c in start["data_changed"]] == ["chats.jsonl"]
    assert start["held"] == {"kept": 4, "vanished": 2, "moved_to_other_shards": 0, "matched_by_tokens": 0}
    status = json.loads((state / "status.json").read_text())
    assert "2 of lines no longer there (kept, listed in vanished.jsonl)" in status["dataset"]["message"]
    assert runstate.recorded_data(state)[0]["sha256"] == store.file_sha256(data)[1]
    # every sample records its line's digest, the new ones under their line numbers now
    by_id = {e["sample_id"]: e for e in store.read_manifest(samples).values() if e["key"] not in first}
    assert sorted(by_id) == sorted(sent) and all(len(e["line_sha256"]) == 64 for e in by_id.values())

    again = drive(standin, tiny_model_dir, tmp_path, [data])
    assert again.exit_code == EXIT_OK and again.status["samples"]["done_before"] == 10
    assert not [e for e in since_last_start(state) if e["event"] == "sent"]
    assert len(vanished(state)) == 2 and not again.status["dataset"].get("changed")


def test_lines_moved_to_another_shard_and_another_file_are_refused_until_accepted(standin, tiny_model_dir, tmp_path):
    data, state = tmp_path / "chats.jsonl", tmp_path / "state"
    lines = chats(data, 12)
    assert drive(standin, tiny_model_dir, tmp_path, [data], shard="0/2").exit_code == EXIT_OK
    held = len(held_ids(tmp_path / "samples"))
    data.write_text("\n".join(lines[1:]) + "\n")  # the first line removed: every line after it moves
    with pytest.raises(runstate.RunError, match="now in other shards.*--accept-changed-data") as e:
        drive(standin, tiny_model_dir, tmp_path, [data], shard="0/2")
    assert "Restore the file and put new lines at its end" in str(e.value)
    assert not (state / "vanished.jsonl").exists()
    assert runstate.recorded_data(state)[0]["sha256"] != store.file_sha256(data)[1], "refused: the next start asks again"
    summary = drive(standin, tiny_model_dir, tmp_path, [data], shard="0/2", accept_changed_data=True)
    assert summary.exit_code == EXIT_OK
    moved = [v for v in vanished(state) if "another shard" in v["why"]]
    assert moved and all(v["now"] != v["sample_id"] for v in moved)
    assert since_last_start(state)[0]["held"]["moved_to_other_shards"] == len(moved) <= held

    other = tmp_path / "other"
    other.mkdir()
    odata = other / "chats.jsonl"
    odata.write_text("\n".join(chats(tmp_path / "x.jsonl", 20)[14:]) + "\n")  # the same name, other lines
    with pytest.raises(runstate.RunError, match=r"none of the \d+ samples this run holds is of a line in the dataset "
                                                r"now .*another file\?.*--accept-changed-data"):
        drive(standin, tiny_model_dir, tmp_path, [odata], shard="0/2")


def test_samples_without_a_line_digest_are_matched_by_their_tokens(standin, tiny_model_dir, tmp_path):
    """A run of an older driver (no line_sha256): over a changed file its lines are found by their tokens, so
    only the new line is sent; over the same file, by line number as before."""
    data, state, samples = tmp_path / "chats.jsonl", tmp_path / "state", tmp_path / "samples"
    lines = chats(data, 5)
    assert drive(standin, tiny_model_dir, tmp_path, [data]).exit_code == EXIT_OK
    manifest = samples / store.MANIFEST
    manifest.write_text("".join(json.dumps({k: v for k, v in json.loads(x).items() if k != "line_sha256"}) + "\n"
                                for x in manifest.read_text().splitlines()))
    again = drive(standin, tiny_model_dir, tmp_path, [data])
    assert again.status["samples"]["done_before"] == 5 and not any(
        e["event"] in ("sent", "held_by_tokens") for e in since_last_start(state))

    data.write_text("\n".join([*lines, chats(tmp_path / "more.jsonl", 6)[5]]) + "\n")
    summary = drive(standin, tiny_model_dir, tmp_path, [data])
    assert summary.exit_code == EXIT_OK and summary.status["samples"]["done_before"] == 5
    events = since_last_start(state)
    assert [e["sample_id"] for e in events if e["event"] == "sent"] == ["chats.jsonl:6"]
    assert len([e for e in events if e["event"] == "held_by_tokens"]) == 5
    assert events[0]["held"]["matched_by_tokens"] == 5
