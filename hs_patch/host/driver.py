"""The driver: feeds a dataset through the capturing SGLang server and finalizes each sample.

Per sample (``--concurrency`` at a time): build the token ids and loss mask (chat
template, or pre-tokenized), optionally regenerate the assistant turns with the target
model first (rids ``nocap-...``, not captured), drop it if its tokens duplicate a sample
already done or in flight, wait while the dump filesystems are above the high-water mark,
send a prefill-only ``/generate`` with the ids, wait for the hook's raw sample to appear in
the capture dir's manifest, and finalize it (loss mask + provenance, into the samples
dir). Every decision goes to the ledger; bad input to the rejects file; progress to
status.json. A restarted run skips what is done and verified (see ``runstate``).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import queue
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from hs_patch import __version__, store
from hs_patch.host import chat, dataset, runstate
from hs_patch.host.backpressure import BackPressure, disk_usage
from hs_patch.host.capture_dir import CaptureWatcher, RawTimeout
from hs_patch.host.client import HEALTH_PROBE_IDS, ClientError, RetryPolicy, SGLangClient, read_api_key
from hs_patch.host.drive_config import DriveConfig
from hs_patch.host.finalize import FinalizeError, finalize
from hs_patch.host.runstatus import RunStatus

EXIT_OK, EXIT_ERROR, EXIT_INCOMPLETE, EXIT_FAILURES, EXIT_SIGNAL = 0, 1, 3, 4, 130
CAPTURE_LOCK = ".hs-driver.lock"
CAPTURE_PARAMS = {"max_new_tokens": 1, "temperature": 0.0}  # 1 new token: the least that runs a prefill


@dataclass
class Summary:
    state: str
    exit_code: int
    message: str
    status: dict[str, Any]


class Driver:
    def __init__(self, cfg: DriveConfig, *, usage: Callable[[str], float] = disk_usage, tokenizer: Any = None):
        if cfg.on_too_long not in ("skip", "truncate"):
            raise runstate.RunError("--on-too-long must be skip or truncate")
        self.cfg = cfg
        self.usage = usage
        self.tokenizer = tokenizer
        self.stop = threading.Event()
        self.stop_reason = ""
        self.exit_code = EXIT_OK
        self.keys_lock = threading.Lock()
        self.inflight: dict[str, str] = {}       # key -> sample_id
        self.regen_keys: set[str] = set()        # prompts of regeneration turns (captured on SGLang < 0.5.10)
        self.counter = itertools.count()
        self.state_dir, self.samples_dir = Path(cfg.state_dir), Path(cfg.samples_dir)
        self.capture_dir = Path(cfg.capture_dir)
        self.status = RunStatus(cfg.run, self.state_dir / runstate.STATUS, prometheus=cfg.prometheus or None,
                                extra=self._status_extra)
        self.bp: Optional[BackPressure] = None
        self.shipped: Optional[runstate.ShippedTail] = None

    # ------------------------------------------------------------------ control
    def request_stop(self, reason: str, code: int = EXIT_INCOMPLETE) -> None:
        if not self.stop.is_set():
            self.stop_reason, self.exit_code = reason, code
            self.stop.set()

    def _status_extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dump": self.bp.status() if self.bp else {}}
        if self.shipped is not None:
            with self.status.lock:
                done = set(self.status.c.done_keys)
            shipped = len(self.shipped.refresh() & done)
            out["shipping"] = {"shipped": shipped, "pending": len(done) - shipped}
        return out

    # ------------------------------------------------------------------ run
    def run(self) -> Summary:
        cfg = self.cfg
        if self.capture_dir.resolve() == self.samples_dir.resolve():
            raise runstate.RunError("--capture-dir and --samples-dir must differ (the driver empties the first)")
        for d, what in ((self.state_dir, "--state-dir"), (self.samples_dir, "--samples-dir"),
                        (self.capture_dir, "--capture-dir")):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise runstate.RunError(f"cannot create {what} {d}: {e.strerror}; choose a writable "
                                        "directory") from None
        dataset.check_sources(cfg.data)
        locks: list[int] = []
        try:
            locks.append(runstate.take_lock(self.state_dir / runstate.LOCK, f"run {cfg.run!r}"))
            locks.append(runstate.take_lock(self.capture_dir / CAPTURE_LOCK, f"capture dir {self.capture_dir}"))
            return self._run_locked(runstate.check_params(self.state_dir, cfg.identity()))
        finally:
            for fd in locks:
                os.close(fd)

    def _run_locked(self, resumed: bool) -> Summary:
        self.ledger = runstate.Ledger(self.state_dir / runstate.LEDGER)
        self.rejects = dataset.RejectLog(self.state_dir / runstate.REJECTS)
        self.shipped = runstate.ShippedTail(self.state_dir / runstate.SHIPPED)
        ticker = threading.Thread(target=self._tick, name="hs-status", daemon=True)
        watcher = None
        (self.state_dir / runstate.DONE).unlink(missing_ok=True)  # a shipper following us must wait
        try:
            self.status.write()
            ticker.start()
            self._prepare(resumed)
            watcher = self.watcher = CaptureWatcher(self.capture_dir)
            self._sweep(self._own_raw_keys(), "leftover of an interrupted run")
            self.status.state = "running"
            self._feed()
            self._sweep(self._own_raw_keys() | self.regen_keys, "end of run sweep")
            # the capture dir is this driver's alone (locked): whatever is left was not asked for by
            # this run (SGLang's warm-up request, another client, a first chunk the server dropped)
            self._sweep(set(self.watcher.keys()), "not requested by this run")
        except Exception as e:
            self.status.state, self.status.message = "failed", str(e)
            self.ledger.write("run_failed", error=f"{type(e).__name__}: {e}")
            raise
        finally:
            self.stop.set()
            if ticker.is_alive():
                ticker.join()
            if watcher is not None:
                watcher.close()
            doc = self.status.snapshot()
            if self.status.state != "failed":
                s = doc["samples"]
                if not self.stop_reason and (s["failed"] or s["remaining"]):
                    self.exit_code = EXIT_INCOMPLETE
                self.status.state = "finished" if not self.stop_reason else "stopped"
                self.status.message = self.stop_reason or (
                    "complete" if self.exit_code == EXIT_OK else
                    f"{s['failed']} failed, {s['remaining']} not done: run the same command again to redo them")
            doc = self.status.write()
            self.ledger.write("run_end", state=self.status.state, exit_code=self.exit_code,
                              message=self.status.message, samples=doc["samples"], tokens=doc["tokens"])
            self.ledger.close()
            if self.status.state == "finished":  # tells `hs-extract ship --follow` nothing more will come
                (self.state_dir / runstate.DONE).touch()
        return Summary(self.status.state, self.exit_code, self.status.message, doc)

    def _prepare(self, resumed: bool) -> None:
        cfg = self.cfg
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
        self.vocab = chat.vocab_bound(self.tokenizer, cfg.model)
        self.client = SGLangClient(cfg.server, policy=RetryPolicy(cfg.retries, cfg.backoff, cfg.backoff_max),
                                   timeout=cfg.request_timeout, on_retry=self._on_retry,
                                   should_stop=self.stop.is_set, api_key=read_api_key(cfg.api_key_file))
        self.client.wait_healthy(cfg.server_wait)
        info = self.client.server_info()
        if info.get("disable_radix_cache") is not True:
            raise runstate.RunError("the server runs with the radix cache on: a cached prefix is never computed, so "
                                    "it cannot be captured. Restart SGLang with --disable-radix-cache")
        self.server_version = str(info.get("version", ""))
        done = self.done = runstate.load_done(self.samples_dir, self.state_dir / runstate.SHIPPED)
        self.status.c.total = dataset.count_lines(cfg.data) if not cfg.limit else \
            min(cfg.limit, dataset.count_lines(cfg.data))
        self.bp = BackPressure([str(self.capture_dir), str(self.samples_dir)], high=cfg.high_water,
                               low=cfg.low_water, usage=self.usage, on_change=self._on_pressure)
        self.ledger.write("run_start", resumed=resumed, driver=__version__, params=asdict(cfg),
                          server={k: info.get(k) for k in ("version", "model_path", "tp_size", "chunked_prefill_size",
                                                           "disable_radix_cache", "standin")},
                          done_verified=done.live, done_shipped=done.shipped, discarded=done.discarded)

    def _tick(self) -> None:
        while not self.stop.wait(self.cfg.status_interval):
            watcher = getattr(self, "watcher", None)
            if watcher is not None:
                self._sweep(set(self.regen_keys), "regeneration prompt (captured by SGLang < 0.5.10)")
                # first parts of chunked prompts, unless a request of exactly those tokens waits for one
                self._sweep(watcher.superseded(), "first part of a chunked prompt")
            if self.bp is not None and self.status.state in ("running", "paused"):
                self.status.state = "paused" if self.bp.paused else "running"
            try:
                self.status.write()
            except OSError:
                pass  # a full or missing state dir: the next tick tries again

    def _own_raw_keys(self) -> set[str]:
        """Raw samples in the capture dir whose tokens this run sent (per its ledger)."""
        return runstate.run_keys(self.state_dir / runstate.LEDGER, set(self.watcher.keys()))

    def _sweep(self, keys: set[str], reason: str) -> None:
        """Remove this run's raw samples (and SGLang's health-check probe) left in the capture dir."""
        probe = store.sample_key(HEALTH_PROBE_IDS)
        for key in self.watcher.keys():
            if key == probe or (key in keys and key not in self.inflight):
                why = "SGLang health-check probe (input_ids [0])" if key == probe else reason
                if self.watcher.remove(key, reason=why, run=self.cfg.run):
                    self.ledger.write("raw_removed", key=key, reason=why)

    def _on_retry(self, info: dict[str, Any]) -> None:
        self.status.update(retries=1)
        self.ledger.write("retry", **info)

    def _on_pressure(self, what: str, usage: dict[str, float]) -> None:
        self.status.state = "paused" if what == "pause" else "running"
        self.ledger.write(what, used_pct=usage, high_water=self.cfg.high_water, low_water=self.cfg.low_water)

    # ------------------------------------------------------------------ feeding
    def _feed(self) -> None:
        work: queue.Queue = queue.Queue(maxsize=2 * self.cfg.concurrency)
        workers = [threading.Thread(target=self._worker, args=(work,), name=f"hs-drive-{i}", daemon=True)
                   for i in range(self.cfg.concurrency)]
        for w in workers:
            w.start()
        items = dataset.read(self.cfg.data)
        if self.cfg.limit:
            items = itertools.islice(items, self.cfg.limit)
        for item in items:
            if self.stop.is_set():
                break
            if isinstance(item, dataset.Reject):
                self._reject(item)
            elif item.sample_id in self.done.by_id:
                self.status.update(done_before=1)
                self.status.c.done_keys.add(self.done.by_id[item.sample_id])
            else:
                while not self.stop.is_set():
                    try:
                        work.put(item, timeout=0.5)
                        break
                    except queue.Full:
                        pass
        for _ in workers:
            work.put(None)
        for w in workers:
            w.join()
        if self.stop_reason:
            self.ledger.write("stop", reason=self.stop_reason)

    def _worker(self, work: queue.Queue) -> None:
        while (rec := work.get()) is not None:
            if self.stop.is_set():
                continue
            try:
                self._process(rec)
            except Exception as e:  # noqa: BLE001 - one sample's bug must not kill the run; it is recorded
                self._failed(rec, None, "internal", f"{type(e).__name__}: {e}")

    def _reject(self, rej: dataset.Reject) -> None:
        self.rejects.add(rej)
        with self.status.lock:
            self.status.c.rejected = self.rejects.total
        self.ledger.write("reject", sample_id=rej.sample_id, reason=rej.reason, detail=rej.detail)

    def _failed(self, rec: dataset.Record, key: Optional[str], stage: str, error: str) -> None:
        if self.stop.is_set():  # interrupted by the stop, not a failure of its own: redone on resume
            self.ledger.write("abandoned", sample_id=rec.sample_id, key=key, stage=stage, error=error)
            return
        self.status.error(f"{rec.sample_id}: {error}")
        self.status.update(failed=1, consecutive_failures=1)
        self.ledger.write("failed", sample_id=rec.sample_id, key=key, stage=stage, error=error)
        n = self.status.c.consecutive_failures
        if n >= self.cfg.max_consecutive_failures:
            self.request_stop(f"stopped after {n} consecutive failures (last: {error}); fix the cause, then run "
                              "the same command again to resume", EXIT_FAILURES)

    def _process(self, rec: dataset.Record) -> None:
        try:
            ids, mask, prov = self._tokens(rec)
        except dataset.Invalid as e:
            self._reject(dataset.Reject(rec.source, rec.line, e.reason, str(e)))
            return
        except ClientError as e:
            self._failed(rec, None, "regenerate", str(e))
            return
        key = store.sample_key(ids)
        with self.keys_lock:
            first = self.done.by_key.get(key) or self.inflight.get(key)
            if first is None:
                self.inflight[key] = rec.sample_id
        if first is not None:
            self.status.update(duplicates=1)
            self.ledger.write("duplicate", sample_id=rec.sample_id, key=key, duplicate_of=first)
            return
        try:
            self._capture(rec, key, ids, mask, prov)
        finally:
            with self.keys_lock:
                self.inflight.pop(key, None)

    def _tokens(self, rec: dataset.Record) -> tuple[list[int], list[int], dict[str, str]]:
        cfg = self.cfg
        prov = {"sample_id": rec.sample_id, "source": rec.source, "line": str(rec.line), "run": cfg.run,
                "source_id": rec.source_id, "input_format": rec.format, "regenerated": "0", "truncated_from": "",
                "driver": f"hs-extract {__version__}"}
        if rec.input_ids is not None:
            ids, mask = list(rec.input_ids), list(rec.loss_mask or [1] * len(rec.input_ids))
            prov["loss_mask"] = "given" if rec.loss_mask else "all"
            bad = next((t for t in ids if t >= self.vocab), None)
            if bad is not None:
                raise dataset.Invalid("bad_field", f"token id {bad} is outside the vocabulary (< {self.vocab})")
        else:
            messages = rec.messages
            if cfg.regenerate:
                messages = self._regenerate(rec)
                prov["regenerated"] = "1"
            enc = chat.encode_chat(self.tokenizer, messages, cfg.chat_template_kwargs)
            ids, mask = enc.input_ids, enc.loss_mask
            prov["loss_mask"] = "assistant"
        if len(ids) > cfg.max_tokens:
            if cfg.on_too_long == "skip":
                raise dataset.Invalid("too_long", f"{len(ids)} tokens > --max-tokens {cfg.max_tokens}")
            prov["truncated_from"] = str(len(ids))
            ids, mask = ids[:cfg.max_tokens], mask[:cfg.max_tokens]
            if not any(mask):
                raise dataset.Invalid("too_long", f"{prov['truncated_from']} tokens truncated to {cfg.max_tokens} "
                                                  "leave no assistant token")
        return ids, mask, prov

    def _rid(self, prefix: str, rec: dataset.Record) -> str:
        tag = hashlib.sha256(rec.sample_id.encode()).hexdigest()[:8]
        return f"{prefix}{self.cfg.run}-{tag}-{next(self.counter)}-{uuid.uuid4().hex[:8]}"

    def _regenerate(self, rec: dataset.Record) -> list[dict[str, str]]:
        """Replace each assistant turn by the target model's own answer (not captured)."""
        cfg, out = self.cfg, []
        params = {"max_new_tokens": cfg.regen_max_new_tokens, "temperature": cfg.regen_temperature,
                  "top_p": cfg.regen_top_p}
        for turn, m in enumerate(rec.messages or []):
            if m["role"] != "assistant":
                out.append(m)
                continue
            prompt = chat.generation_prompt(self.tokenizer, out, cfg.chat_template_kwargs)
            key, rid = store.sample_key(prompt), self._rid("nocap-", rec)
            with self.keys_lock:
                self.regen_keys.add(key)
            self.ledger.write("regen_turn", sample_id=rec.sample_id, turn=turn, key=key, rid=rid,
                              prompt_tokens=len(prompt))
            res = self.client.generate(prompt, params, rid, context={"sample_id": rec.sample_id})
            meta = res["meta_info"]
            self.ledger.write("regen_done", sample_id=rec.sample_id, turn=turn, rid=rid,
                              completion_tokens=meta.get("completion_tokens"), finish_reason=meta.get("finish_reason"))
            out.append({"role": "assistant", "content": res["text"]})
        return out

    def _capture(self, rec: dataset.Record, key: str, ids: list[int], mask: list[int], prov: dict[str, str]) -> None:
        cfg = self.cfg
        if not self.bp.wait(self.stop):
            return
        rid = self._rid("hs-", rec)
        self.watcher.read_new()  # an earlier write of these tokens must count as before this request
        after = self.watcher.seq
        t0 = time.monotonic()
        self.ledger.write("sent", sample_id=rec.sample_id, key=key, rid=rid, tokens=len(ids),
                          loss_tokens=sum(mask), truncated_from=prov["truncated_from"] or None)
        self.status.update(in_flight=1)
        try:
            try:
                self.client.generate(ids, CAPTURE_PARAMS, rid, context={"sample_id": rec.sample_id})
            except ClientError as e:
                self._failed(rec, key, "generate", str(e))
                return
            try:
                entry = self.watcher.wait(key, after, cfg.raw_timeout)
            except RawTimeout:
                self._failed(rec, key, "wait_raw", (
                    f"the server answered but no sample {key} appeared in {self.capture_dir}/manifest.jsonl within "
                    f"{cfg.raw_timeout:.0f}s (--raw-timeout). Is the server started with HS_CAPTURE=1 and "
                    f"HS_CAPTURE_DIR={self.capture_dir} (= --capture-dir)? Is its writer failing (errors.jsonl, "
                    "hook_status.json)?"))
                return
            try:
                written = finalize(self.watcher, entry, self.samples_dir, mask, prov)
            except (FinalizeError, OSError) as e:
                self._failed(rec, key, "finalize", str(e))
                return
        finally:
            self.status.update(in_flight=-1)
        with self.keys_lock:
            self.done.by_key[key] = rec.sample_id
            self.done.by_id[rec.sample_id] = key
        with self.status.lock:
            self.status.c.done_keys.add(key)
            self.status.c.consecutive_failures = 0
        self.status.update(done_now=1, tokens=len(ids), loss_tokens=sum(mask), bytes=written.nbytes)
        self.ledger.write("done", sample_id=rec.sample_id, key=key, rid=rid, file=written.path.name,
                          bytes=written.nbytes, sha256=written.sha256, tokens=len(ids),
                          seconds=round(time.monotonic() - t0, 3))
