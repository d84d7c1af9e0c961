"""Shards: every sample in exactly one, stable when lines are added, kept by a resumed run."""

from __future__ import annotations

from pathlib import Path

import pytest

import json
import shutil

from hs_patch import shard
from hs_patch.host.driver import dataset, runstate
from hs_patch.host.export.run import export, source_entries
from hs_patch.host.export.spec import ExportRefused, ExportSpec
from hs_patch.host.shipping import shipper
from hs_patch.samples import reader, store
from lab.runcheck import assert_complete, write_chats
from lab.drive_runs import drive


def test_every_sample_is_in_exactly_one_shard_and_stays_there():
    ids = [f"chats.jsonl:{i}" for i in range(1, 3001)]
    shards = [shard.parse(f"{i}/3") for i in range(3)]
    owners = {sid: [s.index for s in shards if s.owns(sid)] for sid in ids}
    assert all(len(o) == 1 for o in owners.values())
    sizes = [sum(o == [i] for o in owners.values()) for i in range(3)]
    assert min(sizes) > 900, sizes  # a hash spreads them evenly
    # appending lines moves no sample of the old ones
    more = ids + [f"chats.jsonl:{i}" for i in range(3001, 3500)]
    assert all([s.index for s in shards if s.owns(sid)] == owners[sid] for sid in more[:3000])
    assert shard.parse("0/1").owns("anything") and str(shard.parse(" 2/5 ")) == "2/5"


@pytest.mark.parametrize("bad", ["3/3", "1", "a/b", "-1/2", "0/0", "1/3/4"])
def test_a_bad_shard_is_refused_with_the_form_to_give(bad):
    with pytest.raises(shard.ShardError, match="INDEX/COUNT|index must be|at least 1"):
        shard.parse(bad)


def test_count_lines_counts_the_shard_of_the_first_lines(tmp_path):
    data = tmp_path / "d.jsonl"
    ids = write_chats(data, 50)
    s = shard.parse("1/3")
    assert dataset.count_lines([str(data)], owns=s.owns).lines == sum(s.owns(i) for i in ids)
    assert dataset.count_lines([str(data)], limit=20, owns=s.owns).lines == sum(s.owns(i) for i in ids[:20])
    assert dataset.count_lines([str(data)], limit=20).lines == 20


def test_three_shards_extract_the_dataset_once_and_a_resume_keeps_its_shard(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    ids = write_chats(data, 30, words=8)
    capture = Path(standin.engine.capture.directory)
    got: dict[str, str] = {}
    for i in range(3):
        summary = drive(standin, tiny_model_dir, tmp_path / f"h{i}", [data], shard=f"{i}/3", host_name=f"gpu{i}")
        mine = {sid for sid in ids if shard.parse(f"{i}/3").owns(sid)}
        assert summary.state == "finished" and summary.status["samples"]["total"] == len(mine)
        for sid in assert_complete(tmp_path / f"h{i}" / "samples", capture, mine):
            assert sid not in got, f"{sid} extracted by shards {got[sid]} and {i}"
            got[sid] = str(i)
    assert set(got) == set(ids)
    # each host ships into its own part of the run at storage; the merged view is the whole dataset
    run = tmp_path / "dest" / "run"
    for i in range(3):
        assert shipper.main(["ship", "--samples-dir", str(tmp_path / f"h{i}" / "samples"), "--state-dir",
                             str(tmp_path / f"h{i}" / "state"), "--dest", str(run / f"h{i}")]) == shipper.EXIT_OK
    rep = reader.check_dir(run, deep=True)
    assert rep.clean and len(rep.ok) == len(ids), rep
    for i in range(3):  # where each sample was extracted: in its metadata and in the manifests, here and at storage
        for entry in store.read_manifest(run / f"h{i}").values():
            assert (entry["host"], entry["shard"]) == (f"gpu{i}", f"{i}/3"), entry
            meta = reader.read_header(run / f"h{i}" / entry["file"]).metadata
            assert (meta["host"], meta["shard"]) == (f"gpu{i}", f"{i}/3"), meta
    entries = source_entries(run)  # what the exporters read: the whole run
    assert {e["sample_id"] for e in entries.values()} == set(ids)
    assert all(e["file"].startswith(("h0/samples/", "h1/samples/", "h2/samples/")) for e in entries.values())
    s = export(run, tmp_path / "sf", ExportSpec("specforge"))
    assert s.state == "complete" and s.exported == len(ids) and not s.failed
    # a sample of h0 also in h1 (extracted twice) is refused, by inspect and by the exporters
    e = next(e for e in store.read_manifest(run / "h0").values())
    shutil.copy(run / "h0" / e["file"], run / "h1" / e["file"])
    with open(run / "h1" / store.MANIFEST, "a") as f:
        f.write(json.dumps(e) + "\n")
    rep = reader.check_dir(run, deep=True)
    assert not rep.clean and any(f"sample {e['sample_id']} is also in h0/ (extracted twice)" in p
                                 for p in rep.problems), rep.problems
    with pytest.raises(ExportRefused, match="extracted twice"):
        source_entries(run)
    # a part whose manifest never came (fetch and the shippers write it last: one cut short) is a problem too, not
    # a part left out of a complete export
    (run / "h1" / store.MANIFEST).unlink()
    with pytest.raises(ExportRefused, match="h1/ holds samples but no manifest.jsonl: a part whose fetch or"):
        source_entries(run)
    # the shard is part of the run's identity: a resume with another one is refused
    with pytest.raises(runstate.RunError, match="shard: was '0/3', now '1/3'"):
        drive(standin, tiny_model_dir, tmp_path / "h0", [data], shard="1/3")
