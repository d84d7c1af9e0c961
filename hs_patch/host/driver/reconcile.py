"""A resume over a dataset that changed: keep the samples of the lines still there, say what vanished.

Datasets grow and get cleaned while a run goes on (lines appended, removed, fixed). Every sample
records the sha256 of the dataset line it was made from (``line_sha256``: its header, its manifest
line, the shipper's record), so at each start the driver reads the dataset once more and finds, by
that digest, the line each sample it holds belongs to now, wherever the line moved:

- **kept**: the sample's line is still in the dataset (the same text; its number may have changed):
  not sent again; its line counts as done.
- **vanished**: no line of the dataset has that text any more (removed, or changed: a changed line
  is a new line, extracted anew). The sample stays where it is (the samples dir, the destination:
  the driver deletes nothing it made); ``vanished.jsonl`` in the state dir lists each (sample id,
  key, line sha256), and the start says how many.
- **moved to another shard** (``--shard`` runs): the line is still there, but lines inserted or
  removed before it gave it a number that another shard owns, whose host would extract it again.
- **no digest** (samples of a driver before this one): matched as their lines are read, by their
  tokens (``sample_steps``), or by line number while the data files are the ones the run last
  started with.

Refused unless ``--accept-changed-data``: lines moved to other shards (their hosts would redo
them: append new lines at the end instead), and a dataset that holds none of the run's samples'
lines (another file given by mistake?). Everything else goes on by itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hs_patch.host.driver import datafile, dataset, runstate
from hs_patch.samples.files import write_text_atomic

VANISHED = "vanished.jsonl"
SHOWN = 5  # sample ids named in a message


@dataclass
class Reconciled:
    by_id: dict[str, str] = field(default_factory=dict)        # the dataset's sample id now -> key of its sample
    kept: int = 0
    vanished: list[dict[str, str]] = field(default_factory=list)   # {sample_id, key, line_sha256}
    moved: list[dict[str, str]] = field(default_factory=list)      # ... and now: the line's sample id now
    by_tokens: int = 0        # samples without a digest, matched by their tokens as their lines are read

    def summary(self) -> dict[str, int]:
        return {"kept": self.kept, "vanished": len(self.vanished), "moved_to_other_shards": len(self.moved),
                "matched_by_tokens": self.by_tokens}

    def refusal(self) -> Optional[str]:
        """Why the run cannot go on over this dataset by itself (None: it can)."""
        if self.moved:
            names = ", ".join(f"{m['sample_id']} (now {m['now']})" for m in self.moved[:SHOWN])
            return (f"{len(self.moved)} of the samples this shard holds are of lines now in other shards: lines were "
                    f"inserted or removed before them, and a shard is chosen by line number, so the hosts of those "
                    f"shards would extract them again ({names}). Restore the file and put new lines at its end, or "
                    "pass --accept-changed-data to go on (they are listed in vanished.jsonl)")
        if self.vanished and not self.kept and not self.by_tokens:
            names = ", ".join(v["sample_id"] for v in self.vanished[:SHOWN])
            return (f"none of the {len(self.vanished)} samples this run holds is of a line in the dataset now ({names} "
                    "...): another file? Give the run's own (run.json names it), start a new run with another --run "
                    "NAME, or pass --accept-changed-data to extract this dataset into the same run (the samples it "
                    "holds stay, listed in vanished.jsonl)")
        return None

    def write(self, state_dir: Path) -> None:
        """``vanished.jsonl``: the samples held for lines the dataset no longer has (removed when there is none)."""
        path = state_dir / VANISHED
        gone = [dict(v, why="no line of the dataset has this text now") for v in self.vanished] + \
            [dict(m, why=f"the line is now {m['now']}, in another shard") for m in self.moved]
        if gone:
            write_text_atomic(path, "".join(json.dumps(g, sort_keys=True) + "\n" for g in gone), fsync=True)
        else:
            path.unlink(missing_ok=True)


def reconcile(done: runstate.DoneState, paths: list[str], max_chars: int, owns: Optional[Callable[[str], bool]],
              *, same_files: bool) -> Reconciled:
    """Where each held sample's line is in the dataset now (one read of the files, a sha256 a line).
    ``same_files``: the data files are byte for byte those the run last started with (then a sample without a
    digest still holds its line number)."""
    out = Reconciled()
    by_digest = {d: key for key, d in done.lines.items()}
    mine: set[str] = set()
    elsewhere: dict[str, str] = {}
    if by_digest:
        for p in paths:
            name = dataset.source_name(p)
            for item in datafile.lines(p, max_chars):
                if not isinstance(item, datafile.Line) or not item.text.strip():
                    continue
                key = by_digest.get(dataset.line_digest(item.text))
                if key is None:
                    continue
                sid = f"{name}:{item.number}"
                if owns is None or owns(sid):
                    out.by_id.setdefault(sid, key)
                    mine.add(key)
                else:
                    elsewhere.setdefault(key, sid)
    for key, sid in done.by_key.items():
        digest = done.lines.get(key)
        if digest is None:
            if same_files and done.by_id.get(sid) == key:
                out.by_id.setdefault(sid, key)
                out.kept += 1
            else:
                out.by_tokens += 1
        elif key in mine:
            out.kept += 1
        elif key in elsewhere:
            out.moved.append({"sample_id": sid, "key": key, "line_sha256": digest, "now": elsewhere[key]})
        else:
            out.vanished.append({"sample_id": sid, "key": key, "line_sha256": digest})
    return out


def data_changes(before: Any, now: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The data files that differ from those the run last started with: [{name, was, now}] (sha256s; None for a
    file added or no longer given)."""
    was = {d.get("name"): d.get("sha256") for d in before or [] if isinstance(d, dict)}
    cur = {d["name"]: d["sha256"] for d in now}
    return [{"name": n, "was": was.get(n), "now": cur.get(n)} for n in sorted(set(was) | set(cur))
            if was.get(n) != cur.get(n)]


def describe(rec: Reconciled, changes: list[dict[str, Any]]) -> str:
    """One line for the journal and the dashboard: what changed and what it means for the run."""
    what = f"{', '.join(c['name'] for c in changes)} changed since the last start; " if changes else ""
    parts = [f"{rec.kept} held sample(s) kept"]
    if rec.vanished:
        parts.append(f"{len(rec.vanished)} of lines no longer there (kept, listed in {VANISHED})")
    if rec.moved:
        parts.append(f"{len(rec.moved)} of lines now in other shards ({VANISHED})")
    if rec.by_tokens:
        parts.append(f"{rec.by_tokens} made by an older driver, matched by their tokens as their lines are read")
    return what + ", ".join(parts) + "; new and changed lines are extracted"
