"""An export's own records and files: ``export.json``, ``export.jsonl``, rows, stale files.

``export.json`` (rewritten atomically) holds what the export is (format, layers, fp8,
source, the serving ids per SGLang release) and its ``state``: ``in-progress`` from the
first change of a run until every sample is in place (and speculators' table written),
then ``complete``. ``export.jsonl`` is an append-only :class:`hs_patch.samples.store.Manifest`: one
``add`` per exported file (``file``, ``bytes``, ``sha256``, the source's ``src_sha256``,
``row`` for speculators), ``remove`` when a sample left the source. Files a trainer would
pick up but that no live entry names (an older run's, a crash's) are deleted: SpecForge
trains on every ``*.ckpt`` under its directory, speculators on every row.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from hs_patch.samples import store

INFO = "export.json"
LOG = "export.jsonl"
LOCK = ".hs-export.lock"
SF_DIR = "samples"
HS_DIR, HS_DIR_FP8 = "hidden_states", "hidden_states_fp8"


def hs_dir(fp8: bool) -> str:
    """FP8 files go to their own directory: speculators' default ``file`` backend reads
    ``<data>/hidden_states`` and would train on unscaled fp8 values without an error."""
    return HS_DIR_FP8 if fp8 else HS_DIR


def rel_path(fmt: str, key: str, row: Optional[int], fp8: bool) -> str:
    if fmt == "specforge":
        return f"{SF_DIR}/{key}.ckpt"
    return f"{hs_dir(fp8)}/hs_{row}{store.SUFFIX}"


class ExportLock:
    """One export run per destination (flock; released when the process ends)."""

    def __init__(self, dst: Path):
        dst.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(dst / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise RuntimeError(f"{dst}: another hs-extract export runs into it; wait for it to end") from None

    def close(self) -> None:
        os.close(self.fd)


def read_info(dst: Path) -> dict[str, Any]:
    p = dst / INFO
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise RuntimeError(f"{p}: unreadable ({e}); it was not written by hs-extract export") from None


def write_info(dst: Path, info: Mapping[str, Any]) -> None:
    store.write_text_atomic(dst / INFO, json.dumps(info, indent=1, sort_keys=True) + "\n")


def live_entries(dst: Path) -> dict[str, dict[str, Any]]:
    return store.read_manifest(dst, LOG)


@dataclass
class Plan:
    """Where each source sample goes; what was removed or moved to get there."""

    rows: dict[str, Optional[int]] = field(default_factory=dict)   # key -> row (None: SpecForge)
    removed: list[str] = field(default_factory=list)
    moved: list[tuple[str, int, int]] = field(default_factory=list)
    swept: list[str] = field(default_factory=list)


def plan(dst: Path, fmt: str, fp8: bool, src_keys: list[str], log: store.Manifest,
         before_rows_change: Callable[[], None] = lambda: None) -> Plan:
    """Drop what left the source, keep rows dense (speculators pairs row i with hs_i), sweep strays.

    Surviving samples keep their row; rows beyond the new count move into the holes
    (a rename and a new ``add``), new samples fill the remaining holes in key order.
    ``before_rows_change`` runs before the first speculators file is deleted or moved (the
    export withdraws its table there: a crash mid-way must not leave it pairing rows with
    other samples' files).
    """
    live = live_entries(dst)
    wanted = set(src_keys)
    p = Plan()
    if fmt != "specforge" and (set(live) - wanted or any(int(e["row"]) >= len(src_keys) for e in live.values())):
        before_rows_change()
    for key in sorted(set(live) - wanted):
        (dst / live[key]["file"]).unlink(missing_ok=True)
        log.remove(key, reason="not in the source any more")
        p.removed.append(key)
        del live[key]
    if fmt == "specforge":
        p.rows = {k: None for k in src_keys}
    else:
        rows = {k: int(e["row"]) for k, e in live.items()}
        n = len(src_keys)
        holes = sorted(set(range(n)) - set(rows.values()))
        movers = sorted((r, k) for k, r in rows.items() if r >= n)
        p.swept = sweep(dst, fmt, fp8, {e["file"] for e in live.values()})
        for (old, key), new in zip(movers, holes):
            src, target = dst / live[key]["file"], dst / rel_path(fmt, key, new, fp8)
            if src.exists():
                os.replace(src, target)
                log.append({**{k: v for k, v in live[key].items() if k != "t"}, "row": new,
                            "file": rel_path(fmt, key, new, fp8), "moved_from": old})
            rows[key] = new
            p.moved.append((key, old, new))
        free = iter(sorted(set(range(n)) - set(rows.values())))
        for key in src_keys:
            if key not in rows:
                rows[key] = next(free)
        p.rows = rows
        return p
    p.swept = sweep(dst, fmt, fp8, {e["file"] for e in live.values()})
    return p


def sweep(dst: Path, fmt: str, fp8: bool, keep: set[str]) -> list[str]:
    """Delete files a trainer would read that no live entry names, and our temporary files."""
    out: list[str] = []
    if fmt == "specforge":
        found = [p for p in dst.rglob("*") if p.is_file() and p.name.endswith((".ckpt", ".ckpt.gz"))]
    else:
        found = [p for d in (HS_DIR, HS_DIR_FP8) for p in (dst / d).glob(f"*{store.SUFFIX}")]
    for p in found:
        rel = p.relative_to(dst).as_posix()
        if rel not in keep:
            p.unlink()
            out.append(rel)
    for tmp in dst.rglob(f"{store.TMPDIR}/*.tmp"):
        tmp.unlink(missing_ok=True)
    for table in (dst / store.TMPDIR).glob("table.*"):   # a crashed run's table build (we hold the lock)
        shutil.rmtree(table, ignore_errors=True)
    return out
