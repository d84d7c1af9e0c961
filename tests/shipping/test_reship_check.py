"""A re-ship checks what the destination holds (issue #37): every start stats each file the destination's
manifest lists against the size and mtime recorded when it was verified; --verify-deep computes each digest
again. Before: after a verified file was flipped and another truncated at the storage host, a re-ship said
"hs-ship: done" and noticed nothing, while docs/shipping.md said it re-verifies."""

from __future__ import annotations

import os

from hs_patch.host.driver import runstate
from hs_patch.host.shipping import shipper
from hs_patch.samples import store
from lab.sample_files import flip_byte
from lab.ship_runs import dirs, make_samples, ship_cmd, shipped_records, status


def _shipped(tmp_path, n=4):
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, n, sample_ids=True)
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK
    return samples, state, dest, written


def test_a_reship_notices_a_flipped_and_a_truncated_file_and_has_them_extracted_again(tmp_path, capsys):
    samples, state, dest, written = _shipped(tmp_path)
    flipped, cut = (dest / "samples" / w.path.name for w in written[:2])
    flip_byte(flipped, 200)                                  # a write: its mtime moves
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size - 7)
    capsys.readouterr()

    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_UNVERIFIED
    err = capsys.readouterr().err
    assert f"{flipped.name} at {dest} is damaged: written since it was verified" in err, err
    assert f"{cut.name} at {dest} is damaged: size" in err and "truncated or rewritten" in err
    assert "2 samples shipped earlier are damaged or missing at the destination" in err.splitlines()[-1]
    assert "the run's next start (the same fab extract) extracts them again" in err
    # the destination now lists only what is intact; the damaged files are kept aside, not deleted
    assert set(store.read_manifest(dest)) == {w.key for w in written[2:]}
    assert sorted(p.name.rsplit(".", 1)[0] for p in (dest / ".damaged").iterdir()) == sorted([flipped.name, cut.name])
    # the driver's view: those two are not done any more, the others are
    done = runstate.load_done(samples, state / runstate.SHIPPED)
    assert set(done.by_key) == {w.key for w in written[2:]}
    assert runstate.ShippedTail(state / runstate.SHIPPED).refresh() == {w.key for w in written[2:]}
    lost = [r for r in store.read_jsonl(state / shipper.SHIPPED_LOG) if r["op"] == "lost"]
    assert sorted(r["key"] for r in lost) == sorted(w.key for w in written[:2])
    st = status(state)
    assert st["checked"]["files"] == 4 and st["checked"]["damaged"] == 2 and not st["checked"]["deep"]
    assert {d["key"] for d in st["damaged"]} == {w.key for w in written[:2]}

    # said once: the next re-ship finds the destination consistent
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK
    assert "hs-ship: done (2 files at the destination checked: size and mtime/ETag as verified" in \
        capsys.readouterr().err


def test_a_flip_that_kept_size_and_mtime_is_found_by_the_deep_check_only(tmp_path, capsys):
    samples, state, dest, written = _shipped(tmp_path, 3)
    victim = dest / "samples" / written[1].path.name
    st = victim.stat()
    flip_byte(victim, 300)
    os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))  # bit rot: the file system noticed nothing
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK  # the cheap check cannot see it
    capsys.readouterr()
    assert shipper.main(ship_cmd(samples, state, str(dest), "--verify-deep")) == shipper.EXIT_UNVERIFIED
    err = capsys.readouterr().err
    assert f"{victim.name} at {dest} is damaged: its content no longer has the verified digest" in err, err
    assert status(state)["checked"] == dict(status(state)["checked"], files=3, deep=True, damaged=1)
    assert set(store.read_manifest(dest)) == {written[0].key, written[2].key}
    assert shipper.main(ship_cmd(samples, state, str(dest), "--verify-deep")) == shipper.EXIT_OK


def test_a_damaged_sample_still_here_is_shipped_again_not_lost(tmp_path, capsys):
    """The destination's copy is damaged while this host still has the sample (its local copy is kept until
    verified): it is sent again and nothing is recorded lost."""
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 2, sample_ids=True)
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK
    again = make_samples(samples, 1, start=5, sample_ids=True)
    # shipped by another shipper of the same run (a state dir lost) and then damaged there, the local one kept
    assert shipper.main(ship_cmd(samples, tmp_path / "other-state", str(dest))) == shipper.EXIT_OK
    restored = make_samples(samples, 1, start=5, sample_ids=True)
    assert restored[0].sha256 == again[0].sha256
    flip_byte(dest / "samples" / again[0].path.name, 100)
    capsys.readouterr()
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK
    assert "shipped again from here if this host still has it" in capsys.readouterr().err
    assert not [r for r in shipped_records(state) if r["op"] == "lost"]
    assert store.verify_entry(dest, store.read_manifest(dest)[again[0].key]) is None
    assert set(store.read_manifest(dest)) == {w.key for w in written + again}


def test_a_file_touched_or_copied_without_its_times_is_not_damage(tmp_path, capsys):
    """The cheap check took any new mtime for a rewrite: storage copied or restored without its times (cp -r, a
    backup tool) had every sample moved aside as damaged and the whole run extracted again. A new mtime now has the
    file hashed: the same bytes keep it (its new time recorded, so the next check is cheap again); other bytes are
    damage as before (the test above)."""
    samples, state, dest, written = _shipped(tmp_path, 3)
    touched = dest / "samples" / written[0].path.name
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    capsys.readouterr()
    assert shipper.main(ship_cmd(samples, state, str(dest))) == shipper.EXIT_OK
    assert "damaged" not in capsys.readouterr().err
    assert set(store.read_manifest(dest)) == {w.key for w in written} and not (dest / ".damaged").exists()
    assert store.read_manifest(dest)[written[0].key]["mtime_ns"] == touched.stat().st_mtime_ns
