"""The capture hook's background writer: turns prefill passes into sample files, each byte once.

Runs in threads of the SGLang server process, never on the forward path. One coordinator
thread takes passes in order (chunked prefill needs the order), splits each into
per-request parts with ``extend_seq_lens``, and hands the file writes to a small pool.
Several passes write at once (up to the number of staging buffers): a pass of one
request, the common case under chunked prefill, is one thread's write and sha256, so
writing passes one after another would cap capture at one core's hashing speed. Passes
are *settled* (published, or discarded after a failure) in pass order by the coordinator.
A pass's staging buffer is given back only when every job that reads it has ended,
whether it succeeded or failed (a buffer reused under a running write would put the next
pass's states into a file under a valid checksum), and a partial file is closed and
removed only when no running write can still touch it.

Each part knows its request's whole prompt length (``orig_seq_lens`` in SGLang's forward
batch), so:

- a part that is its whole request is written complete, hashed as it is written;
- the first part of a longer prompt (chunked prefill) opens an :class:`~hs_patch.server.inplace.InPlaceSample`
  laid out for the whole prompt; every later part (``extend_prefix_len > 0``, the same
  request id where the release has them, starting where the open one ends) writes its
  rows at their final offsets; the job that writes the last part then finishes the file
  (small tensors, header, one hashing read), once the earlier parts' writes have ended, with
  the staging buffer already given back and beside the pass's other writes; the sample is
  published when that pass settles. No chunk is ever read back or rewritten;
- a part with a prefix that continues nothing (a radix-cache hit, a lost chunk) is never
  written as if it were complete: it goes to ``errors.jsonl`` and the log.

What a file holds (planes, ids, the driver's intent: loss mask and provenance, the
fingerprint rows, the header) is :mod:`hs_patch.server.contents`'. A pass's samples become
visible (moved into place + manifest line) only when all of its writes succeeded: a failed
pass leaves nothing in any manifest, and the writer stops (the hook then fails the server
loudly). A sample is never moved over another (:func:`hs_patch.samples.store.publish`): the same
tokens captured twice (a retried request) keep the first file and its manifest line; a
failed manifest append removes the file it would have listed. Anything that ends the
coordinator thread stops capture with its cause (``hook_status.json``, ``errors.jsonl``),
and the forward path raises it at once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from hs_patch.samples import files, store
from hs_patch.server import inplace
from hs_patch.server.contents import Contents
from hs_patch.server.inplace import InPlaceSample, OpenPrompt
from hs_patch.server.ranks import skipped
from hs_patch.server.records import PassRecord, WriterStats, pass_timeline
from hs_patch.server.status import StatusFile, capture_threads

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("hs_patch")
_ENDED = object()  # queued by a pass's last ending job: the coordinator can settle it


@dataclass
class _InFlight:
    """A pass whose writes were handed to the pool; settled in pass order once they all ended."""

    rec: PassRecord
    jobs: list[Future] = field(default_factory=list)
    touched: list[OpenPrompt] = field(default_factory=list)  # partial files this pass writes into
    lost: list[OpenPrompt] = field(default_factory=list)  # open prompts it did not continue
    failure: Optional[BaseException] = None
    ended: bool = False
    left: int = 1  # jobs not yet ended, plus one for the planning
    reading: int = 1  # jobs that still read the staging buffer, plus one for the planning
    lock: threading.Lock = field(default_factory=threading.Lock)
    landed: float = 0.0  # when its copies had landed (time.time())
    written: float = 0.0  # when its last job ended


class Writer:
    """Writes samples of :class:`PassRecord` s in background threads."""

    def __init__(self, directory: str, planes: Sequence[str], metadata: dict[str, str], *,
                 workers: int = 2, skip_rid_prefix: str = "", fsync: bool = False,
                 extra_status: Callable[[], dict[str, Any]] = dict):
        self.directory = files.private_dirs(directory)
        self.planes = list(planes)
        self.skip_rid_prefix = skip_rid_prefix
        self.contents = Contents(self.directory, self.planes, metadata, fsync=fsync)
        self.manifest = store.Manifest(self.directory)
        self.stats = WriterStats()
        self.error: Optional[BaseException] = None
        self.extra_status = extra_status  # the hook's fields in hook_status.json
        self._open: Optional[OpenPrompt] = None
        self.last_pass: dict[str, Any] = {}  # the newest settled pass's timeline (hook_status.json)
        self._doomed: list[OpenPrompt] = []  # partial files of failed passes, removed once no write runs
        self._inflight: "deque[_InFlight]" = deque()
        self._queue: "queue.Queue[Any]" = queue.Queue()  # PassRecords, _ENDED markers, None (close)
        self._waiting = 0  # PassRecords in the queue
        self._handling = False  # the coordinator holds a pass out of both the queue and the in-flight list
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hs_patch-write")
        self._status = StatusFile(self.directory, self._status_doc)
        self._closed = False
        self._stats_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="hs_patch-writer", daemon=True)
        self._write_status(force=True)  # at once: the driver checks where this server writes before it sends
        self._thread.start()

    # ------------------------------------------------------------------ API
    def submit(self, record: PassRecord) -> None:
        if self.error is not None:
            raise RuntimeError(f"hs_patch writer stopped: {self.error}") from self.error
        with self._stats_lock:
            self._waiting += 1
        self._queue.put(record)

    def pending(self) -> int:
        """Passes submitted and not yet settled."""
        return self._waiting + len(self._inflight)

    def stopped(self) -> Optional[BaseException]:
        """Why the writer takes no more passes (None while it works): its error, or its thread's end."""
        if self.error is None and not self._thread.is_alive() and not self._closed:
            self._fail(RuntimeError("the writer's coordinator thread has ended without an error"))
        return self.error

    def close(self, timeout: float = 60.0) -> None:
        """Write everything queued, then stop (used at exit and by tests)."""
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        self._pool.shutdown(wait=True)
        if self._open is not None:  # a prompt whose last chunk never came
            self._open.sample.abandon()
            self._open = None
        self._write_status(force=True)
        if self._thread.is_alive():
            raise RuntimeError(f"hs_patch writer did not finish within {timeout:.0f}s")
        if self.error is not None:
            raise RuntimeError(f"hs_patch writer had failed, so passes after its failure were not written: "
                               f"{self.error}") from self.error

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            self._coordinate()
        except BaseException as e:  # noqa: BLE001 - capture stops loudly, with this cause
            lost = self.pending() + self._handling
            self._fail(RuntimeError(f"the writer's coordinator thread failed ({type(e).__name__}: {e}); the "
                                    f"{lost} prefill passes it had accepted are not written"), cause=e)
            store.log_error(self.directory, {"error": "writer_failed", "passes_lost": lost,
                                             "why": f"{type(e).__name__}: {e}"})

    def _coordinate(self) -> None:
        closing = False
        while not closing or self._inflight:
            item = self._queue.get()
            if item is None:
                closing = True
            elif item is not _ENDED:
                self._handling = True  # counted as lost if what follows fails
                with self._stats_lock:
                    self._waiting -= 1
                self._inflight.append(self._start(item))
                self._handling = False
            while self._inflight and self._inflight[0].ended:
                self._handling = True
                self._settle(self._inflight.popleft())
                self._handling = False
            self._write_status(force=self._idle())

    def _start(self, rec: PassRecord) -> _InFlight:
        """Wait for the pass's copies, split it and submit its writes (nothing after a failure)."""
        p = _InFlight(rec)
        if self.error is None:
            try:
                if rec.wait is not None:
                    rec.wait()
                p.landed = time.time()
                self._plan(rec, p)
            except BaseException as e:  # noqa: BLE001 - settled (and reported) in pass order
                p.failure = e
        p.left += len(p.jobs)
        for job in p.jobs:
            job.add_done_callback(lambda _: self._ended(p))
        self._read(p)  # the planning's share
        self._ended(p)
        return p

    def _read(self, p: _InFlight) -> None:
        """One job of ``p`` no longer reads its staging buffer (any thread); the last gives the buffer back.
        A job that finishes a chunked prompt says so after its rows are written, before it hashes the file."""
        with p.lock:
            p.reading -= 1
            if p.reading:
                return
        if p.rec.release is not None:
            p.rec.release()

    def _ended(self, p: _InFlight) -> None:
        """One job of ``p`` ended (any thread); the last one wakes the coordinator to settle it."""
        with p.lock:
            p.left -= 1
            if p.left:
                return
        p.written = time.time()
        p.ended = True
        self._queue.put(_ENDED)

    def _settle(self, p: _InFlight) -> None:
        """Publish a pass whose writes all ended, or, once anything failed, discard it."""
        failure = p.failure or next((j.exception() for j in p.jobs if j.exception() is not None), None)
        if failure is not None:
            self._fail(failure)
        written = [r for r in (j.result() for j in p.jobs if j.exception() is None) if r is not None]
        if self.error is None:
            try:
                for w, extra in written:
                    if self._publish(w, extra) and extra["parts"] > 1:
                        with self._stats_lock:
                            self.stats.merged += 1
            except BaseException as e:  # noqa: BLE001 - reported to the forward path, then raised there
                self._fail(e)
        if self.error is None:
            for part in p.lost:
                part.sample.abandon()
            with self._stats_lock:
                self.stats.passes += 1
                self.last_pass = pass_timeline(p.rec.queued, p.landed, p.written, int(p.rec.ids.shape[0]),
                                               len(written))
            return
        for w, _ in written:  # a failed writer publishes nothing more
            w.path.unlink(missing_ok=True)
        self._doomed += p.touched + p.lost
        if not self._inflight:  # no write runs any more: partial files can be closed and removed
            if self._open is not None:
                self._doomed.append(self._open)
                self._open = None
            for part in self._doomed:
                part.sample.abandon()
            self._doomed = []

    def _fail(self, e: BaseException, cause: Optional[BaseException] = None) -> None:
        """Stop capture: the hook raises this on the next forward pass (any thread may call this)."""
        if cause is not None:
            e.__cause__ = cause
        with self._stats_lock:
            first = self.error is None
            if first:
                self.error = e
            self.stats.errors += 1
        if first:
            log.error("hs_patch writer failed, capture stops: %s", e, exc_info=cause or e)
            self._write_status(force=True)  # at once: the coordinator may be the thread that died

    def _plan(self, rec: PassRecord, p: _InFlight) -> None:
        """Split the pass per request and submit each part's write."""
        if sum(int(n) for n in rec.seq_lens) != rec.ids.shape[0]:
            raise RuntimeError(f"extend_seq_lens sum to {sum(rec.seq_lens)} but the pass has {rec.ids.shape[0]} tokens")
        fps, css = rec.fingerprints, rec.checksums
        if (fps is not None) != self.contents.fingerprinted or (css is not None) != self.contents.checksummed:
            raise RuntimeError("a pass's fingerprints and the writer's metadata disagree (internal error)")
        touched = p.touched
        opened, self._open = self._open, None
        if opened is not None:
            touched.append(opened)  # if this pass fails, the open prompt goes with it
        offset, at = 0, 0
        for j, (n, prefix, full) in enumerate(zip(rec.seq_lens, rec.prefix_lens, rec.full_lens)):
            n, prefix, full = int(n), int(prefix), int(full)
            s, e = offset, offset + n
            offset = e
            ck = None
            if rec.check_rows is not None and rec.check_counts is not None:
                ck, at = rec.check_rows[at:at + rec.check_counts[j]], at + rec.check_counts[j]
            rid = rec.rids[j] if rec.rids is not None else None
            if skipped(rid, self.skip_rid_prefix):
                with self._stats_lock:
                    self.stats.skipped += 1
                continue
            ids = rec.ids[s:e]
            slices = [p[s:e] for p in rec.planes]
            fp = None if fps is None else fps[:, s:e].permute(1, 0, 2)  # [n, streams, BLOCKS]
            cs = None if css is None else css[:, s:e].permute(1, 0, 2)  # [n, checksums, BLOCKS]
            sc = None if rec.scales is None else rec.scales[:, s:e]  # fp8: [planes, n]
            if prefix == 0 and n == full:
                self._submit(p, self.contents.write_whole, ids, slices, rid, fp, cs, ck, sc)
                continue
            if prefix == 0:
                part = self.contents.start_open(ids, full, rid, slices[0])
            elif opened is not None and opened.end == prefix and opened.sample.tokens == full and (
                    rid is None or opened.rid == rid):
                part, opened = opened, None
                part.parts += 1
                part.starts.append(prefix)
            else:
                self._error()
                inplace.report_partial_prefill(self.directory, rid, prefix, n, ids, opened)
                continue
            touched.append(part)
            part.hasher.update(store.ids_bytes(ids))
            part.ids.append(ids.clone())
            for rows, into in ((fp, part.fingerprints), (cs, part.checksums), (sc, part.scales)):
                if rows is not None:
                    # a copy (never a view: with one-row staging buffers the rows are contiguous already and
                    # .contiguous() would alias the buffer the next pass overwrites)
                    into.append(rows.clone() if rows.is_contiguous() else rows.contiguous())
            part.end = prefix + n
            if part.end == full and ck is not None:
                part.check = ck.clone()  # the staging buffer is given back before the file is finished
            if part.end == full:  # its last chunk: written, then the file finished in the same job
                self._submit(p, self._put_and_finish, p, part, prefix, slices, list(part.writes), releases=True)
                continue
            part.writes.append(self._submit(p, self._put, part.sample, prefix, slices))
            if self._open is not None:
                raise RuntimeError("two prompts of one pass are cut by chunked prefill; SGLang keeps at most one "
                                   "(--enable-deterministic-inference aligns cuts otherwise: it is refused)")
            self._open = part
        if opened is not None:  # the open prompt did not continue in this pass: its next chunk is lost
            p.lost.append(opened)  # removed when this pass settles: an earlier pass may still write into it
            self._error()
            inplace.report_lost(self.directory, opened)

    # ------------------------------------------------------------------ jobs
    def _put(self, sample: InPlaceSample, start: int, slices: list["torch.Tensor"]) -> None:
        self.contents.put(sample, start, slices)

    def _submit(self, p: _InFlight, fn: Callable[..., Any], *args: Any, releases: bool = False) -> Future:
        """A job of pass ``p``; it reads the staging buffer (counted before it can end) until it ends, or,
        with ``releases``, until it calls :meth:`_read` itself."""
        with p.lock:
            p.reading += 1
        job = self._pool.submit(fn, *args) if releases else self._pool.submit(self._reading, p, fn, *args)
        p.jobs.append(job)
        return job

    def _reading(self, p: _InFlight, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        finally:
            self._read(p)

    def _put_and_finish(self, p: _InFlight, part: OpenPrompt, start: int, slices: list["torch.Tensor"],
                        earlier: list[Future]) -> tuple[store.Written, dict[str, Any]]:
        """A chunked prompt's last chunk: its rows written (the staging buffer is free of this job then), its
        earlier chunks' writes ended (jobs submitted before this one: running or done, never waiting for a
        thread), then the small tensors, the header and one hashing read, as one of its pass's jobs: the
        sample is published when the pass settles, and its finishing overlaps the pass's other writes
        instead of starting after them (the writer's latency at the end of a burst: issue #22)."""
        try:
            self._put(part.sample, start, slices)
        finally:
            self._read(p)
        for job in earlier:
            job.result()  # an earlier chunk's failure fails its own pass first; re-raised here, never lost
        return self.contents.complete(part)

    def _publish(self, w: store.Written, extra: dict[str, Any]) -> bool:
        """Move the sample into place and list it; False if the same tokens' sample was already there."""
        try:
            final = store.publish(w, self.directory)
        except store.AlreadyPublished as e:  # a retried request, two clients: the first capture stays
            with self._stats_lock:
                self.stats.duplicates += 1
            log.warning("hs_patch: %s", e)
            store.log_error(self.directory, {"error": "duplicate", "key": w.key, "rid": extra.get("rid"),
                                             "why": "a sample of these tokens is already in the capture dir "
                                                    "(a retried request, or two clients sent the same tokens); "
                                                    "the first capture is kept"})
            return False
        try:
            self.manifest.add(final, **extra)
        except BaseException:
            final.path.unlink(missing_ok=True)  # never a sample in place that no manifest line describes
            raise
        with self._stats_lock:
            self.stats.samples += 1
            self.stats.tokens += extra["tokens"]
            self.stats.bytes += final.nbytes
            self.stats.with_intent += "sample_id" in extra
        return True

    # ------------------------------------------------------------------ errors and status
    def _error(self) -> None:
        with self._stats_lock:
            self.stats.errors += 1

    def _idle(self) -> bool:
        """Nothing queued or in flight: every pass so far is settled and its samples published."""
        with self._stats_lock:
            return not self._waiting and not self._inflight

    def _write_status(self, force: bool = False) -> None:
        """hook_status.json: at most every 2 s while passes come, and at once when the writer is idle
        (its last pass settled, every sample of it published), so a reader between bursts (fab status,
        the GPU sweep's per-row waits) never sees a count from the middle of the last one."""
        self._status.write(force)

    def _status_doc(self) -> dict[str, Any]:
        st = self.stats
        return {"directory": str(self.directory), "passes": st.passes, "samples": st.samples, "tokens": st.tokens,
                "bytes": st.bytes, "merged": st.merged, "skipped": st.skipped, "errors": st.errors,
                "with_intent": st.with_intent, "duplicates": st.duplicates, "skip_rid_prefix": self.skip_rid_prefix,
                "queued": self.pending(), "error": None if self.error is None else str(self.error),
                "last_pass": self.last_pass, "threads": capture_threads(), **self.extra_status()}
