"""The lines a run does not hold when it ends, and why: ``missing.jsonl`` and ``status.json["missing"]``.

Written by the driver as it ends (not when it fails as a whole): one JSON line for each line
of its input (its shard) that it does not hold, ``{"sample_id", "why", "retry"}``: a rejected
line (bad input, the reason from rejects.jsonl: rejected again on every run until the line
changes, and no longer listed once it has), or a sample that failed in this run (its stage and error, and in how many runs it
has failed so far). ``retry`` says whether running the same command again can extract it: not
for a rejected line, nor for a failure that comes from the line itself (the server refused the
request, HTTP 4xx; the provenance is over the intent's limit). Lines the driver never reached
because it stopped are counted (``not_attempted``), not listed. ``status.json["missing"]``
holds the counts and the first :data:`SHOWN` entries: ``fab extract``/``fab status`` end
non-zero with them (docs/driver.md).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hs_patch.host.driver import runstate
from hs_patch.samples.files import write_text_atomic

FILE = "missing.jsonl"
SHOWN = 10
_FAILED_OR_START = re.compile(rb'"event": ?"(?:failed|run_start)"')


@dataclass(frozen=True)
class Failure:
    stage: str
    error: str
    retry: bool = True   # False: it fails the same way on every run (the line, or the server's limits, must change)


def runs_failed(ledger: Path, ids: set[str]) -> dict[str, int]:
    """In how many runs of the ledger (this one included) each of ``ids`` failed."""
    runs: dict[str, set[int]] = {}
    if not ids or not ledger.exists():
        return {}
    run = 0
    with open(ledger, "rb") as f:
        for raw in f:
            if not _FAILED_OR_START.search(raw):
                continue
            try:
                e = json.loads(raw)
            except ValueError:
                continue  # a torn last line
            if e.get("event") == "run_start":
                run += 1
            elif e.get("sample_id") in ids:
                runs.setdefault(e["sample_id"], set()).add(run)
    return {k: len(v) for k, v in runs.items()}


def account(state_dir: Path, failures: dict[str, Failure], not_attempted: int,
            rejects: list[dict[str, Any]]) -> dict[str, Any]:
    """Write ``missing.jsonl``; the summary for status.json (counts, and the first entries). ``rejects``: this
    pass's (``RejectLog.now``), not every line ever rejected (one fixed since is held now)."""
    entries = [{"sample_id": r.get("sample_id", f"{r.get('source')}:{r.get('line')}"), "retry": False,
                "why": f"rejected: {r.get('reason')} ({r.get('detail', '')})"[:300]}
               for r in sorted(rejects, key=lambda r: (str(r.get("source")), int(r.get("line") or 0)))]
    rejected = len(entries)
    repeats = runs_failed(state_dir / runstate.LEDGER, set(failures))
    for sid, f in sorted(failures.items()):
        n = max(1, repeats.get(sid, 1))
        entries.append({"sample_id": sid, "retry": f.retry, "runs_failed": n,
                        "why": f"failed at {f.stage}: {f.error}"[:300] + (f" (failed in {n} runs)" if n > 1 else "")})
    write_text_atomic(state_dir / FILE, "".join(json.dumps(e, sort_keys=True) + "\n" for e in entries))
    return {"lines": len(entries) + not_attempted, "rejected": rejected, "failed": len(failures),
            "not_attempted": not_attempted, "never": sum(not e["retry"] for e in entries), "shown": entries[:SHOWN]}


def describe(m: dict[str, Any]) -> str:
    """How many lines are missing and how many of them can never be extracted as they are ("" if none)."""
    if not m["lines"]:
        return ""
    parts = [f"{m[k]} {w}" for k, w in (("rejected", "rejected"), ("failed", "failed"),
                                         ("not_attempted", "not attempted")) if m[k]]
    never = f", {m['never']} of them can never be extracted as they are" if m["never"] else ""
    return f"{m['lines']} line(s) not held ({', '.join(parts)}{never}: {FILE} says which and why)"
