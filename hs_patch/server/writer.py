"""The capture hook's background writer: turns prefill passes into sample files.

Runs in threads of the SGLang server process, never on the forward path. One
coordinator thread takes passes in order (chunked prefill needs the order), splits
each into per-request parts with ``extend_seq_lens``, and hands the file writes to a
small pool. A pass's staging buffer is released when all its files are written.

Chunked prefill: a prompt longer than the chunk budget reaches the model over several
passes; every part after the first starts at ``extend_prefix_len > 0``. SGLang puts at
most one request in that state at a time and truncates only the last request of a
pass, so the writer keeps that request open (key hasher, end, request id). A part
with a prefix continues the open request when the request ids match (releases that
have them) and its prefix equals the open request's end; the writer then writes the
merged sample under the key of all tokens so far and removes the shorter one. A part
with a prefix that continues nothing (a radix-cache hit, a lost chunk) is never
written as if it were complete: it goes to ``errors.jsonl`` and the log.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from hs_patch import store

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("hs_patch")
STATUS_FILE = "hook_status.json"


HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # SGLang's /health_generate probes (sglang.srt.constants)


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
    rids: Optional[Sequence[str]] = None
    wait: Optional[Callable[[], None]] = None     # blocks until the copies have landed
    release: Optional[Callable[[], None]] = None  # gives the staging buffer back


@dataclass
class _Open:
    """The last request of the previous pass, which a later pass may continue.

    ``link`` is a private hard link to its file: a sample named by content may be taken
    (and deleted) by a consumer that wants exactly those tokens (a conversation that is a
    prefix of a longer one), and the continuation still needs it."""

    key: str
    end: int
    hasher: Any
    rid: Optional[str]
    parts: int
    link: Optional[Path] = None


@dataclass
class WriterStats:
    passes: int = 0
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    merged: int = 0
    skipped: int = 0
    errors: int = 0
    started: float = field(default_factory=time.time)


class Writer:
    """Writes samples of :class:`PassRecord` s in a background thread."""

    def __init__(self, directory: str, planes: Sequence[str], metadata: dict[str, str], *,
                 workers: int = 2, skip_rid_prefix: str = "", fsync: bool = False,
                 max_queue: int = 0):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.planes = list(planes)
        self.metadata = dict(metadata)
        self.skip_rid_prefix = skip_rid_prefix
        self.fsync = fsync
        self.manifest = store.Manifest(self.directory)
        self.stats = WriterStats()
        self.error: Optional[BaseException] = None
        self.extra_status: Callable[[], dict[str, Any]] = dict
        self._open: Optional[_Open] = None
        self._queue: "queue.Queue[Optional[PassRecord]]" = queue.Queue(max_queue)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hs_patch-write")
        self._status_at = 0.0
        self._stats_lock = threading.Lock()
        self._links = itertools.count()
        self._thread = threading.Thread(target=self._run, name="hs_patch-writer", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ API
    def submit(self, record: PassRecord) -> None:
        if self.error is not None:
            raise RuntimeError(f"hs_patch writer stopped: {self.error}") from self.error
        self._queue.put(record)

    def pending(self) -> int:
        return self._queue.qsize()

    def close(self, timeout: float = 60.0) -> None:
        """Write everything queued, then stop (used at exit and by tests)."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._pool.shutdown(wait=True)
        if self._open is not None and self._open.link is not None:
            self._open.link.unlink(missing_ok=True)
        self._write_status(force=True)
        if self._thread.is_alive():
            raise RuntimeError(f"hs_patch writer did not finish within {timeout:.0f}s")

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        while True:
            rec = self._queue.get()
            if rec is None:
                return
            try:
                if self.error is None:
                    if rec.wait is not None:
                        rec.wait()
                    self._write_pass(rec)
            except BaseException as e:  # noqa: BLE001 - reported to the forward path, then raised there
                self.error = e
                self.stats.errors += 1
                log.error("hs_patch writer failed, capture stops: %s", e, exc_info=True)
            finally:
                if rec.release is not None:
                    rec.release()
                self._write_status()

    def _write_pass(self, rec: PassRecord) -> None:
        import torch  # noqa: F401  (slicing CPU tensors)

        jobs: list[Future] = []
        opened = self._open
        self._open = None
        offset = 0
        last = len(rec.seq_lens) - 1
        for j, (n, prefix) in enumerate(zip(rec.seq_lens, rec.prefix_lens)):
            s, e = offset, offset + int(n)
            offset = e
            rid = rec.rids[j] if rec.rids is not None else None
            if skipped(rid, self.skip_rid_prefix):
                self.stats.skipped += 1
                continue
            ids = rec.ids[s:e]
            base: Optional[_Open] = None
            if prefix:
                if opened is None or opened.end != prefix or (rid is not None and opened.rid != rid):
                    self._reject(rid, prefix, e - s, ids, opened)
                    continue
                base, hasher = opened, opened.hasher.copy()
            else:
                hasher = store.key_hasher()
            hasher.update(store.ids_bytes(ids))
            key = hasher.hexdigest()[: store.KEY_HEX]
            parts = base.parts + 1 if base else 1
            slices = [p[s:e] for p in rec.planes]
            keep = j == last  # SGLang truncates only the last request of a pass
            jobs.append(self._pool.submit(self._write_one, key, ids, slices, rid, base, parts, keep))
            if keep:
                self._open = _Open(key, int(prefix) + e - s, hasher, rid, parts)
        if offset != rec.ids.shape[0]:
            raise RuntimeError(f"extend_seq_lens sum to {offset} but the pass has {rec.ids.shape[0]} tokens")
        links = [job.result() for job in jobs]
        if self._open is not None:
            self._open.link = links[-1]
        if opened is not None and opened.link is not None:
            opened.link.unlink(missing_ok=True)
        self.stats.passes += 1

    def _write_one(self, key: str, ids: "torch.Tensor", slices: list["torch.Tensor"],
                   rid: Optional[str], base: Optional[_Open], parts: int, keep: bool) -> Optional[Path]:
        if base is None:
            tensors = [store.tensor_bytes("input_ids", ids)]
            tensors += [store.tensor_bytes(n, t) for n, t in zip(self.planes, slices)]
        else:
            import torch

            prev = store.read_tensors(base.link)
            ids = torch.cat([prev["input_ids"], ids])
            tensors = [store.tensor_bytes("input_ids", ids)]
            tensors += [store.tensor_bytes(n, torch.cat([prev[n], t]))
                        for n, t in zip(self.planes, slices)]
        n = int(ids.shape[0])
        meta = dict(self.metadata, key=key, num_tokens=str(n), parts=str(parts),
                    dtype=str(slices[0].dtype).replace("torch.", ""),
                    rid="" if rid is None else str(rid), created=f"{time.time():.3f}")
        written = store.write_sample(self.directory, key, tensors, meta, fsync=self.fsync)
        self.manifest.add(written, tokens=n, rid=meta["rid"], parts=parts)
        if base is not None:
            # the shorter sample is still valid for its own tokens: its consumer (the driver)
            # deletes it unless a request of exactly those tokens wants it
            self.manifest.append({"op": "superseded", "key": base.key, "by": key, "t": round(time.time(), 3)})
        link = None
        if keep:
            # unique: the next pass may end with the same tokens (a prompt that is a prefix of another)
            link = self.directory / store.TMPDIR / f"open.{key}.{os.getpid()}.{next(self._links)}"
            os.link(written.path, link)
        with self._stats_lock:
            self.stats.merged += base is not None
            self.stats.samples += 1
            self.stats.tokens += n
            self.stats.bytes += written.nbytes
        return link

    def _reject(self, rid: Optional[str], prefix: int, n: int, ids: "torch.Tensor",
                opened: Optional[_Open]) -> None:
        with self._stats_lock:
            self.stats.errors += 1
        why = ("its first tokens were not computed in this pass (radix-cache prefix hit?) and it "
               "continues no open chunked request; start the server with --disable-radix-cache")
        log.error("hs_patch: request rid=%s starts at token %d: %s. Not written.", rid, prefix, why)
        store.log_error(self.directory, {
            "error": "partial_prefill", "rid": rid, "prefix": int(prefix), "tokens": int(n),
            "part_key": store.sample_key(ids), "open": None if opened is None else
            {"key": opened.key, "end": opened.end, "rid": opened.rid}, "why": why})

    def _write_status(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._status_at < 2.0:
            return
        self._status_at = now
        st = self.stats
        doc = {"pid": os.getpid(), "time": now, "passes": st.passes, "samples": st.samples,
               "tokens": st.tokens, "bytes": st.bytes, "merged": st.merged, "skipped": st.skipped,
               "errors": st.errors, "queued": self._queue.qsize(),
               "error": None if self.error is None else str(self.error), **self.extra_status()}
        try:
            store.write_text_atomic(self.directory / STATUS_FILE, json.dumps(doc, sort_keys=True))
        except OSError as e:  # a status file must never stop capture
            log.warning("hs_patch: cannot write %s: %s", STATUS_FILE, e)
