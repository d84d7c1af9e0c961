"""A run's state on disk: parameters, lock, ledger, and what is already done (resume).

Layout of ``--state-dir`` (default ``/var/lib/hs-patch/runs/<run>``):

- ``run.json``      the run's identity parameters; a restart with different ones is refused
- ``lock``          held (flock) while a driver works on the run
- ``ledger.jsonl``  every decision, one JSON object a line: ``{"t", "event", ...}``
- ``rejects.jsonl`` input lines that cannot become samples (file, line, reason)
- ``status.json``   progress, rewritten every few seconds
- ``shipped.jsonl`` written by the shipper: ``{"op": "shipped", "key", "sha256"}`` per sample
  verified at the destination, ``{"op": "lost", "key", "why"}`` for one its check found damaged
  or missing there later (then it is not done: the next start extracts it again)

Done = a sample whose final file in the samples dir matches its manifest entry (size +
sha256), or whose key and sha256 the shipper recorded as verified at the destination.
Sample ids come from the samples dir's manifest (each final sample's ``add`` line carries
its ``sample_id``), so a crash between writing a sample and writing the ledger loses nothing.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from hs_patch.samples import store
from hs_patch.samples.files import JsonLog, write_text_atomic

RUN_JSON, LEDGER, REJECTS, STATUS, SHIPPED, LOCK = (
    "run.json", "ledger.jsonl", "rejects.jsonl", "status.json", "shipped.jsonl", "lock")
LINE_SHA256 = "line_sha256"  # a sample's field (header, manifest line, shipped.jsonl): the sha256 of its dataset line
# Written by the driver when it has finished a pass over the data (nothing more will come
# this time), removed when a driver starts; ``hs-extract ship --follow`` stops on it.
DONE = "driver.done"


class RunError(RuntimeError):
    """The run cannot start as asked; the message says what to do."""


class Ledger(JsonLog):
    """Append-only ``ledger.jsonl``: one whole line per event (a full disk raises, leaves no torn line)."""

    def write(self, event: str, **fields: Any) -> None:
        self.append({"t": round(time.time(), 3), "event": event, **fields})

    def close(self) -> None:
        """Nothing is held open between events (kept for callers that close a ledger)."""


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Records of a JSON-lines file, skipping unreadable (torn) lines; [] if it does not exist."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for raw in p.read_bytes().splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def take_lock(path: str | os.PathLike, what: str, owner: str = "") -> int:
    """An exclusive flock on ``path`` (kept until the process exits or the fd is closed); refused
    naming who holds it."""
    fd, holder = try_lock(path, owner)
    if fd is None:
        raise RunError(f"{what} is in use by {holder} ({path}); wait for it to finish or stop it first")
    return fd


def try_lock(path: str | os.PathLike, owner: str = "") -> tuple[int | None, str]:
    """(the fd of an exclusive flock on ``path``, "") or (None, who holds it). The lock file says
    ``pid N`` and ``owner`` (e.g. the run) while held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = Path(path).read_text().strip() or "another process"
        os.close(fd)
        return None, holder
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}{f' ({owner})' if owner else ''}".encode())
    return fd, ""


def check_params(state_dir: Path, params: Mapping[str, Any]) -> bool:
    """Write run.json for a new run; for an existing one refuse different parameters, unless it
    never sent a sample (then nothing depends on them and they are replaced). The data files
    (``data``) may differ: the driver reconciles what the run holds with them (``reconcile.py``)
    and records them with :func:`record_data`.

    Returns True if the run already existed (a resume).
    """
    path = state_dir / RUN_JSON
    if path.exists():
        old = json.loads(path.read_text())["params"]
        diff = {k: (old.get(k), params.get(k)) for k in sorted(set(old) | set(params))
                if old.get(k) != params.get(k) and k != "data"}
        if not diff:
            return True
        if sent_anything(state_dir, Path(str(old.get("samples_dir") or state_dir))):
            lines = "\n".join(f"  {k}: was {a!r}, now {b!r}" for k, (a, b) in diff.items())
            raise RunError(f"run {params['run']!r} already exists in {state_dir} with other parameters:\n{lines}\n"
                           "Resume it with the same parameters, or start a new run with another --run NAME.")
    write_text_atomic(path, json.dumps({"params": dict(params), "created": time.time()}, indent=2, sort_keys=True),
                      fsync=True)
    return False


