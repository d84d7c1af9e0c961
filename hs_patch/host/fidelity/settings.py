"""What a run's fidelity check is, as every sample and the run record it, and what weakens it.

The driver puts :func:`settings` into each sample's intent, so the capture writer writes it
into the sample's header (``fidelity_check``); the check's result goes into the run's samples
manifest (``fidelity`` on the sample's ``add`` line: :func:`result`) and ``fidelity.jsonl``;
``run.json`` keeps the check each start of the run used. A resume under a weaker check than
the run's (off, fewer rows per chunk, fewer positions, a smaller sampled fraction, a looser
tie tolerance) would mix samples checked less with the others; the driver refuses it unless
told ``--accept-weaker-check`` (then the ledger says so, and each sample still says how it was
checked).
"""

from __future__ import annotations

from typing import Any, Mapping

# 1: the same-pass top-1 of the final state only (before issue #25); 2: + every plane's rows;
# 3: + a top-1 disagreement within one bf16 unit of the server's logits is a tie (#26: SGLang's argmax over
#    its bf16 logits takes the lower id of two equal ones; 2 failed such samples on every run)
# 4: + every row's bytes by checksum, every row's embedding, the additive relation, relations judged per chunk,
#    the server's logit gaps at the last positions of every sample (#33)
VERSION = 4


def settings(on: bool, *, rows: int, fraction: float, positions: int, tie_tolerance: float,
             gap_positions: int = 0) -> dict[str, Any]:
    """The check as a record (what ``--no-fidelity-check`` and the ``--fidelity-*`` options made it)."""
    if not on:
        return {"version": VERSION, "on": False}
    return {"version": VERSION, "on": True, "rows_per_chunk": rows, "fraction": fraction, "positions": positions,
            "tie_tolerance": tie_tolerance, "gap_positions": gap_positions}


def weaker(new: Mapping[str, Any], old: Mapping[str, Any]) -> list[str]:
    """How ``new`` checks less than ``old`` (empty: as much or more)."""
    if not old.get("on", True):
        return []
    if not new.get("on"):
        return ["the check is off (--no-fidelity-check)"]
    out = []
    if int(new.get("version", 1)) < int(old.get("version", 1)):
        out.append(f"check version {new.get('version')} < {old.get('version')}")
    for name, flag, less in (("rows_per_chunk", "--fidelity-rows", True), ("positions", "--fidelity-positions", True),
                             ("gap_positions", "--fidelity-gap-positions", True),
                             ("fraction", "--fidelity-fraction", True),
                             ("tie_tolerance", "--fidelity-tie-tolerance", False)):
        # "not as strict": a value that compares false both ways (nan) is weaker too
        if name in old and name in new and not (new[name] >= old[name] if less else new[name] <= old[name]):
            out.append(f"{flag} {new[name]} (the run used {old[name]})")
    return out


def result(check: Any) -> dict[str, Any]:
    """The few fields of a check's result that go on the sample's manifest line."""
    rows = check.rows or {}
    return {"check": VERSION, "ok": check.ok, "rows": rows.get("rows", 0), "chunks": rows.get("chunks", 0),
            "kind": check.kind, "positions": check.checked, "ties": check.ties, "gaps": check.gaps}
