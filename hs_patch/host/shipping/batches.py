"""The shipper's batch loop: what to ship, in which batches, and what to record.

Batches are pipelined: while the destination verifies batch N (sha256 of every file,
:mod:`hs_patch.host.shipping.at_destination`), rsync already sends batch N+1, so hashing costs no link
time. A batch's files are recorded as shipped, and deleted here, only once its
verification has answered.

Outages: a destination that cannot be reached (refused, timed out, reset, a failing
command there) is waited for, however long, with capped exponential backoff and jitter
(``--backoff-max``); the status says ``waiting_for_destination`` with the outage's start,
failures and last error, and the SSH connection is reopened. Only refusals that waiting
cannot cure (host key, authentication, unknown host, the storage host's gate or verify step
refusing: :attr:`LinkError.permanent`) end a one-off shipper (exit 1): they are configuration
errors, and nothing unverified is deleted. Under ``--follow`` (the run's unit) they are tried
again every ``--refused-retry`` seconds instead, the status saying ``refused_by_destination``, so a fix
is picked up by itself and the storage host is not tried every few seconds by unit restarts.

At start the shipper reads the destination's manifest and records every sample there
that ``shipped.jsonl`` lacks (``"from": "destination"``, with its ``sample_id``), so a GPU
host that lost its samples directory and its records (a reboot empties /dev/shm) never
redoes or replaces what training storage already holds.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hs_patch.host.shipping.link import RSYNC_PER_FILE, Commit, Link, LinkError, SshOptions
from hs_patch.samples import store

from hs_patch.host.driver.runstate import DONE as DONE_MARKER  # noqa: E402
from hs_patch.host.driver.runstate import SHIPPED as SHIPPED_LOG  # noqa: E402
from hs_patch.host.driver.runstate import read_shipped  # noqa: E402

STATUS_FILE = "shipper_status.json"
EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNVERIFIED = 0, 1, 2, 3
WAITING = "waiting_for_destination"
REFUSED = "refused_by_destination"   # --follow: a refusal waiting cannot cure, tried again every --refused-retry
# A sample another shipper of the same destination wrote meanwhile (``raced``: a reassigned shard and its host
# back, at an S3 prefix or an rsync destination) is decided again after a pause (jittered, so two shippers stop
# meeting), not counted as a failed transfer, for this long after its first race; each race after that counts as one.
RACE_PAUSE = (0.5, 2.0)
RACE_GRACE_SECONDS = 120.0


@dataclass
class ShipConfig:
    samples_dir: Path
    state_dir: Path
    dest: Any                       # link.Dest (rsync over SSH, or a local directory) or bucket.BucketDest (s3://)
    ssh: SshOptions = field(default_factory=SshOptions)
    s3: Any = None                  # bucket.S3Options for an s3:// destination
    follow: bool = False
    until_file: Path | None = None  # default <state-dir>/driver.done
    poll_seconds: float = 2.0
    batch_files: int = 200
    batch_bytes: int = 512 << 20
    retries: int = 3                # transfers of one file before it is given up as unverifiable
    bwlimit_kbps: int = 0
    backoff_max: float = 60.0       # longest wait between two tries of an unreachable destination
    refused_retry: float = 300.0    # --follow: wait before trying again a refusal waiting cannot cure
    verify_deep: bool = False       # at start, every file the destination holds hashed again (not only size/mtime)

    @property
    def done_marker(self) -> Path:
        return self.until_file or self.state_dir / DONE_MARKER


@dataclass
class Pending:
    key: str
    entry: dict[str, Any]  # the local manifest's op: add record
    path: Path
    inode: int             # to never delete a file replaced since it was queued
    mtime_ns: int          # told to the destination: a copy landed there with another is another shipper's


@dataclass
class InFlight:
    """A batch rsync has sent, whose verification runs on the destination."""

    batch: list[Pending]
    commit: Commit
    rsync_rc: int
    rsync_err: str


class Shipper:
    def __init__(self, cfg: ShipConfig):
        self.cfg = cfg
        self.shipped = read_shipped(cfg.state_dir / SHIPPED_LOG)
        self.shipped_log = store.Manifest(cfg.state_dir, SHIPPED_LOG)
        self.local_manifest = store.Manifest(cfg.samples_dir)
        self.attempts: dict[tuple[str, str], int] = {}  # (key, sha256) -> failed verifications
        self.failed: dict[str, str] = {}        # key -> why it is given up
        self.raced: dict[tuple[str, str], float] = {}  # (key, sha256) -> its first race (monotonic)
        self.not_before: dict[str, float] = {}  # key -> when a raced sample is sent again (monotonic)
        self.missing_local: list[str] = []      # listed, not shipped, and no file
        self.pending: list[Pending] = []
        self.inflight: InFlight | None = None
        self.run_files = self.run_bytes = 0
        self.busy_seconds = 0.0
        self.last_error: str | None = None
        self.outage: dict[str, Any] | None = None   # since, failures, last_error, retry_in_s, refused
        self.from_destination = 0                   # samples recorded from the destination's manifest
        self.checked: dict[str, Any] | None = None  # the start's check of what the destination holds
        self.damaged: list[dict[str, Any]] = []     # found damaged or missing there by it (key, file, why)
        self.stop_requested = False

    # ------------------------------------------------------------------ local side

    def scan(self) -> list[Pending]:
        """Samples the manifest lists that still have to be shipped, oldest first."""
        self.pending, self.missing_local = [], []
        busy = {p.key for p in self.inflight.batch} if self.inflight else set()
        for key, entry in store.read_manifest(self.cfg.samples_dir).items():
            name = entry.get("file", "")
            if Path(name).name != name or name.startswith(".") or not name.endswith(store.SUFFIX):
                self.failed[key] = f"manifest names {name!r}: not a sample file of the samples directory"
                continue
            path = self.cfg.samples_dir / name
            done = self.shipped.get(key)
            if done is not None and done["sha256"] == entry["sha256"] and (done.get("from") != "destination"
                                                                          or not path.exists()):
                self.drop_local(key, path, None)  # verified by this shipper before the run was cut
                continue
            # a record taken from the destination's manifest alone is not a verification of the copy
            # there: while a local copy exists, it is verified there (and re-sent if lost) first
            if key in busy or self.attempts.get((key, entry["sha256"]), 0) >= self.cfg.retries:
                continue  # being verified, or given up (listed in self.failed)
            try:
                st = path.stat()
            except FileNotFoundError:
                self.missing_local.append(key)
                continue
            self.pending.append(Pending(key, entry, path, st.st_ino, st.st_mtime_ns))
        return self.pending

    def drop_local(self, key: str, path: Path, inode: int | None) -> None:
        """Delete a shipped sample's local file and record the removal in its manifest."""
        try:
            if inode is not None and path.stat().st_ino != inode:
                return  # replaced by a newer version of the sample: that one ships on its own
            path.unlink()
        except FileNotFoundError:
            pass
        self.local_manifest.remove(key, reason="shipped")

    def record_shipped(self, p: Pending, kept: dict[str, Any] | None = None) -> None:
        """``kept``: the destination's own copy of the sample (bytes, sha256) that stays there."""
        e = dict(p.entry, **({"bytes": kept["bytes"], "sha256": kept["sha256"]} if kept else {}))
        rec = {"op": "shipped", "key": p.key, "file": e["file"], "bytes": e["bytes"],
               "sha256": e["sha256"], "t": round(time.time(), 3)}
        rec.update({k: e[k] for k in ("sample_id", "line_sha256") if e.get(k)})  # what the driver resumes by
        if kept:
            rec["kept"] = "destination"
        self.shipped_log.append(rec)
        self.shipped[p.key] = rec
        self.failed.pop(p.key, None)
        self.not_before.pop(p.key, None)
        self.drop_local(p.key, p.path, p.inode)

    # ------------------------------------------------------------------ batches

    def ready(self) -> list[Pending]:
        """The pending samples that may be sent now (not those pausing after a race)."""
        now = time.monotonic()
        return [p for p in self.pending if self.not_before.get(p.key, 0.0) <= now]

    def next_batch(self) -> tuple[list[Pending], bool]:
        """Up to batch_files / batch_bytes samples (at least one). Files that failed a
        verification go first, in a batch of their own that resends whatever is there."""
        ready = self.ready()
        retry = [p for p in ready if self.attempts.get((p.key, p.entry["sha256"]))]
        batch, size = [], 0
        for p in retry or ready:
            if batch and (len(batch) >= self.cfg.batch_files or size + p.entry["bytes"] > self.cfg.batch_bytes):
                break
            batch.append(p)
            size += p.entry["bytes"]
        return batch, bool(retry)

    def send_batch(self, link: Link) -> InFlight:
        """rsync the next batch and start its verification on the destination."""
        batch, recheck = self.next_batch()
        rc, err = link.send(self.cfg.samples_dir, [p.entry["file"] for p in batch], recheck=recheck)
        if rc not in RSYNC_PER_FILE:
            raise LinkError(f"rsync to {self.cfg.dest} failed (exit {rc}): {err}")
        files = [{"file": p.entry["file"], "bytes": p.entry["bytes"], "sha256": p.entry["sha256"],
                  "mtime_ns": p.mtime_ns, "entry": p.entry} for p in batch]
        return InFlight(batch, link.start_commit(files), rc, err)

    def finish_batch(self, done: InFlight) -> None:
        """Wait for a batch's verification; record what matched, count what did not."""
        for p, res in zip(done.batch, done.commit.wait(), strict=True):
            if res["status"] == "kept":
                print(f"hs-ship: {p.entry['file']}: {kept_words(p.entry, res)}", file=sys.stderr)
                self.record_shipped(p, kept=res)
                continue
            if res["status"] == "ok":
                self.record_shipped(p)
                self.run_files += 1
                self.run_bytes += p.entry["bytes"]
                continue
            version = (p.key, p.entry["sha256"])
            if res["status"] == "raced" and self.pause_raced(p, version, res.get("why") or ""):
                continue
            self.attempts[version] = n = self.attempts.get(version, 0) + 1
            detail = res.get("why") or f"rsync exit {done.rsync_rc}{': ' + done.rsync_err if done.rsync_err else ''}"
            why = (f"{p.entry['file']}: {res['status']} at the destination after transfer {n} of "
                   f"{self.cfg.retries} ({detail})")
            self.last_error = why
            if n >= self.cfg.retries:
                self.failed[p.key] = why + "; local copy kept"
            print(f"hs-ship: {why}", file=sys.stderr)

    def pause_raced(self, p: Pending, version: tuple[str, str], why: str) -> bool:
        """Whether a sample another shipper wrote meanwhile waits to be decided again (True), uncounted; after
        RACE_GRACE_SECONDS of races each counts as a failed transfer (False)."""
        now = time.monotonic()
        if now - self.raced.setdefault(version, now) >= RACE_GRACE_SECONDS:
            return False
        self.not_before[p.key] = now + random.uniform(*RACE_PAUSE)
        print(f"hs-ship: {p.entry['file']}: {why or 'another shipper landed its copy at the destination meanwhile'}"
              "; decided again shortly", file=sys.stderr)
        return True

    def step(self, link: Link) -> bool:
        """Send the next batch (unless stopping) while the previous one is verified, then
        record the previous one. Whether the destination answered a verification (an S3 batch's
        failures show only then: its whole round runs in the background)."""
        started = self.send_batch(link) if self.ready() and not self.stop_requested else None
        previous, self.inflight = self.inflight, started
        if previous is not None:
            self.finish_batch(previous)
        return previous is not None

    # ------------------------------------------------------------------ status

    def write_status(self, state: str) -> None:
        doc = {
            "state": state, "pid": os.getpid(), "updated": round(time.time(), 3),
            "samples_dir": str(self.cfg.samples_dir), "dest": str(self.cfg.dest),
            "shipped": {"count": len(self.shipped), "bytes": sum(r["bytes"] for r in self.shipped.values()
                                                                  if type(r.get("bytes")) is int)},
            "this_run": {"count": self.run_files, "bytes": self.run_bytes, "busy_seconds": round(self.busy_seconds, 3)},
            "pending": {"count": len(self.pending), "bytes": sum(p.entry["bytes"] for p in self.pending)},
            "verifying": len(self.inflight.batch) if self.inflight else 0,
            "throughput_bytes_per_s": round(self.run_bytes / self.busy_seconds) if self.busy_seconds else None,
            "failed": self.failed, "missing_local": self.missing_local, "last_error": self.last_error,
            "outage": self.outage, "from_destination": self.from_destination, "checked": self.checked,
            "damaged": self.damaged,
        }
        store.write_text_atomic(self.cfg.state_dir / STATUS_FILE, json.dumps(doc, indent=1, sort_keys=True))

    # ------------------------------------------------------------------ main loop

    def pause(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while not self.stop_requested and time.monotonic() < deadline:
            time.sleep(min(0.2, seconds))

    def ride_out(self, e: LinkError, link: Link) -> None:
        """Wait out an outage of the destination (any length). A refusal that waiting cannot cure (``permanent``)
        ends a one-off shipper (``e`` raised: exit 1); under ``--follow`` it is retried every
        ``--refused-retry`` seconds, the status saying ``refused_by_destination``, so a fix made there (a key, the storage
        host's hs-patch) is picked up by itself, and a unit that would restart on the exit does not try the storage
        host every few seconds (its sshd may ban the address for failed logins)."""
        if e.permanent and not self.cfg.follow:
            raise e
        now = time.time()
        o = self.outage = self.outage or {"since": round(now, 3), "failures": 0}
        o["failures"] += 1
        o["refused"] = e.permanent
        if e.permanent:
            delay = self.cfg.refused_retry
            print(f"hs-ship: refused by the destination (try {o['failures']}): {e}; waiting cannot cure this: fix it "
                  f"there or in the shipper's settings; tried again in {delay:.0f}s (nothing is lost)", file=sys.stderr)
        else:
            delay = min(self.cfg.backoff_max, 2.0 ** min(o["failures"], 30)) * random.uniform(0.5, 1.0)
            print(f"hs-ship: the destination is unreachable or failing (for {now - o['since']:.0f}s, failure "
                  f"{o['failures']}): {e}; nothing is lost, retrying in {delay:.0f}s", file=sys.stderr)
        o.update(last_error=str(e)[-600:], retry_in_s=round(delay, 1), seconds=round(now - o["since"], 1))
        self.last_error = str(e)
        self.write_status(REFUSED if e.permanent else WAITING)
        self.pause(delay)
        if not link.alive() and not self.stop_requested and not e.permanent:  # a refusal: the next try reopens, once
            try:
                link.reopen()
            except LinkError as again:
                if again.permanent and not self.cfg.follow:
                    raise
                self.last_error = o["last_error"] = str(again)[-600:]
                o["refused"] = again.permanent

    def connect(self, link: Link) -> bool:
        """Open the link, check the destination (reachable, writable, python3) and record what it
        holds; ride out outages. False if stopped by a signal first."""
        while not self.stop_requested:
            try:
                if not link.alive():
                    link.reopen()
                found = link.check_destination(self.cfg.verify_deep)
                self.note_damaged(found.get("damaged") or [])
                self.checked = {"files": found.get("checked", 0), "deep": self.cfg.verify_deep,
                                "damaged": len(found.get("damaged") or []), "t": round(time.time(), 3)}
                self.sync_destination(found["entries"])
                self.outage = None
                return True
            except LinkError as e:
                self.ride_out(e, link)
        return False

    def note_damaged(self, damaged: list[dict[str, Any]]) -> None:
        """Samples the destination held that its check found damaged or missing (moved aside there and dropped
        from its manifest): one with a local copy is shipped again; one shipped and deleted here is recorded
        ``lost`` in shipped.jsonl, so the driver's next start of the run extracts it again."""
        for d in damaged:
            key = d.get("key")
            lost = isinstance(key, str) and key in self.shipped
            if lost:
                self.shipped_log.append({"op": "lost", "key": key, "file": d.get("file"), "why": d.get("why"),
                                         "t": round(time.time(), 3)})
                del self.shipped[key]
            self.damaged.append(dict(d, lost=lost))
            print(f"hs-ship: {d.get('file')} at {self.cfg.dest} is damaged: {d.get('why')}; dropped from the "
                  "destination's manifest" + ("; the run's next start extracts it again" if lost else
                                              "; shipped again from here if this host still has it"),
                  file=sys.stderr)

    def sync_destination(self, entries: list[dict[str, Any]]) -> None:
        """Record in shipped.jsonl each sample the destination holds that it does not list (as is),
        except those still here: they are verified at the destination before their local copy goes
        (the destination's manifest may list a file lost or damaged there since)."""
        local = {key for key, entry in store.read_manifest(self.cfg.samples_dir).items()
                 if (self.cfg.samples_dir / Path(str(entry.get("file") or "")).name).is_file()}
        for e in entries:
            key, name = e.get("key"), Path(str(e.get("file") or "")).name
            if not isinstance(key, str) or not name or self.shipped.get(key, {}).get("sha256") == e.get("sha256") \
                    or key in local:
                continue
            if type(e.get("bytes")) is not int or not isinstance(e.get("sha256"), str):
                print(f"hs-ship: the destination's manifest lists {key} without bytes or sha256: not counted as "
                      f"shipped (hs-patch inspect {self.cfg.dest.path} names the line)", file=sys.stderr)
                continue
            rec = {"op": "shipped", "key": key, "file": name, "bytes": e.get("bytes"), "sha256": e.get("sha256"),
                   "t": round(time.time(), 3), "from": "destination"}
            rec.update({k: e[k] for k in ("sample_id", "line_sha256") if e.get(k)})
            self.shipped_log.append(rec)
            self.shipped[key] = rec
            self.from_destination += 1

    def run(self, link: Link) -> int:
        if not self.connect(link):
            return EXIT_OK
        try:
            while True:
                finished = not self.cfg.follow or self.cfg.done_marker.exists()  # before the scan
                self.scan()
                if self.inflight is None and not self.ready():
                    if self.stop_requested or (finished and not self.pending):
                        break
                    self.write_status("waiting")
                    self.pause(min([self.cfg.poll_seconds] + [t - time.monotonic() for p in self.pending
                                                              if (t := self.not_before.get(p.key))]))
                    continue
                if self.inflight is None and self.stop_requested:
                    break
                self.write_status(  # an outage lasts until a batch answers
                    (REFUSED if self.outage.get("refused") else WAITING) if self.outage else "shipping")
                t0 = time.monotonic()
                try:
                    answered = self.step(link)
                    self.busy_seconds += time.monotonic() - t0
                    if self.outage is not None and answered:
                        print(f"hs-ship: the destination is back after {time.time() - self.outage['since']:.0f}s",
                              file=sys.stderr)
                        self.outage = None
                except LinkError as e:
                    self.ride_out(e, link)
        finally:
            if self.inflight is not None:  # given up or interrupted: a restart verifies it again
                self.inflight.commit.kill()
                self.inflight = None
        if self.missing_local:
            self.last_error = (f"{len(self.missing_local)} samples are listed in {self.cfg.samples_dir}/"
                               f"{store.MANIFEST} but their files are gone and were never shipped, e.g. "
                               f"{self.missing_local[0]}: something deleted them without an op: remove line")
            return EXIT_ERROR
        return EXIT_UNVERIFIED if self.failed or any(d["lost"] for d in self.damaged) else EXIT_OK


def kept_words(ours: dict[str, Any], kept: dict[str, Any]) -> str:
    """Why the destination keeps its own copy of a sample this shipper brought again: another job
    shipped it (a dead host's shard finished by another host, then the dead host back), or this
    one did before its host lost its local state."""
    run, host = kept.get("run"), kept.get("host")
    if (run and run != ours.get("run")) or (host and ours.get("host") and host != ours.get("host")):
        by = " of ".join(x for x in (f"host {host}" if host else "", f"run {run}" if run else "") if x)
        return (f"the destination already holds this sample, shipped by {by} (this shard was given to another host "
                "while this one was out): that copy is kept, this host's is dropped")
    return ("the destination already holds this sample (shipped before this host lost its local state): its copy "
            "is kept, the local redo is dropped")