def recorded_data(state_dir: Path) -> Any:
    """The data files the run last started with (run.json's ``params.data``)."""
    return json.loads((state_dir / RUN_JSON).read_text())["params"].get("data")


def record_data(state_dir: Path, data: list[dict[str, Any]]) -> None:
    """Record the data files this start reconciled the run with (the next start compares with them)."""
    path = state_dir / RUN_JSON
    doc = json.loads(path.read_text())
    doc["params"]["data"] = data
    write_text_atomic(path, json.dumps(doc, indent=2, sort_keys=True), fsync=True)


def check_fidelity(state_dir: Path, check: Mapping[str, Any], *, accept_weaker: bool) -> list[str]:
    """Record this start's fidelity check in run.json; refuse one weaker than any the run used before,
    unless ``accept_weaker`` (then how it is weaker is returned, for the ledger)."""
    from hs_patch.host.fidelity.settings import weaker

    path = state_dir / RUN_JSON
    doc = json.loads(path.read_text())
    used = doc.get("fidelity_checks") or []
    why = sorted({w for old in used for w in weaker(check, old["check"])})
    if why and not accept_weaker:
        raise RunError(f"run {doc['params'].get('run')!r} was checked more strictly than this start would: "
                       f"{'; '.join(why)}. Its samples so far passed the stricter check; run with the same fidelity "
                       "options, or pass --accept-weaker-check to mix them knowingly (each sample records its check)")
    if not used or used[-1]["check"] != dict(check):
        doc["fidelity_checks"] = used + [{"t": round(time.time(), 3), "check": dict(check)}]
        write_text_atomic(path, json.dumps(doc, indent=2, sort_keys=True), fsync=True)
    return why


_SENT_OR_DONE = re.compile(rb'"event": ?"(?:sent|done)"')


def sent_anything(state_dir: Path, samples_dir: Path) -> bool:
    """Whether a run ever sent a sample to the server or has one (done, listed, or shipped)."""
    if any(r.get("op") == "add" for r in store.manifest_records(samples_dir)) or read_shipped(state_dir / SHIPPED):
        return True
    ledger = state_dir / LEDGER
    if not ledger.exists():
        return False
    with open(ledger, "rb") as f:
        return any(_SENT_OR_DONE.search(raw) for raw in f)


@dataclass
class DoneState:
    by_id: dict[str, str] = field(default_factory=dict)    # sample_id -> key (the dataset's lines now: reconcile.py)
    by_key: dict[str, str] = field(default_factory=dict)   # key -> sample_id (the line it was made from)
    lines: dict[str, str] = field(default_factory=dict)    # key -> sha256 of that line (absent: an older driver's)
    live: int = 0          # verified in the samples dir
    shipped: int = 0       # verified at the destination by the shipper
    discarded: list[str] = field(default_factory=list)     # what was thrown away, and why


