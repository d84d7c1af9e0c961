"""What the driver does for one sample: tokens and loss mask, regeneration, intent, request,
the fidelity check of the sample the hook wrote, adoption, and the bookkeeping of each outcome.

A mixin of :class:`hs_patch.host.driver.run.Driver` (which owns the run: locks, preparation,
feeding, sweeps, status); split out so each module says one thing.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
import uuid
from typing import Optional

from hs_patch import __version__
from hs_patch.host.driver import chat, dataset, limits, regenerate, runstate
from hs_patch.host.fidelity import check as fidelity
from hs_patch.host.driver.adopt import AdoptError, adopt
from hs_patch.host.driver.capture_dir import RawTimeout
from hs_patch.host.driver.client import ClientError, ServerRejected
from hs_patch.host.driver.missing import Failure
from hs_patch.host.driver.turns import Turn
from hs_patch.host.fidelity import settings
from hs_patch.host.fidelity.policy import FidelityMonitor
from hs_patch.host.driver.startup import Pending
from hs_patch.host.model_files import ModelFileError, check_head_and_norm
from hs_patch.samples import intent, reader, store

EXIT_OK, EXIT_ERROR, EXIT_INCOMPLETE, EXIT_FAILURES, EXIT_SIGNAL = 0, 1, 3, 4, 130  # hs-extract drive's exit codes
CAPTURE_PARAMS = {"max_new_tokens": 1, "temperature": 0.0}  # 1 new token: the least that runs a prefill


class SampleSteps:
    """The per-sample half of the driver (its attributes are set up by ``Driver``)."""

    checker: Optional[Pending[fidelity.FidelityChecker]] = None   # loaded in a thread (startup.py)
    monitor: Optional[FidelityMonitor] = None

    def _start_fidelity(self) -> None:
        """The production fidelity check (--no-fidelity-check: off): the LM head and final norm found by name in the
        model dir's headers now, so a run that cannot be checked is refused before its first request; their weights
        (and the embedding's row checksums) read in a thread from the first request on: the first sample's check
        waits for them."""
        cfg = self.cfg
        if not cfg.fidelity_check:
            return
        try:
            check_head_and_norm(cfg.model)
        except (ModelFileError, OSError, KeyError, ValueError) as e:
            raise runstate.RunError(self._unreadable(e)) from None
        self.checker = Pending("hs-fidelity-load", self._load_checker, start=False)  # at the first request (_capture)
        self.monitor = FidelityMonitor(cfg.fidelity_max_consecutive)

    def _unreadable(self, e: BaseException) -> str:
        return (f"the fidelity check cannot read the LM head and final norm from {self.cfg.model}: {e}. Point --model "
                "at the served model's directory, or run with --no-fidelity-check (then nothing checks the dumped "
                "states)")

    def _load_checker(self) -> fidelity.FidelityChecker:
        cfg = self.cfg
        try:
            head = fidelity.LMHead.from_model_dir(cfg.model)
        except (ModelFileError, OSError, KeyError, ValueError) as e:
            raise runstate.RunError(self._unreadable(e)) from None
        checker = fidelity.FidelityChecker(head, self.state_dir, tie_tolerance=cfg.fidelity_tie_tolerance,
                                           positions=cfg.fidelity_positions, batch=cfg.concurrency,
                                           rows=cfg.fidelity_rows, gaps=cfg.fidelity_gap_positions)
        prefetch_embeddings(checker, cfg.model)
        return checker

    def _stop_fidelity(self) -> None:
        if self.checker is not None and self.checker.started():  # never started: no sample was sent
            try:
                checker = self.checker.result()
            except Exception:  # noqa: BLE001 - never loaded: each sample that needed it failed saying why
                return
            checker.close()

    def _check_fidelity(self, rec: dataset.Record, key: str, entry: dict, response: dict) -> Optional[dict]:
        """The check's result for the sample's manifest line if every plane of the sample the hook wrote is
        what the server computed ({} when no check runs); else None: it is removed, logged to
        fidelity.jsonl, failed, and K such in a row stop the run."""
        if self.checker is None:
            return {}
        path = self.capture_dir / entry["file"]
        try:
            checker = self.checker.result()
        except runstate.RunError as e:  # the weights could not be read after all: no sample can be checked
            self._failed(rec, key, "fidelity", str(e))
            self.request_stop(str(e), EXIT_ERROR)
            return None
        try:
            chk = checker.check(key, path, response, sample_id=rec.sample_id, run=self.cfg.run)
            meta = reader.read_header(path).metadata
        except (store.SampleError, ClientError, OSError, RuntimeError, ValueError, KeyError) as e:
            self._failed(rec, key, "fidelity", f"the fidelity check could not run: {e}")
            return None
        reason = self.monitor.observe(chk, meta)
        if chk.ok:
            return settings.result(chk)
        self.watcher.remove(key, reason="fidelity mismatch", run=self.cfg.run, sample_id=rec.sample_id)
        if chk.problems:
            what = chk.problems[0]
        elif chk.mismatches:
            what = (f"the dumped final state gives other tokens than the server's at {chk.mismatches} of "
                    f"{chk.checked} {chk.kind} position(s)")
        else:
            what = (f"the server's logit gaps differ from the dumped final state's at {len(chk.gap_mismatches)} of "
                    f"{chk.gaps} of its last positions: the final state is another request's, shifted or scaled")
        self._failed(rec, key, "fidelity", f"{what} (see {self.state_dir}/{fidelity.FIDELITY_LOG}); sample not kept")
        if reason:
            self.request_stop(reason + "; fix the cause, then run the same command again", EXIT_FAILURES)
        return None

    def _failed(self, rec: dataset.Record, key: Optional[str], stage: str, error: str, *, retry: bool = True) -> None:
        """One sample failed; ``retry`` False: it fails the same way on every run (missing.py). Samples waiting at
        the same time fail together: the one that reaches the consecutive limit stops the run, and those after it
        are abandoned (redone on resume), never counted past the limit."""
        with self.failing:
            if self.stop.is_set():  # interrupted by the stop, not a failure of its own: redone on resume
                self.ledger.write("abandoned", sample_id=rec.sample_id, key=key, stage=stage, error=error)
                return
            self.status.error(f"{rec.sample_id}: {error}")
            self.status.update(failed=1, consecutive_failures=1)
            with self.status.lock:
                self.failures[rec.sample_id] = Failure(stage, error, retry)
            self.ledger.write("failed", sample_id=rec.sample_id, key=key, stage=stage, error=error, retry=retry)
            n = self.status.c.consecutive_failures
            if n >= self.cfg.max_consecutive_failures:
                self.request_stop(f"stopped after {n} consecutive failures (last: {error}); fix the cause, then run "
                                  "the same command again to resume", EXIT_FAILURES)

    def _process(self, rec: dataset.Record, turn: Turn, seq: int) -> None:
        """One sample, line ``seq`` of those handed out, begun in a turn at the server (held while it is tokenized,
        regenerated and sent); it claims its tokens once every line before it has claimed its own (order.py)."""
        try:
            ids, mask, prov = self._tokens(rec)
        except dataset.Invalid as e:
            self._reject(dataset.Reject(rec.source, rec.line, e.reason, str(e)))
            return
        except ClientError as e:
            self._failed(rec, None, "regenerate", str(e), retry=not refused(e))
            return
        key = store.sample_key(ids)
        turn = self._after_earlier_lines(seq, turn)
        if turn is None:  # stopped meanwhile: redone on resume
            self.ledger.write("abandoned", sample_id=rec.sample_id, key=key, stage="order", error=self.stop_reason)
            return
        try:
            self._claim_and_capture(rec, key, ids, mask, prov, turn, seq)
        finally:
            turn.release()

    def _after_earlier_lines(self, seq: int, turn: Turn) -> Optional[Turn]:
        """The turn to send line ``seq`` in, once every line before it has claimed its tokens; while it waits the
        turn is given back (an earlier line may still be generating, --regenerate) and a new one taken after.
        None if the run stops first."""
        if self.order.ready(seq):
            return turn
        turn.release()
        if not self.order.wait(seq, self.stop):
            return None
        return self.turns.take(self.stop)

    def _claim_and_capture(self, rec: dataset.Record, key: str, ids: list[int], mask: list[int],
                           prov: dict[str, str], turn: Turn, seq: int) -> None:
        try:
            if key in self.shipped.keys and key not in self.done.by_key:  # at the destination (its manifest, via the shipper)
                self.status.update(done_before=1)
                self.status.c.done_keys.add(key)
                self.ledger.write("done_at_destination", sample_id=rec.sample_id, key=key)
                return
            with self.keys_lock:
                first = self.done.by_key.get(key) or self.inflight.get(key)
                if first is None:
                    self.inflight[key] = rec.sample_id
        finally:
            self.order.settle(seq)  # claimed (or held already): the lines after it may claim theirs
        if first == rec.sample_id:  # held by a sample of this very line, found by its tokens (reconcile.py)
            self.status.update(done_before=1)
            self.status.c.done_keys.add(key)
            self.ledger.write("held_by_tokens", sample_id=rec.sample_id, key=key)
            return
        if first is not None:
            self.status.update(duplicates=1)
            self.ledger.write("duplicate", sample_id=rec.sample_id, key=key, duplicate_of=first)
            return
        try:
            self._capture(rec, key, ids, mask, prov, turn)
        finally:
            with self.keys_lock:
                self.inflight.pop(key, None)

    def _tokens(self, rec: dataset.Record) -> tuple[list[int], list[int], dict[str, str]]:
        cfg = self.cfg
        built: Optional[regenerate.Rebuilt] = None
        prov = {"sample_id": rec.sample_id, "source": rec.source, "line": str(rec.line), "run": cfg.run,
                runstate.LINE_SHA256: rec.line_sha256,
                "source_id": rec.source_id, "input_format": rec.format, "regenerated": "0", "truncated_from": "",
                "driver": f"hs-extract {__version__}",
                # where it was extracted: this host, and the shard (a reassigned shard: its own, not this host's)
                "host": cfg.host_name or socket.gethostname(), "shard": cfg.shard or "0/1"}
        if rec.input_ids is not None:
            ids, mask = list(rec.input_ids), list(rec.loss_mask or [1] * len(rec.input_ids))
            prov["loss_mask"] = "given" if rec.loss_mask else "all"
            bad = next((t for t in ids if t >= self.vocab), None)
            if bad is not None:
                raise dataset.Invalid("bad_field", f"token id {bad} is outside the vocabulary (< {self.vocab})")
        elif cfg.regenerate:
            built = self._regenerate(rec)
            if built.cut >= 0 and cfg.on_too_long == "skip":
                raise dataset.Invalid("too_long", f"the prompt of assistant turn {built.cut} reaches "
                                                  f"{self.limit.why}")
            ids, mask = built.input_ids, built.loss_mask
            prov["regenerated"], prov["loss_mask"] = "1", "generated"
        else:
            if cfg.on_too_long == "skip":
                limits.check_chars(rec.messages, self.limit, self.longest_token)
            enc = chat.encode_chat(self.tokenizer, rec.messages, cfg.chat_template_kwargs)
            ids, mask = enc.input_ids, enc.loss_mask
            prov["loss_mask"] = "assistant"
        limit = self.limit.tokens
        if len(ids) > limit:
            if cfg.on_too_long == "skip":
                raise dataset.Invalid("too_long", f"{len(ids)} tokens > {self.limit.why}")
            prov["truncated_from"] = str(len(ids))
            ids, mask = ids[:limit], mask[:limit]
            if not any(mask):
                raise dataset.Invalid("too_long", f"{prov['truncated_from']} tokens truncated to {limit} "
                                                  "leave no assistant token")
        if built is not None:  # what the sample keeps of the answers, after any truncation
            kept = built.kept_within(len(ids))
            dropped = built.dropped + built.kept - kept
            self.ledger.write("regen_sample", sample_id=rec.sample_id, kept=kept, dropped=dropped,
                              not_generated_from=built.cut if built.cut >= 0 else None, tokens=len(ids))
            prov["regen_answers"], prov["regen_left_out"] = str(kept), str(dropped)   # counted once it is done
        return ids, mask, prov

    def _rid(self, prefix: str, rec: dataset.Record) -> str:
        tag = hashlib.sha256(rec.sample_id.encode()).hexdigest()[:8]
        return f"{prefix}{self.cfg.run}-{tag}-{next(self.counter)}-{uuid.uuid4().hex[:8]}"

    def _regenerate(self, rec: dataset.Record) -> regenerate.Rebuilt:
        """Each assistant turn generated anew by the target model (not captured); the sample's ids and loss mask
        as the server had them (:mod:`hs_patch.host.driver.regenerate`)."""
        cfg = self.cfg
        params = {"max_new_tokens": cfg.regen_max_new_tokens, "temperature": cfg.regen_temperature,
                  "top_p": cfg.regen_top_p}

        def generate(prompt: list[int], turn: int) -> dict:
            key, rid = store.sample_key(prompt), self._rid("nocap-", rec)
            with self.keys_lock:
                self.regen_keys.add(key)
            self.ledger.write("regen_turn", sample_id=rec.sample_id, turn=turn, key=key, rid=rid,
                              prompt_tokens=len(prompt))
            res = self.client.generate(prompt, params, rid, context={"sample_id": rec.sample_id})
            meta = res["meta_info"]
            self.ledger.write("regen_done", sample_id=rec.sample_id, turn=turn, rid=rid,
                              completion_tokens=meta.get("completion_tokens"), finish_reason=meta.get("finish_reason"))
            return res

        return regenerate.regenerate(self.tokenizer, rec.messages or [], generate, cfg.chat_template_kwargs,
                                     limit=self.limit.tokens)

    def _capture(self, rec: dataset.Record, key: str, ids: list[int], mask: list[int], prov: dict[str, str],
                 turn: Turn) -> None:
        """Send the sample's tokens in the worker's turn at the server (``turns.py``), given back once the server
        has answered; then wait for the sample, check it and adopt it while the next request has the turn."""
        cfg = self.cfg
        if not self.bp.wait(self.stop):
            return
        rid = self._rid("hs-", rec)
        self.watcher.read_new()
        if self.watcher.get(key) is not None:  # an earlier capture of these tokens (another run's, another
            # client's): the writer never moves a sample over another, so it would stand in for this one
            self.watcher.remove(key, reason="an earlier capture of the same tokens, before sending them again",
                                run=cfg.run, sample_id=rec.sample_id)
        prov = dict(prov, fidelity_check=json.dumps(cfg.fidelity_settings(), sort_keys=True))  # into the header
        try:
            intent.write(self.capture_dir, key, mask, prov)  # the hook writes mask + provenance into the sample
        except (OSError, intent.IntentError) as e:
            self._failed(rec, key, "intent", f"cannot write the sample's intent into {self.capture_dir}: {e}",
                         retry=not isinstance(e, intent.IntentError))  # an IntentError is the line's own
            return
        self.watcher.read_new()  # an earlier write of these tokens must count as before this request
        after = self.watcher.seq
        t0 = time.monotonic()
        self.ledger.write("sent", sample_id=rec.sample_id, key=key, rid=rid, tokens=len(ids),
                          loss_tokens=sum(mask), truncated_from=prov["truncated_from"] or None)
        self.status.update(in_flight=1)
        if self.checker is not None:
            self.checker.start()  # the fidelity check's weights, read while the server computes (startup.py)
        adopted = False
        try:
            extra = fidelity.request_fields(key, len(ids), fraction=cfg.fidelity_fraction,
                                            positions=cfg.fidelity_positions,
                                            gaps=cfg.fidelity_gap_positions) if self.checker else {}
            try:
                out = self.client.generate(ids, CAPTURE_PARAMS, rid, context={"sample_id": rec.sample_id}, **extra)
            except ClientError as e:
                self._failed(rec, key, "generate", str(e), retry=not refused(e))
                return
            finally:
                turn.release()  # answered: the next request goes while this sample is written, checked, adopted
            try:
                entry = self.watcher.wait(key, after, cfg.raw_timeout)
            except RawTimeout:
                self._failed(rec, key, "wait_raw", (
                    f"the server answered but no sample {key} appeared in {self.capture_dir}/manifest.jsonl within "
                    f"{cfg.raw_timeout:.0f}s (--raw-timeout). Is the server started with HS_CAPTURE=1 and "
                    f"HS_CAPTURE_DIR={self.capture_dir} (= --capture-dir)? Does its HS_CAPTURE_SKIP_RID_PREFIX "
                    f"match this request id {rid}? Is its writer failing (errors.jsonl, hook_status.json)?"))
                return
            checked = self._check_fidelity(rec, key, entry, out)  # before the shipper can see it
            if checked is None:
                return
            try:
                written = adopt(self.watcher, entry, self.samples_dir, sample_id=rec.sample_id, run=cfg.run,
                                fidelity=checked or None)
                adopted = True
            except (AdoptError, OSError) as e:
                self._failed(rec, key, "adopt", str(e))
                return
        finally:
            self.status.update(in_flight=-1)
            if not adopted:
                intent.remove(self.capture_dir, key)
        with self.keys_lock:
            self.done.by_key[key] = rec.sample_id
            self.done.by_id[rec.sample_id] = key
        with self.status.lock:
            self.status.c.done_keys.add(key)
            self.status.c.consecutive_failures = 0
        self.status.update(done_now=1, tokens=len(ids), loss_tokens=sum(mask), bytes=written.nbytes)
        if "regen_answers" in prov:
            with self.keys_lock:
                self.regen["lines"] += 1
                self.regen["answers_kept"] += int(prov["regen_answers"])
                self.regen["answers_left_out"] += int(prov["regen_left_out"])
        self.ledger.write("done", sample_id=rec.sample_id, key=key, rid=rid, file=written.path.name,
                          bytes=written.nbytes, sha256=written.sha256, tokens=len(ids),
                          seconds=round(time.monotonic() - t0, 3))


def refused(e: ClientError) -> bool:
    """The server refused this very request (HTTP 400: its input): it refuses it again on every run."""
    return isinstance(e, ServerRejected) and e.status == 400


def prefetch_embeddings(checker: fidelity.FidelityChecker, model_dir: str) -> None:
    """The embedding weight's row checksums in the weight's own dtype (the samples' dtype on every served model we
    know), made now instead of in the first sample's check; another dtype is made when a sample needs it."""
    import torch

    from hs_patch.host.fidelity.checksums import EMBED_NAMES
    from hs_patch.host.model_files import find_name, tensor_shape

    if checker.embeddings is None:
        return
    try:
        _, dtype = tensor_shape(model_dir, find_name(model_dir, EMBED_NAMES, "embedding weight"))
    except ModelFileError:
        return  # the check says so when a sample needs it
    as_torch = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(dtype)
    if as_torch is not None:
        try:
            checker.embeddings.table(as_torch)
        except Exception:  # noqa: BLE001 - made again, and said, when a sample needs it (as without the prefetch)
            pass
