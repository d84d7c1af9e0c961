"""The stand-in server's engine: the tiny model, the patched forward with the capture hook, and
SGLang's prefill scheduling (batches within a window, chunked passes, greedy decoding after).

Every prefill pass runs the real patched ``DeepseekV2Model.forward`` of the chosen SGLang
release in :class:`lab.sglang_sim.Sim` with an ``hs_patch.server.hook.CaptureHook`` attached;
the HTTP side is :mod:`lab.standin_server`, the requests :mod:`lab.standin_requests`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from hs_patch.engine.releases import RELEASES, TARGET, apply_edits
from hs_patch.host.patching import patcher
from hs_patch.server import checks as capture_checks
from hs_patch.server import config as capture_config
from hs_patch.server import hook as capture_hook
from lab.standin_requests import Request, input_logprobs, output_logprob, parse_request

log = logging.getLogger("standin")
RELEASE_DEFAULT = "0.5.16"


class Engine:
    """Tokenizer, model, patched forward + capture hook, and a prefill scheduler thread."""

    def __init__(self, model_dir: str, capture_dir: Optional[str], *, release: str = RELEASE_DEFAULT,
                 wheel: Optional[str] = None, chunked_prefill_size: int = 8192, batch_window_ms: float = 5.0,
                 context_length: Optional[int] = None, installed: bool = False,
                 max_total_num_tokens: int = 1 << 20, speculative: Optional[Any] = None,
                 settle_delay: float = 0.0):
        from transformers import AutoTokenizer, DeepseekV3ForCausalLM

        from lab.sglang_sim import Sim

        if release not in RELEASES:
            raise SystemExit(f"--release {release}: the patch supports {', '.join(RELEASES)}")
        self.release, self.model_dir = release, str(model_dir)
        self.spec = speculative  # lab.standin_spec.Speculative: EAGLE-3's reporting, emulated over greedy decoding
        self.chunk = chunked_prefill_size
        self.window = batch_window_ms / 1000.0
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = DeepseekV3ForCausalLM.from_pretrained(self.model_dir, dtype=torch.bfloat16).eval()
        cfg = self.model.config
        self.context_arg = context_length  # SGLang's server_args.context_length: None unless given
        self.context_length = context_length or int(cfg.max_position_embeddings)
        self.max_total_num_tokens = max_total_num_tokens
        self.max_req_input_len = min(self.context_length - 1, max_total_num_tokens - 1) - 5
        self.vocab = int(cfg.vocab_size)
        release, source, code = self._patched_source(release, wheel, installed)
        self.release = release
        n = cfg.num_hidden_layers
        env = dict(os.environ, HS_CAPTURE="1" if capture_dir else "0",
                   HS_CAPTURE_DIR=str(Path(capture_dir or "/nonexistent").resolve()))
        if len(capture_config.default_layers(n)) < 3:  # the product's default has fewer planes on a shallow model
            env.setdefault("HS_CAPTURE_LAYERS", ",".join(map(str, sorted({1, n // 2, n - 1}))))
        cap = capture_config.from_env(env)
        cap = cap.for_model(n)
        problems = capture_checks.capture_refusals(cap, {"tp_size": 1, "chunked_prefill_size": self.chunk})
        if problems:  # what hook.attach refuses in a real server
            raise SystemExit("stand-in: " + "; ".join(problems))
        if not cap.slot_tokens:
            cap = dataclasses.replace(cap, slot_tokens=self.chunk)
        meta = {"sglang_release": f"{release} (stand-in)", "model_type": str(cfg.model_type),
                "model": self.model_dir, "architecture": ",".join(cfg.architectures or []), "tp_size": "1",
                "tp_rank": "0"}
        self.hook = capture_hook.CaptureHook(cap, hidden_size=int(cfg.hidden_size), metadata=meta, release=release) \
            if capture_dir else None  # no capture dir: a pristine-behaving server (the patched forward, no hook)
        if self.hook:  # the line hook.attach logs on the writing rank (tests/gpu/tp_compare.py counts them)
            logging.getLogger("hs_patch").info("hs_patch: capturing layers %s + final=%s into %s (rank 0 of 1); "
                                               "made at start: host staging (%d x %d tokens)", list(cap.layers),
                                               cap.final, cap.directory, cap.slots, cap.slot_tokens)
        self.capture = cap
        if self.hook and settle_delay:  # benches: a writer that settles a pass only this much later (a slow disk)
            real_settle = self.hook.writer._settle

            def slow_settle(p: Any) -> None:
                time.sleep(settle_delay)
                real_settle(p)

            self.hook.writer._settle = slow_settle
        self.refs: dict[str, Any] = {}
        self.rows: dict[str, list[torch.Tensor]] = {}   # request -> the pass outputs (post-norm) so far
        self.sim = Sim(release, source, self.model, self.refs, hook=self.hook, code=code)
        self.incoming: "queue.Queue[Request]" = queue.Queue()
        self.decode_q: "queue.Queue[Request]" = queue.Queue()
        self.active = 0
        self._lock = threading.Lock()
        self.model_lock = threading.Lock()  # reference() hooks the model's layers: one forward at a time
        self.passes = 0
        self.dead: Optional[str] = None        # why a scheduler thread ended: every request then fails at once
        self._inflight: dict[str, Request] = {}   # iid -> a request submit() waits on
        for target, name in ((self._schedule, "standin-prefill"), (self._decode, "standin-decode")):
            threading.Thread(target=self._guarded, args=(target,), name=name, daemon=True).start()

    # ------------------------------------------------------------------ API
    def submit(self, req: Request, timeout: float = 600.0) -> dict[str, Any]:
        with self._lock:
            if self.dead is not None:  # SGLang's scheduler dies with the server: no request waits on it
                raise RuntimeError(f"the scheduler ended: {self.dead}")
            self.active += 1
            self._inflight[req.iid] = req
        try:
            self.incoming.put(req)
            if not req.done.wait(timeout):
                raise RuntimeError(f"request {req.rid} did not finish within {timeout:.0f}s")
            if req.error is not None:
                raise RuntimeError(req.error)
            return req.result
        finally:
            with self._lock:
                self.active -= 1
                self._inflight.pop(req.iid, None)

    def idle(self) -> bool:
        with self._lock:
            return self.active == 0

    def info(self) -> dict[str, Any]:
        return {"version": self.release, "standin": True, "disable_radix_cache": True,
                "chunked_prefill_size": self.chunk, "tp_size": 1, "dp_size": 1, "pp_size": 1,
                "context_length": self.context_arg, "max_total_num_tokens": self.max_total_num_tokens,
                "max_req_input_len": self.max_req_input_len, "model_path": self.model_dir,
                "hs_capture_dir": self.capture.directory if self.hook else None,
                "hs_capture_layers": list(self.capture.layers) if self.hook else None,
                "passes": self.passes, "speculative_algorithm": None,
                **(self.spec.info() if self.spec else {})}

    def close(self) -> None:
        if self.hook is not None:
            self.hook.close()

    @staticmethod
    def _patched_source(release: str, wheel: Optional[str], installed: bool) -> tuple[str, str, Any]:
        """(release, its patched ``deepseek_v2.py`` source, the release's other code the harness runs).

        A wheel's files are read in a temporary directory removed before the server starts, so a
        stand-in killed later (the fault tests SIGKILL it) leaves nothing behind in /tmp.
        """
        from lab.sglang_sim import ReleaseCode
        from lab.sglang_wheels import extract_site, sglang_wheel

        if installed:  # the SGLang installed (and patched, e.g. by Ansible) for this Python
            target = patcher.inspect_target(None)
            if target.state != "patched":
                raise SystemExit(f"{target.path} is {target.state}, not patched: run hs-patch apply")
            release = target.release.version
            return release, target.text, ReleaseCode.read(target.site)
        with tempfile.TemporaryDirectory(prefix="standin-sglang-") as tmp:
            site = extract_site(Path(wheel) if wheel else sglang_wheel(release), Path(tmp))
            source = apply_edits(RELEASES[release], (site / TARGET).read_text())
            return release, source, ReleaseCode.read(site)

    def _guarded(self, target: Callable[[], None]) -> None:
        """Run a scheduler loop; if it raises, fail every request now (not after submit's timeout)."""
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting request, then logged
            log.exception("stand-in scheduler thread %s ended", threading.current_thread().name)
            with self._lock:
                self.dead = f"{type(e).__name__}: {e}"
                waiting = list(self._inflight.values())
            for req in waiting:
                self._fail(req, e)

    # ------------------------------------------------------------------ prefill scheduler
    def _gather(self) -> list[Request]:
        reqs = [self.incoming.get()]
        deadline = time.monotonic() + self.window
        while (left := deadline - time.monotonic()) > 0:
            try:
                reqs.append(self.incoming.get(timeout=left))
            except queue.Empty:
                break
        return reqs

    def _schedule(self) -> None:
        from lab.sglang_sim import reference

        pending: list[list[Any]] = []   # [request, tokens prefilled so far]
        while True:
            if not pending:
                pending.extend([r, 0] for r in self._gather())
            else:
                while True:
                    try:
                        pending.append([self.incoming.get_nowait(), 0])
                    except queue.Empty:
                        break
            budget, parts, finished = self.chunk, [], []
            while pending and budget > 0:
                req, start = pending[0]
                if req.iid not in self.refs:
                    try:
                        with self.model_lock, torch.no_grad():
                            self.refs[req.iid] = reference(self.model, req.ids)
                    except Exception as e:  # noqa: BLE001 - answered to the client
                        self._fail(req, e)
                        pending.pop(0)
                        continue
                n = min(len(req.ids) - start, budget)
                parts.append((req, start, n))
                budget -= n
                if start + n == len(req.ids):
                    finished.append(pending.pop(0)[0])
                else:
                    pending[0][1] = start + n
            if parts and not self._pass(parts, finished):  # a failed pass fails all its requests
                failed = {r.iid for r, _, _ in parts}
                pending[:] = [p for p in pending if p[0].iid not in failed]

    def _pass(self, parts: list[tuple[Request, int, int]], finished: list[Request]) -> bool:
        from lab.sglang_sim import ForwardBatch, ForwardMode, Part

        sim_parts = [Part(r.iid, s, n) for r, s, n in parts]
        ids = torch.cat([self.refs[r.iid].ids[s:s + n] for r, s, n in parts])
        rids = None if self.release == "0.5.9" else [r.rid for r, _, _ in parts]
        fb = ForwardBatch(ForwardMode("EXTEND"), ids, [n for _, _, n in parts], [s for _, s, _ in parts],
                          sim_parts, rids=rids,
                          orig_seq_lens=torch.tensor([len(r.ids) for r, _, _ in parts], dtype=torch.int32))
        try:
            with torch.no_grad():
                out = self.sim.forward(fb)
        except Exception as e:  # noqa: BLE001 - e.g. the capture writer failed: every request in the pass fails
            log.error("prefill pass failed: %s", e)
            for r, _, _ in parts:
                self._fail(r, e)
                self.refs.pop(r.iid, None)
                self.rows.pop(r.iid, None)
            return False
        self.passes += 1
        row = 0
        for r, _, n in parts:   # the model's output rows of this pass, per request (same pass as the dump)
            self.rows.setdefault(r.iid, []).append(out[row:row + n])
            row += n
        for req in finished:
            self.refs.pop(req.iid)
            states = torch.cat(self.rows.pop(req.iid))
            with torch.no_grad():   # bf16 logits, as SGLang's logits processor computes them
                first = int(self.model.lm_head(states[-1:]).argmax(-1))
                if req.return_logprob:
                    self._input_logprobs(req, states, first)
            if req.max_new_tokens <= 1 or first == self.model.config.eos_token_id:
                self._answer(req, [first])
            else:
                self.decode_q.put(req)
        return True

    # ------------------------------------------------------------------ decoding (greedy)
    def _decode(self) -> None:
        """Greedy decoding with the transformers model and its KV cache, one step per model_lock hold."""
        import inspect

        eos = self.model.config.eos_token_id
        # transformers renamed past_key_values to cache (5.x); take whichever this version has
        cache_arg = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        while True:
            req = self.decode_q.get()
            try:
                out_ids: list[int] = []
                step, past = torch.tensor([req.ids]), None
                while len(out_ids) < req.max_new_tokens and (not out_ids or out_ids[-1] != eos):
                    with self.model_lock, torch.no_grad():
                        out = self.model(input_ids=step, use_cache=True, **{cache_arg: past})
                    past = getattr(out, cache_arg)
                    if self.spec is not None and self.spec.flip_at == len(out_ids):  # an emulated near-tie flip
                        best, top2 = int(out.logits[0, -1].argmax()), out.logits[0, -1].topk(2).indices.tolist()
                        out_ids.append(next(t for t in top2 if t != best))
                    else:
                        out_ids.append(int(out.logits[0, -1].argmax()))
                    if req.return_logprob and len(out_ids) > 1:   # the first came from the prefill pass
                        self._output_logprob(req, out.logits[0, -1], out_ids[-1])
                    step = torch.tensor([[out_ids[-1]]])
                self._answer(req, out_ids)
            except Exception as e:  # noqa: BLE001
                self._fail(req, e)

    def _answer(self, req: Request, out_ids: list[int]) -> None:
        eos = self.model.config.eos_token_id
        if out_ids and out_ids[-1] == eos:
            finish = {"type": "stop", "matched": eos}
        else:
            finish = {"type": "length", "length": len(out_ids)}
        req.result = {"text": self.tokenizer.decode(out_ids, skip_special_tokens=True), "output_ids": out_ids,
                      "meta_info": {"id": req.rid, "finish_reason": finish, "prompt_tokens": len(req.ids),
                                    "completion_tokens": len(out_ids), "cached_tokens": 0,
                                    "e2e_latency": round(time.time() - req.start, 4), **req.logprobs,
                                    **(self.spec.meta(req.ids, out_ids) if self.spec else {})}}
        req.done.set()

    # ------------------------------------------------------------------ logprobs and parsing (standin_requests)
    def _input_logprobs(self, req: Request, states: torch.Tensor, first: int) -> None:
        input_logprobs(req, self.model.lm_head, states, first)

    def _output_logprob(self, req: Request, logits: torch.Tensor, token: int) -> None:
        output_logprob(req, logits, token)

    def _fail(self, req: Request, e: BaseException) -> None:
        req.error = f"{type(e).__name__}: {e}"
        req.done.set()

    def parse(self, body: Any) -> Request:
        return parse_request(body, self.tokenizer, self.vocab, self.context_length, self.max_req_input_len)