def read_shipped(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """key -> record of the samples the shipper verified at the destination (the last one of a key), less those
    it found damaged or missing there since (``op: lost``, the last word on a key: extracted again)."""
    out: dict[str, dict[str, Any]] = {}
    for r in read_jsonl(path):
        if isinstance(r.get("key"), str) and r.get("op") == "shipped":
            out[r["key"]] = r
        elif isinstance(r.get("key"), str) and r.get("op") == "lost":
            out.pop(r["key"], None)
    return out


def load_done(samples_dir: Path, shipped_path: Path, *, workers: int = 4) -> DoneState:
    """What is complete and verified; damaged, unlisted and temporary files are removed."""
    st = DoneState()
    samples_dir.mkdir(parents=True, exist_ok=True)
    tmp = samples_dir / store.TMPDIR
    if tmp.exists():
        if any(tmp.iterdir()):
            st.discarded.append(f"{tmp}: partial writes of an interrupted run")
        shutil.rmtree(tmp)
    records = list(store.manifest_records(samples_dir))
    live: dict[str, dict[str, Any]] = {}
    for rec in records:
        if rec.get("op") == "add":
            live[rec["key"]] = rec
        elif rec.get("op") == "remove":
            live.pop(rec.get("key"), None)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        problems = dict(zip(live, pool.map(lambda e: store.verify_entry(samples_dir, e), live.values())))
    manifest = store.Manifest(samples_dir)

    def hold(key: str, rec: Mapping[str, Any]) -> None:
        st.by_id.setdefault(rec["sample_id"], key)  # a live sample before a shipped one of the same line
        st.by_key[key] = rec["sample_id"]
        if rec.get(LINE_SHA256) and isinstance(rec[LINE_SHA256], str):
            st.lines[key] = rec[LINE_SHA256]

    for key, entry in live.items():
        if problems[key] is None and entry.get("sample_id"):
            hold(key, entry)
            st.live += 1
        elif problems[key] is not None:
            (samples_dir / entry["file"]).unlink(missing_ok=True)
            manifest.remove(key, reason="failed verification on resume", detail=problems[key])
            st.discarded.append(problems[key])
    listed = set(live)
    for p in samples_dir.glob(f"*{store.SUFFIX}"):
        if p.name[: -len(store.SUFFIX)] not in listed:
            p.unlink()
            st.discarded.append(f"{p}: no manifest entry (written by an interrupted run)")
    shipped = read_shipped(shipped_path)
    for rec in records:
        key = rec.get("key")
        if rec.get("op") == "add" and rec.get("sample_id") and key not in live and key in shipped \
                and shipped[key].get("sha256", "") in ("", rec["sha256"]):
            if key not in st.by_key:
                st.shipped += 1
            hold(key, rec)
    # shipped samples the local manifest no longer knows (a reboot emptied /dev/shm): the shipper
    # recorded their sample ids and lines (and, at its start, every sample the destination's manifest holds)
    for key, rec in shipped.items():
        sid = rec.get("sample_id")
        if isinstance(sid, str) and sid and key not in st.by_key and key not in live:
            hold(key, rec)
            st.shipped += 1
    return st


_SENT_KEY = re.compile(rb'"event": ?"(?:sent|regen_turn)".*"key": ?"([0-9a-f]+)"')


def run_keys(ledger_path: Path, among: set[str]) -> set[str]:
    """The keys in ``among`` that this run sent to the server (captures and regeneration
    prompts), found with one regular expression per ledger line (the ledger is long)."""
    if not among or not ledger_path.exists():
        return set()
    found = set()
    with open(ledger_path, "rb") as f:
        for raw in f:
            m = _SENT_KEY.search(raw)
            if m and m.group(1).decode() in among:
                found.add(m.group(1).decode())
    return found


class ShippedTail:
    """Counts the keys in ``shipped.jsonl`` as it grows (read incrementally)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.keys: set[str] = set()
        self._offset = 0

    def refresh(self) -> set[str]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return self.keys
        if size < self._offset:
            self.keys, self._offset = set(), 0
        if size > self._offset:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(size - self._offset)
            complete = data[: data.rfind(b"\n") + 1]  # an incomplete last line is read next time
            self._offset += len(complete)
            for raw in complete.splitlines():
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(rec, dict) and rec.get("op") == "shipped" and "key" in rec:
                    self.keys.add(rec["key"])
                elif isinstance(rec, dict) and rec.get("op") == "lost" and "key" in rec:
                    self.keys.discard(rec["key"])
        return self.keys
