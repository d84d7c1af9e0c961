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
  rows at their final offsets; the last part finishes the file (small tensors, header,
  one hashing read). No chunk is ever read back or rewritten;
- a part with a prefix that continues nothing (a radix-cache hit, a lost chunk) is never
  written as if it were complete: it goes to ``errors.jsonl`` and the log.

The driver's intent (``hs_patch.intent``: loss mask and provenance, keyed by the sample's
content key) is read when a sample completes and written into it. A pass's samples
become visible (rename + manifest line) only when all of its writes succeeded: a failed
pass leaves nothing in any manifest, and the writer stops (the hook then fails the
server loudly).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from hs_patch import intent as intents
from hs_patch import store
from hs_patch.server.inplace import InPlaceSample, OpenPrompt

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("hs_patch")
STATUS_FILE = "hook_status.json"
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # SGLang's /health_generate probes (sglang.srt.constants)
_ENDED = object()  # queued by a pass's last ending job: the coordinator can settle it


def skipped(rid: Optional[str], prefix: str) -> bool:
    """Requests the hook does not capture: the configured prefix and SGLang's health checks."""
    return rid is not None and (str(rid).startswith(HEALTH_CHECK_PREFIX) or bool(prefix) and str(rid).startswith(prefix))


@dataclass
class PassRecord:
    """One prefill pass on host memory, as the hook hands it over."""

    ids: "torch.Tensor"                 # int64 [T], CPU
    planes: Sequence["torch.Tensor"]    # [T, H] each, CPU, in plane order
    seq_lens: Sequence[int]
    prefix_lens: Sequence[int]
    full_lens: Sequence[int]            # each request's whole prompt length (SGLang's orig_seq_lens)
    rids: Optional[Sequence[str]] = None
    wait: Optional[Callable[[], None]] = None     # blocks until the copies have landed
    release: Optional[Callable[[], None]] = None  # gives the staging buffer back


@dataclass
class _InFlight:
    """A pass whose writes were handed to the pool; settled in pass order once they all ended."""

    rec: PassRecord
    jobs: list[Future] = field(default_factory=list)
    finish: list[OpenPrompt] = field(default_factory=list)  # chunked prompts this pass completes
    touched: list[OpenPrompt] = field(default_factory=list)  # partial files this pass writes into
    lost: list[OpenPrompt] = field(default_factory=list)  # open prompts it did not continue
    failure: Optional[BaseException] = None
    ended: bool = False
    left: int = 1  # jobs not yet ended, plus one for the planning
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass
class WriterStats:
    passes: int = 0
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    merged: int = 0
    skipped: int = 0
    errors: int = 0
    with_intent: int = 0
    started: float = field(default_factory=time.time)


