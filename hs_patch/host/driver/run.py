"""The driver: feeds a dataset through the capturing SGLang server and adopts each sample.

Per sample (``--concurrency`` at a time): build the token ids and loss mask (chat
template, or pre-tokenized), optionally regenerate the assistant turns with the target
model first (rids ``nocap-...``, not captured), drop it if its tokens duplicate a sample
already done or in flight, wait while the dump filesystems are above the high-water mark,
write its intent (loss mask + provenance, ``hs_patch.samples.intent``) into the capture dir, send
a prefill-only ``/generate`` with the ids, wait for the hook's sample to appear in the
capture dir's manifest (written once, with the mask), and adopt it (a rename into the
samples dir, ``adopt.py``). Every decision goes to the ledger; bad input to the rejects file; progress to
status.json. A restarted run skips what is done and verified (see ``runstate``).
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Container, Optional

from hs_patch import __version__
from hs_patch.engine import kv_cache
from hs_patch.host.driver import capture_check, chat, dataset, limits, missing, reconcile, runstate
from hs_patch.host.driver.backpressure import BackPressure, disk_usage
from hs_patch.host.driver.capture_dir import CaptureWatcher
from hs_patch.host.driver.client import HEALTH_PROBE_IDS, RetryPolicy, SGLangClient, read_api_key, redact_url
from hs_patch.host.driver.config import DriveConfig
from hs_patch.host.driver.adopt import same_filesystem
from hs_patch.host.driver.runstatus import RunStatus, nothing_extracted
from hs_patch.host.driver.order import InOrder
from hs_patch.host.driver.turns import Turns
from hs_patch.host.driver.startup import Pending, Timings, ask_server
from hs_patch.host.driver.tokenizer import way as tokenizer_way
from hs_patch.host.driver.sample_steps import (CAPTURE_PARAMS, EXIT_ERROR, EXIT_FAILURES, EXIT_INCOMPLETE,  # noqa: F401
                                        EXIT_OK, EXIT_SIGNAL, SampleSteps)  # (re-exported)
from hs_patch.samples import intent, store

CAPTURE_LOCK = ".hs-driver.lock"
QUEUE_POLL_S = 2.0   # --queue: how often a queued run tries the capture dir's lock
SAMPLES_LOCK = ".hs-samples.lock"
REGEN_SWEPT = "regeneration prompt (captured by SGLang < 0.5.10)"
LATE_SWEPT = "a later capture of a sample already adopted (a retried request prefilled twice)"


@dataclass
class Summary:
    state: str
    exit_code: int
    message: str
    status: dict[str, Any]


class Driver(SampleSteps):
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
        self.regen = {"lines": 0, "answers_kept": 0, "answers_left_out": 0}   # --regenerate: samples done this start
        self.counter = itertools.count()
        self.state_dir, self.samples_dir = Path(cfg.state_dir), Path(cfg.samples_dir)
        self.capture_dir = Path(cfg.capture_dir)
        self.status = RunStatus(cfg.run, self.state_dir / runstate.STATUS, prometheus=cfg.prometheus or None,
                                extra=self._status_extra)
        self.bp: Optional[BackPressure] = None
        self.turns = Turns(cfg.concurrency)  # requests at the server; cfg.awaiting more wait for their samples
        self.order = InOrder()               # of two lines with the same tokens, the earlier is kept
        self.shipped: Optional[runstate.ShippedTail] = None
        self.failures: dict[str, missing.Failure] = {}   # sample id -> how it failed in this run
        self.failing = threading.Lock()  # a failure is counted, or abandoned by a stop, as one step
        self.stopping = threading.Lock()  # the first stop's reason and exit code, set together
        self.missing: Optional[dict[str, Any]] = None    # the lines not held, once the run has ended
        self.reconciled: Optional[reconcile.Reconciled] = None   # the held samples against the dataset now
        self.data_changes: list[dict[str, Any]] = []             # the data files changed since the last start

    # ------------------------------------------------------------------ control
    def request_stop(self, reason: str, code: int = EXIT_INCOMPLETE) -> None:
        with self.stopping:
            if not self.stop.is_set():
                self.stop_reason, self.exit_code = reason, code
                self.stop.set()

    def _status_extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {"dump": self.bp.status() if self.bp else {}}
        if self.reconciled is not None and (self.data_changes or self.reconciled.vanished or self.reconciled.moved):
            out["dataset"] = dict(self.reconciled.summary(), changed=[c["name"] for c in self.data_changes],
                                  message=reconcile.describe(self.reconciled, self.data_changes))
        if self.missing is not None:
            out["missing"] = self.missing
        if self.cfg.regenerate:
            with self.keys_lock:
                out["regenerate"] = dict(self.regen)
        if self.monitor is not None:
            out["fidelity"] = dict(self.monitor.status(), check=self.cfg.fidelity_settings())
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
        dataset.check_sources(cfg.data)  # the input first: a refused run leaves no directory behind
        chat.check_model_dir(cfg.model)
        for d, what in ((self.state_dir, "--state-dir"), (self.samples_dir, "--samples-dir"),
                        (self.capture_dir, "--capture-dir")):
            try:
                d.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise runstate.RunError(f"cannot create {what} {d}: {e.strerror}; choose a writable "
                                        "directory") from None
        if not same_filesystem(self.capture_dir, self.samples_dir):
            raise runstate.RunError(f"--capture-dir {self.capture_dir} and --samples-dir {self.samples_dir} are on "
                                    "different filesystems: samples are moved, not copied, into the samples dir; "
                                    "put both on the same one (both under /dev/shm by default)")
        locks: list[int] = []
        try:
            locks.append(runstate.take_lock(self.state_dir / runstate.LOCK, f"run {cfg.run!r}"))
            capture = self._queue() if cfg.queue else \
                runstate.take_lock(self.capture_dir / CAPTURE_LOCK, f"capture dir {self.capture_dir}", f"run {cfg.run}")
            if capture is None:  # stopped while queued: nothing was started
                self.status.state, self.status.message = "stopped", self.stop_reason
                return Summary("stopped", self.exit_code, self.stop_reason, self.status.write())
            locks.append(capture)
            locks.append(runstate.take_lock(self.samples_dir / SAMPLES_LOCK, f"samples dir {self.samples_dir}"))
            ident = cfg.identity()
            resumed = runstate.check_params(self.state_dir, ident)
            self.data_changes = reconcile.data_changes(runstate.recorded_data(self.state_dir), ident["data"])
            self.data_now = ident["data"]
            self.weaker_check = runstate.check_fidelity(self.state_dir, cfg.fidelity_settings(),
                                                        accept_weaker=cfg.accept_weaker_check)
            return self._run_locked(resumed)
        finally:
            for fd in locks:
                os.close(fd)

    def _queue(self) -> Optional[int]:
        """The capture dir's lock, waiting (state ``queued``) while another run holds it: one server,
        one capture dir, one driver at a time (``--queue``: fab queues a reassigned shard behind the
        host's own). None when stopped first."""
        path = self.capture_dir / CAPTURE_LOCK
        while True:
            fd, holder = runstate.try_lock(path, f"run {self.cfg.run}")
            if fd is not None:
                self.status.state, self.status.message = "starting", ""
                return fd
            if self.status.state != "queued":
                self.status.state = "queued"
                self.status.message = (f"queued: the capture dir {self.capture_dir} is in use by {holder}; this run "
                                       "starts when that one ends")
                self.status.write()
            if self.stop.wait(QUEUE_POLL_S):
                return None

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
            self._sweep_intents()
            self.status.state = "running"
            self._feed()
            self._sweep(set(self.regen_keys), REGEN_SWEPT)
            self._sweep(self._own_raw_keys(), "end of run sweep")
            # the capture dir is this driver's alone (locked): whatever is left was not asked for by
            # this run (SGLang's warm-up request, another client)
            self._sweep(set(self.watcher.keys()), "not requested by this run")
            self._sweep_intents()
        except Exception as e:
            self.status.state, self.status.message, self.exit_code = "failed", str(e), EXIT_ERROR
            self.ledger.write("run_failed", error=f"{type(e).__name__}: {e}")
            raise
        finally:
            self.stop.set()
            if ticker.is_alive():
                ticker.join()
            if watcher is not None:
                watcher.close()
            self._stop_fidelity()
            doc = self.status.snapshot()
            if self.status.state != "failed":
                s = doc["samples"]
                if not self.stop_reason and (s["failed"] or s["remaining"]):
                    self.exit_code = EXIT_INCOMPLETE
                empty = None if self.stop_reason else nothing_extracted(doc, self.rejects.by_reason)
                if empty:
                    self.exit_code, self.stop_reason = EXIT_ERROR, empty
                self.status.state = "failed" if empty else "finished" if not self.stop_reason else "stopped"
                self.missing = missing.account(self.state_dir, dict(self.failures), s["remaining"],
                                               list(self.rejects.now.values()))
                gaps = missing.describe(self.missing)
                self.status.message = self.stop_reason or (
                    ("complete" + (f" but for bad input: {gaps}" if gaps else "")) if self.exit_code == EXIT_OK else
                    f"{s['failed']} failed, {s['remaining']} not done: run the same command again to redo what can "
                    f"be; {gaps}")
            doc = self.status.write()
            self.ledger.write("run_end", state=self.status.state, exit_code=self.exit_code,
                              message=self.status.message, samples=doc["samples"], tokens=doc["tokens"])
            self.ledger.close()
            if self.status.state == "finished":  # tells `hs-extract ship --follow` nothing more will come
                (self.state_dir / runstate.DONE).touch()
        return Summary(self.status.state, self.exit_code, self.status.message, doc)

    def _prepare(self, resumed: bool) -> None:
        """Everything before the first request; the server's /health and /server_info are asked in a thread while
        the tokenizer loads and the run's state and dataset are read (startup.py)."""
        cfg = self.cfg
        steps = Timings()
        self.client = SGLangClient(cfg.server, policy=RetryPolicy(cfg.retries, cfg.backoff, cfg.backoff_max),
                                   timeout=cfg.request_timeout, on_retry=self._on_retry,
                                   should_stop=self.stop.is_set, api_key=read_api_key(cfg.api_key_file))
        server = Pending("hs-server-checks", lambda: (ask_server(self.client, cfg.server_wait), steps.since()))
        if self.tokenizer is None:
            self.tokenizer = chat.load_tokenizer(cfg.model, cfg.trust_remote_code)
        self.vocab = chat.vocab_bound(self.tokenizer, cfg.model)
        self.longest_token = limits.longest_token_chars(self.tokenizer)
        steps.mark("tokenizer_s")
        self.max_chars = dataset.line_limit(cfg.max_tokens, cfg.max_line_chars)
        done = self.done = runstate.load_done(self.samples_dir, self.state_dir / runstate.SHIPPED)
        self._reconcile(done)  # before the server's answers are waited for: a refusal comes at once
        counts = dataset.count_lines(cfg.data, self.max_chars, limit=cfg.limit, owns=cfg.owns())
        self.status.c.total = counts.lines
        self.status.c.blank = counts.blank
        steps.mark("dataset_s")
        info, answered = server.result()
        steps.mark("server_wait_s")
        if info.get("disable_radix_cache") is not True:
            raise runstate.RunError("the server runs with the radix cache on: a cached prefix is never computed, so "
                                    "it cannot be captured. Restart SGLang with --disable-radix-cache")
        short = kv_cache.shortfall(info, cfg.max_tokens)
        if short:
            raise runstate.RunError(short)
        self.server_version = str(info.get("version", ""))
        self.limit = limits.effective(cfg.max_tokens, info)
        checked = capture_check.check(self.client, self.capture_dir, self.tokenizer, f"hs-{cfg.run}-",
                                      timeout=cfg.raw_timeout, release=self.server_version,
                                      fingerprints=cfg.fidelity_check)
        steps.mark("capture_check_s")
        self._start_fidelity()
        steps.mark("fidelity_s")
        self.bp = BackPressure([str(self.capture_dir), str(self.samples_dir)], high=cfg.high_water,
                               low=cfg.low_water, usage=self.usage, on_change=self._on_pressure)
        self.ledger.write("run_start", resumed=resumed, driver=__version__,
                          params=dict(asdict(cfg), server=redact_url(cfg.server)), capture_check=checked,
                          max_tokens_effective=self.limit.tokens, blank_lines=counts.blank,
                          startup=steps.record(server_checks_s=answered, tokenizer=tokenizer_way(self.tokenizer)),
                          fidelity_check=cfg.fidelity_settings(), weaker_check=self.weaker_check,
                          server={k: info.get(k) for k in ("version", "model_path", "tp_size", "chunked_prefill_size",
                                                           "disable_radix_cache", "standin")},
                          done_verified=done.live, done_shipped=done.shipped, discarded=done.discarded,
                          data_changed=self.data_changes, held=self.reconciled.summary())

    def _reconcile(self, done: runstate.DoneState) -> None:
        """Find the line of each sample the run holds in the dataset as it is now (reconcile.py): the feeder skips
        those lines; refused (before anything is sent) what cannot be reconciled without --accept-changed-data."""
        cfg = self.cfg
        rec = reconcile.reconcile(done, cfg.data, self.max_chars, cfg.owns(), same_files=not self.data_changes)
        why = rec.refusal()
        if why and not cfg.accept_changed_data:
            raise runstate.RunError(f"the dataset changed since run {cfg.run!r} last started: {why}")
        done.by_id = rec.by_id
        rec.write(self.state_dir)
        if self.data_changes:
            runstate.record_data(self.state_dir, self.data_now)
        self.reconciled = rec
        if self.data_changes or rec.vanished or rec.moved:
            print(f"hs-extract drive: {reconcile.describe(rec, self.data_changes)}", file=sys.stderr, flush=True)

    def _tick(self) -> None:
        while not self.stop.wait(self.cfg.status_interval):
            watcher = getattr(self, "watcher", None)
            if watcher is not None:
                self._sweep(set(self.regen_keys), REGEN_SWEPT)
                # a retried request prefilled twice: once its first capture is adopted, the retry's (written
                # later by a writer behind) is published and listed again; it is RAM on /dev/shm, remove it now
                # (looked up in the live dict: a copy of a million done keys every tick would cost more)
                self._sweep(self.done.by_key, LATE_SWEPT)
            if self.bp is not None and self.status.state in ("running", "paused"):
                self.status.state = "paused" if self.bp.paused else "running"
            try:
                self.status.write()
            except OSError:
                pass  # a full or missing state dir: the next tick tries again

    def _own_raw_keys(self) -> set[str]:
        """Raw samples in the capture dir whose tokens this run sent (per its ledger)."""
        return runstate.run_keys(self.state_dir / runstate.LEDGER, set(self.watcher.keys()))

    def _sweep(self, keys: Container[str], reason: str) -> None:
        """Remove this run's raw samples (and SGLang's health-check probe) left in the capture dir."""
        probe = store.sample_key(HEALTH_PROBE_IDS)
        for key in self.watcher.keys():  # a dataset sample of the probe's tokens in flight waits for its own
            if key not in self.inflight and (key == probe or key in keys):
                why = "SGLang health-check probe (input_ids [0])" if key == probe else reason
                if self.watcher.remove(key, reason=why, run=self.cfg.run):
                    self.ledger.write("raw_removed", key=key, reason=why)

    def _sweep_intents(self) -> None:
        """Intents nobody waits for (an interrupted run's): the capture dir is this driver's alone (locked)."""
        with self.keys_lock:
            waiting = set(self.inflight)
        for p in (self.capture_dir / intent.DIR).glob("*.json"):
            if p.stem not in waiting:
                p.unlink(missing_ok=True)

    def _on_retry(self, info: dict[str, Any]) -> None:
        self.status.update(retries=1)
        self.ledger.write("retry", **info)

    def _on_pressure(self, what: str, usage: dict[str, float]) -> None:
        self.status.state = "paused" if what == "pause" else "running"
        self.ledger.write(what, used_pct=usage, high_water=self.cfg.high_water, low_water=self.cfg.low_water)

    # ------------------------------------------------------------------ feeding
    def _feed(self) -> None:
        n = self.cfg.concurrency + self.cfg.awaiting  # the turns at the server bound what is sent (turns.py)
        work: queue.Queue = queue.Queue(maxsize=2 * n)
        workers = [threading.Thread(target=self._worker, args=(work,), name=f"hs-drive-{i}", daemon=True)
                   for i in range(n)]
        for w in workers:
            w.start()
        items = dataset.read(self.cfg.data, self.max_chars)
        if self.cfg.limit:  # the first N lines of the dataset, then this run's shard of them
            items = itertools.islice(items, self.cfg.limit)
        owns = self.cfg.owns()
        seq = itertools.count()  # the lines handed out, numbered: they claim their tokens in this order (order.py)
        for item in items:
            if self.stop.is_set():
                break
            if owns is not None and not owns(item.sample_id):
                continue  # another host's sample (--shard)
            if isinstance(item, dataset.Reject):
                self._reject(item)
            elif item.sample_id in self.done.by_id:
                self.status.update(done_before=1)
                self.status.c.done_keys.add(self.done.by_id[item.sample_id])
            else:
                numbered = (next(seq), item)
                while not self.stop.is_set():
                    try:
                        work.put(numbered, timeout=0.5)
                        break
                    except queue.Full:
                        pass
                else:
                    self.order.settle(numbered[0])  # never handed out: no later line waits for it
        for _ in workers:
            work.put(None)
        for w in workers:
            w.join()
        if self.stop_reason:
            self.ledger.write("stop", reason=self.stop_reason)

    def _worker(self, work: queue.Queue) -> None:
        """Take a turn at the server (turns.py), then the next sample; the turn is given back once the server
        has answered it, so at most --concurrency samples are being prepared and sent at once, in the
        dataset's order, while up to --awaiting more wait for their files, are checked and adopted."""
        while True:
            turn = self.turns.take(self.stop)
            got = work.get()
            if got is None or turn is None or self.stop.is_set():
                if turn is not None:
                    turn.release()
                if got is None:
                    return
                self.order.settle(got[0])
                continue
            seq, rec = got
            try:
                self._process(rec, turn, seq)
            except Exception as e:  # noqa: BLE001 - one sample's bug must not kill the run; it is recorded
                try:
                    self._failed(rec, None, "internal", f"{type(e).__name__}: {e}")
                except Exception as again:  # noqa: BLE001 - nothing can be recorded (a full state dir): a worker
                    # that died here left the feeder waiting for it for ever
                    self.request_stop(f"the run's records in {self.state_dir} cannot be written ({type(again).__name__}:"
                                      f" {again}); free space there (df -h {self.state_dir}), then run the same "
                                      "command again", EXIT_ERROR)
            finally:
                turn.release()
                self.order.settle(seq)  # a line that ended before it claimed its tokens

    def _reject(self, rej: dataset.Reject) -> None:
        self.rejects.add(rej)
        with self.status.lock:
            self.status.c.rejected = self.rejects.total
        self.ledger.write("reject", sample_id=rej.sample_id, reason=rej.reason, detail=rej.detail)