class Writer:
    """Writes samples of :class:`PassRecord` s in background threads."""

    def __init__(self, directory: str, planes: Sequence[str], metadata: dict[str, str], *,
                 workers: int = 2, skip_rid_prefix: str = "", fsync: bool = False):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.planes = list(planes)
        self.metadata = dict(metadata)
        self.hidden = int(metadata.get("hidden_size", 0) or 0)
        self.skip_rid_prefix = skip_rid_prefix
        self.fsync = fsync
        self.manifest = store.Manifest(self.directory)
        self.stats = WriterStats()
        self.error: Optional[BaseException] = None
        self.extra_status: Callable[[], dict[str, Any]] = dict
        self._open: Optional[OpenPrompt] = None
        self._doomed: list[OpenPrompt] = []  # partial files of failed passes, removed once no write runs
        self._inflight: "deque[_InFlight]" = deque()
        self._queue: "queue.Queue[Any]" = queue.Queue()  # PassRecords, _ENDED markers, None (close)
        self._waiting = 0  # PassRecords in the queue
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hs_patch-write")
        self._finishing: list[Future] = []
        self._status_at = 0.0
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

    def close(self, timeout: float = 60.0) -> None:
        """Write everything queued, then stop (used at exit and by tests)."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._pool.shutdown(wait=True)
        if self._open is not None:  # a prompt whose last chunk never came
            self._open.sample.abandon()
            self._open = None
        self._write_status(force=True)
        if self._thread.is_alive():
            raise RuntimeError(f"hs_patch writer did not finish within {timeout:.0f}s")

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        closing = False
        while not closing or self._inflight:
            item = self._queue.get()
            if item is None:
                closing = True
            elif item is not _ENDED:
                with self._stats_lock:
                    self._waiting -= 1
                self._inflight.append(self._start(item))
            while self._inflight and self._inflight[0].ended:
                self._settle(self._inflight.popleft())
            self._write_status()

    def _start(self, rec: PassRecord) -> _InFlight:
        """Wait for the pass's copies, split it and submit its writes (nothing after a failure)."""
        p = _InFlight(rec)
        if self.error is None:
            try:
                if rec.wait is not None:
                    rec.wait()
                self._plan(rec, p)
            except BaseException as e:  # noqa: BLE001 - settled (and reported) in pass order
                p.failure = e
        p.left += len(p.jobs)
        for job in p.jobs:
            job.add_done_callback(lambda _: self._ended(p))
        self._ended(p)  # the planning's share
        return p

    def _ended(self, p: _InFlight) -> None:
        """One job of ``p`` ended (any thread); the last one gives the buffer back and wakes the coordinator."""
        with p.lock:
            p.left -= 1
            if p.left:
                return
        if p.rec.release is not None:  # no job reads the staging buffer any more
            p.rec.release()
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
                    self._publish(w, extra)
            except BaseException as e:  # noqa: BLE001 - reported to the forward path, then raised there
                self._fail(e)
        if self.error is None:
            for part in p.finish:  # chunked prompts complete: small tensors, header, one hashing read
                self._finishing.append(self._pool.submit(self._finish, part))
            self._finishing = [f for f in self._finishing if not f.done()]
            for part in p.lost:
                part.sample.abandon()
            with self._stats_lock:
                self.stats.passes += 1
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

    def _fail(self, e: BaseException) -> None:
        """Stop capture: the hook raises this on the next forward pass (any thread may call this)."""
        with self._stats_lock:
            first = self.error is None
            if first:
                self.error = e
            self.stats.errors += 1
        if first:
            log.error("hs_patch writer failed, capture stops: %s", e, exc_info=e)

    def _plan(self, rec: PassRecord, p: _InFlight) -> None:
        """Split the pass per request and submit each part's write."""
        if sum(int(n) for n in rec.seq_lens) != rec.ids.shape[0]:
            raise RuntimeError(f"extend_seq_lens sum to {sum(rec.seq_lens)} but the pass has {rec.ids.shape[0]} tokens")
        jobs, finish, touched = p.jobs, p.finish, p.touched
        opened, self._open = self._open, None
        if opened is not None:
            touched.append(opened)  # if this pass fails, the open prompt goes with it
        offset = 0
        for j, (n, prefix, full) in enumerate(zip(rec.seq_lens, rec.prefix_lens, rec.full_lens)):
            n, prefix, full = int(n), int(prefix), int(full)
            s, e = offset, offset + n
            offset = e
            rid = rec.rids[j] if rec.rids is not None else None
            if skipped(rid, self.skip_rid_prefix):
                with self._stats_lock:
                    self.stats.skipped += 1
                continue
            ids = rec.ids[s:e]
            slices = [p[s:e] for p in rec.planes]
            if prefix == 0 and n == full:
                jobs.append(self._pool.submit(self._write_whole, ids, slices, rid))
                continue
            if prefix == 0:
                part = self._start_open(ids, full, rid, slices[0])
            elif opened is not None and opened.end == prefix and opened.sample.tokens == full and (
                    rid is None or opened.rid == rid):
                part, opened = opened, None
                part.parts += 1
            else:
                self._reject(rid, prefix, n, ids, opened)
                continue
            touched.append(part)
            part.hasher.update(store.ids_bytes(ids))
            part.ids.append(ids.clone())
            jobs.append(self._pool.submit(self._put, part.sample, prefix, slices))
            part.end = prefix + n
            if part.end == full:
                finish.append(part)
            elif self._open is not None:
                raise RuntimeError("two prompts of one pass are cut by chunked prefill; SGLang keeps at most one "
                                   "(--enable-deterministic-inference aligns cuts otherwise: it is refused)")
            else:
                self._open = part
        if opened is not None:  # the open prompt did not continue in this pass: its next chunk is lost
            p.lost.append(opened)  # removed when this pass settles: an earlier pass may still write into it
            self._lost(opened)

    # ------------------------------------------------------------------ jobs
    def _start_open(self, ids: "torch.Tensor", full: int, rid: Optional[str], like: "torch.Tensor") -> OpenPrompt:
        sample = InPlaceSample(self.directory, f"open-{store.sample_key(ids)[:12]}", self.planes, full,
                               like.shape[1], store.dtype_name(like))
        return OpenPrompt(sample, 0, store.key_hasher(), rid, [], 1, str(like.dtype).replace("torch.", ""))

    def _put(self, sample: InPlaceSample, start: int, slices: list["torch.Tensor"]) -> None:
        for k, (name, t) in enumerate(zip(self.planes, slices)):
            sample.put(k, start, store.raw_bytes(name, t))

    def _meta(self, key: str, n: int, dtype: str, rid: Optional[str], parts: int,
              found: Optional[intents.Intent]) -> dict[str, str]:
        meta = dict(self.metadata, key=key, num_tokens=str(n), parts=str(parts), dtype=dtype,
                    rid="" if rid is None else str(rid), created=f"{time.time():.3f}")
        if found is not None:
            meta.update({k: v for k, v in found.metadata.items() if k not in meta}, loss_tokens=str(found.loss_tokens))
        return meta

    def _tail(self, ids: "torch.Tensor", found: Optional[intents.Intent]) -> list[store.TensorBytes]:
        tail = [store.tensor_bytes("input_ids", ids.contiguous())]
        if found is not None:
            tail.append(store.TensorBytes("loss_mask", "U8", (found.tokens,), [found.loss_mask()]))
        return tail

    def _write_whole(self, ids: "torch.Tensor", slices: list["torch.Tensor"], rid: Optional[str]) -> tuple:
        key = store.sample_key(ids)
        found = self._intent(key, int(ids.shape[0]))
        tensors = [store.tensor_bytes(n, t) for n, t in zip(self.planes, slices)] + self._tail(ids, found)
        n = int(ids.shape[0])
        meta = self._meta(key, n, str(slices[0].dtype).replace("torch.", ""), rid, 1, found)
        return store.write_temp(self.directory, key, tensors, meta, fsync=self.fsync), self._extra(found, rid, 1, n)

    def _complete(self, part: OpenPrompt) -> tuple:
        import torch

        key = part.hasher.hexdigest()[: store.KEY_HEX]
        ids = torch.cat(part.ids)
        n = int(ids.shape[0])
        found = self._intent(key, n)
        meta = self._meta(key, n, part.dtype, part.rid, part.parts, found)
        return part.sample.finish(key, self._tail(ids, found), meta, fsync=self.fsync), \
            self._extra(found, part.rid, part.parts, n)

    def _finish(self, part: OpenPrompt) -> None:
        try:
            w, extra = self._complete(part)
            self._publish(w, extra)
            with self._stats_lock:
                self.stats.merged += 1
        except BaseException as e:  # noqa: BLE001 - the next pass raises it on the forward path
            part.sample.abandon()
            self._fail(e)

    def _publish(self, w: store.Written, extra: dict[str, Any]) -> None:
        final = store.publish(w, self.directory)
        self.manifest.add(final, **extra)
        with self._stats_lock:
            self.stats.samples += 1
            self.stats.tokens += extra["tokens"]
            self.stats.bytes += final.nbytes
            self.stats.with_intent += "sample_id" in extra

    def _extra(self, found: Optional[intents.Intent], rid: Optional[str], parts: int, n: int) -> dict[str, Any]:
        extra: dict[str, Any] = {"rid": "" if rid is None else str(rid), "parts": parts, "tokens": n}
        if found is not None:
            extra.update(sample_id=found.metadata.get("sample_id", ""), run=found.metadata.get("run", ""),
                         loss_tokens=found.loss_tokens)
        return extra

    def _intent(self, key: str, tokens: int) -> Optional[intents.Intent]:
        try:
            return intents.read(self.directory, key, tokens)
        except intents.IntentError as e:
            log.error("hs_patch: sample %s is written without the driver's loss mask: %s", key, e)
            store.log_error(self.directory, {"error": "intent_unusable", "key": key, "why": str(e)})
            return None

    # ------------------------------------------------------------------ errors and status
    def _reject(self, rid: Optional[str], prefix: int, n: int, ids: "torch.Tensor",
                opened: Optional[OpenPrompt]) -> None:
        with self._stats_lock:
            self.stats.errors += 1
        why = ("its first tokens were not computed in this pass (radix-cache prefix hit?) and it "
               "continues no open chunked request; start the server with --disable-radix-cache")
        log.error("hs_patch: request rid=%s starts at token %d: %s. Not written.", rid, prefix, why)
        store.log_error(self.directory, {
            "error": "partial_prefill", "rid": rid, "prefix": int(prefix), "tokens": int(n),
            "part_key": store.sample_key(ids), "open": None if opened is None else
            {"end": opened.end, "tokens": opened.sample.tokens, "rid": opened.rid}, "why": why})

    def _lost(self, opened: OpenPrompt) -> None:
        with self._stats_lock:
            self.stats.errors += 1
        why = "a chunked prompt's next part did not come in the next prefill pass; its partial file is removed"
        log.error("hs_patch: rid=%s after %d of %d tokens: %s", opened.rid, opened.end, opened.sample.tokens, why)
        store.log_error(self.directory, {"error": "chunk_lost", "rid": opened.rid, "end": opened.end,
                                         "tokens": opened.sample.tokens, "why": why})

    def _write_status(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._status_at < 2.0:
            return
        self._status_at = now
        st = self.stats
        doc = {"pid": os.getpid(), "time": now, "directory": str(self.directory), "passes": st.passes,
               "samples": st.samples, "tokens": st.tokens, "bytes": st.bytes, "merged": st.merged,
               "skipped": st.skipped, "errors": st.errors, "with_intent": st.with_intent,
               "skip_rid_prefix": self.skip_rid_prefix, "queued": self.pending(),
               "error": None if self.error is None else str(self.error), **self.extra_status()}
        try:
            store.write_text_atomic(self.directory / STATUS_FILE, json.dumps(doc, sort_keys=True))
        except OSError as e:  # a status file must never stop capture
            log.warning("hs_patch: cannot write %s: %s", STATUS_FILE, e)
