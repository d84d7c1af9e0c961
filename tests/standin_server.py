#!/usr/bin/env python3
"""STAND-IN for a capturing SGLang server, for tests and benchmarks on hosts without a GPU.

This is NOT SGLang. It speaks the subset of SGLang's native HTTP API that the driver
uses, and produces samples through the SAME capture hook and sample store as the real
patched server:

- the model is a tiny random ``transformers`` DeepseekV3 from ``--model`` (see
  tests/tiny_model.py);
- every prefill pass runs the real patched ``DeepseekV2Model.forward`` of the chosen
  SGLang release (taken from the release's wheel and patched by hs_patch) in
  ``tests/sglang_sim.Sim``, with an ``hs_patch.server.hook.CaptureHook`` attached, so the files in
  ``--capture-dir`` appear exactly as the real server writes them (writer threads,
  ``<key>.safetensors``, ``manifest.jsonl``, ``hook_status.json``);
- requests that arrive within ``--batch-window-ms`` are prefilled together, in passes of
  at most ``--chunked-prefill-size`` tokens (a longer prompt continues in the next pass,
  first, as SGLang's chunked prefill does), so batching and chunk reassembly are exercised;
- request ids reach the forward batch on releases >= 0.5.10 (so ``nocap-`` rids are not
  captured), not on 0.5.9 (so everything is), as in SGLang.

Endpoints: ``POST /generate`` (``input_ids`` or ``text``, ``sampling_params``, ``rid``,
``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``; answers ``text``,
``output_ids``, ``meta_info`` {id, finish_reason, prompt_tokens, completion_tokens,
cached_tokens, e2e_latency, and with return_logprob SGLang's input_token_logprobs,
input_top_logprobs, output_token_logprobs, output_top_logprobs: ``[logprob, id, null]``
entries, the first input entry None}); the first token and the logprobs come from the
bf16 ``lm_head`` over the prefill pass's own output (the same pass the hook dumped), later
tokens from greedy decoding whatever the temperature (the transformers model with its KV
cache); 400 with ``{"error": {"message"}}`` for bad input.
``GET /health`` and ``/health_generate``: like SGLang, when idle they prefill ``input_ids
[0]`` with a ``HEALTH_CHECK_`` rid (a capturing server writes it as a sample);
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` makes ``/health`` answer without it.
``GET /get_server_info`` (and ``/server_info``): ``version`` (the release), ``disable_radix_cache:
true``, ``chunked_prefill_size``, ``tp_size: 1``, ``context_length`` (the server argument: null unless
``--context-length`` is given, as in SGLang), ``max_total_num_tokens`` and ``max_req_input_len`` (SGLang's
scheduler fields: ``min(context_len - 1, max_total_num_tokens - 1) - 5``, where ``context_len`` is
``--context-length`` or the model's ``max_position_embeddings``), ``model_path``, ``standin: true``.
Length checks as SGLang makes them: ``len >= context_len`` and ``len + max_new_tokens >= context_len``
are refused (tokenizer manager), and ``len >= max_req_input_len`` (scheduler), with HTTP 400.

Capture settings come from the same HS_CAPTURE_* variables as the real server
(HS_CAPTURE_DIR is ``--capture-dir``; HS_CAPTURE_LAYERS defaults to 1,<mid>,<last>).
Dependencies: torch, transformers, safetensors and the standard library.

    python3 tests/standin_server.py --model DIR --port P --capture-dir D [--release 0.5.16]
            [--chunked-prefill-size N] [--sglang-wheel PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import json
import logging
import os
import queue
import signal
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402

from hs_patch.server import checks as capture_checks  # noqa: E402
from hs_patch.server import config as capture_config  # noqa: E402
from hs_patch.server import hook as capture_hook  # noqa: E402
from hs_patch.host.patching import patcher  # noqa: E402
from hs_patch.releases import RELEASES, TARGET, apply_edits  # noqa: E402

log = logging.getLogger("standin")
RELEASE_DEFAULT = "0.5.16"


@dataclass
class Request:
    rid: str
    ids: list[int]
    max_new_tokens: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    iid: str = field(default_factory=lambda: uuid.uuid4().hex)
    start: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)
    result: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    logprobs: dict[str, list] = field(default_factory=dict)   # SGLang's meta_info logprob fields


class BadRequest(ValueError):
    pass


class Engine:
    """Tokenizer, model, patched forward + capture hook, and a prefill scheduler thread."""

    def __init__(self, model_dir: str, capture_dir: Optional[str], *, release: str = RELEASE_DEFAULT,
                 wheel: Optional[str] = None, chunked_prefill_size: int = 8192, batch_window_ms: float = 5.0,
                 context_length: Optional[int] = None, installed: bool = False,
                 max_total_num_tokens: int = 1 << 20):
        from transformers import AutoTokenizer, DeepseekV3ForCausalLM

        from sglang_sim import Sim, load_aux_module
        from sglang_wheels import extract_site, sglang_wheel

        if release not in RELEASES:
            raise SystemExit(f"--release {release}: the patch supports {', '.join(RELEASES)}")
        self.release, self.model_dir = release, str(model_dir)
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
        self._site = tempfile.TemporaryDirectory(prefix="standin-sglang-")
        if installed:  # the SGLang installed (and patched, e.g. by Ansible) for this Python
            target = patcher.inspect_target(None)
            if target.state != "patched":
                raise SystemExit(f"{target.path} is {target.state}, not patched: run hs-patch apply")
            release, site, source = target.release.version, target.site, target.text
            self.release = release
        else:
            site = extract_site(Path(wheel) if wheel else sglang_wheel(release), Path(self._site.name))
            source = apply_edits(RELEASES[release], (site / TARGET).read_text())
        aux = load_aux_module(site) if release == "0.5.23" else None
        n = cfg.num_hidden_layers
        env = dict(os.environ, HS_CAPTURE="1" if capture_dir else "0",
                   HS_CAPTURE_DIR=str(Path(capture_dir or "/nonexistent").resolve()))
        env.setdefault("HS_CAPTURE_LAYERS", ",".join(map(str, sorted({1, n // 2, n - 1}))))
        cap = capture_config.from_env(env)
        cap.check_layers(n)
        problems = capture_checks.capture_refusals(cap, {"tp_size": 1, "chunked_prefill_size": self.chunk})
        if problems:  # what hook.attach refuses in a real server
            raise SystemExit("stand-in: " + "; ".join(problems))
        if not cap.slot_tokens:
            cap = dataclasses.replace(cap, slot_tokens=self.chunk)
        meta = {"sglang_release": f"{release} (stand-in)", "model_type": str(cfg.model_type),
                "model": self.model_dir, "architecture": ",".join(cfg.architectures or []), "tp_size": "1",
                "tp_rank": "0"}
        self.hook = capture_hook.CaptureHook(cap, hidden_size=int(cfg.hidden_size), metadata=meta) \
            if capture_dir else None  # no capture dir: a pristine-behaving server (the patched forward, no hook)
        if self.hook:  # the line hook.attach logs on the writing rank (tests/gpu/tp_compare.py counts them)
            logging.getLogger("hs_patch").info("hs_patch: capturing layers %s + final=%s into %s (rank 0 of 1)",
                                               list(cap.layers), cap.final, cap.directory)
        self.capture = cap
        self.refs: dict[str, Any] = {}
        self.rows: dict[str, list[torch.Tensor]] = {}   # request -> the pass outputs (post-norm) so far
        self.sim = Sim(release, source, self.model, self.refs, hook=self.hook, aux_module=aux)
        self.incoming: "queue.Queue[Request]" = queue.Queue()
        self.decode_q: "queue.Queue[Request]" = queue.Queue()
        self.active = 0
        self._lock = threading.Lock()
        self.model_lock = threading.Lock()  # reference() hooks the model's layers: one forward at a time
        self.passes = 0
        for target, name in ((self._schedule, "standin-prefill"), (self._decode, "standin-decode")):
            threading.Thread(target=target, name=name, daemon=True).start()

    # ------------------------------------------------------------------ API
    def submit(self, req: Request, timeout: float = 600.0) -> dict[str, Any]:
        with self._lock:
            self.active += 1
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
                "passes": self.passes}

    def close(self) -> None:
        if self.hook is not None:
            self.hook.close()
        self._site.cleanup()

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
        from sglang_sim import reference

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
        from sglang_sim import ForwardBatch, ForwardMode, Part

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
                                    "e2e_latency": round(time.time() - req.start, 4), **req.logprobs}}
        req.done.set()

    # ------------------------------------------------------------------ logprobs (SGLang's meta_info shape)
    def _top(self, logprobs: torch.Tensor, k: int) -> Optional[list]:
        if k <= 0:
            return None
        v, i = logprobs.topk(k)
        return [[float(a), int(b), None] for a, b in zip(v, i)]

    def _input_logprobs(self, req: Request, states: torch.Tensor, first: int) -> None:
        """input_token_logprobs / input_top_logprobs from logprob_start_len on (first entry None, entry j
        from the logits at position start + j - 1), output_* for the first generated token."""
        n = len(req.ids)
        start = n - 1 if req.logprob_start_len < 0 else min(req.logprob_start_len, n - 1)
        lp = torch.log_softmax(self.model.lm_head(states[start:]).float(), dim=-1)
        k = req.top_logprobs_num
        tok = [[None, req.ids[start], None]] + [[float(lp[j - 1, req.ids[start + j]]), req.ids[start + j], None]
                                               for j in range(1, n - start)]
        top = [None] + [self._top(lp[j - 1], k) for j in range(1, n - start)]
        req.logprobs = {"input_token_logprobs": tok, "output_token_logprobs": [], "output_token_logprobs_length": 0}
        if k > 0:
            req.logprobs.update(input_top_logprobs=top, output_top_logprobs=[])
        self._output_logprob(req, lp[-1], first, already_log=True)

    def _output_logprob(self, req: Request, logits: torch.Tensor, token: int, already_log: bool = False) -> None:
        lp = logits if already_log else torch.log_softmax(logits.float(), dim=-1)
        req.logprobs["output_token_logprobs"].append([float(lp[token]), token, None])
        req.logprobs["output_token_logprobs_length"] += 1
        if req.top_logprobs_num > 0:
            req.logprobs["output_top_logprobs"].append(self._top(lp, req.top_logprobs_num))

    def _fail(self, req: Request, e: BaseException) -> None:
        req.error = f"{type(e).__name__}: {e}"
        req.done.set()

    # ------------------------------------------------------------------ request parsing (as SGLang checks it)
    def parse(self, body: Any) -> Request:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        if body.get("stream"):
            raise BadRequest("streaming is not supported by the stand-in server")
        ids = body.get("input_ids")
        if ids is None and isinstance(body.get("text"), str):
            ids = self.tokenizer(body["text"], add_special_tokens=False)["input_ids"]
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
            raise BadRequest("give input_ids as a non-empty list of token ids (batched requests are not supported)")
        if any(t < 0 or t >= self.vocab for t in ids):
            raise BadRequest(f"token id out of range [0, {self.vocab})")
        params = body.get("sampling_params") or {}
        max_new = int(params.get("max_new_tokens", 128))
        if len(ids) >= self.context_length:
            raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's context length "
                             f"({self.context_length} tokens).")
        if len(ids) + max_new >= self.context_length:
            raise BadRequest(f"Requested token count exceeds the model's maximum context length of "
                             f"{self.context_length} tokens. You requested a total of {len(ids) + max_new} tokens: "
                             f"{len(ids)} tokens from the input messages and {max_new} tokens for the completion.")
        if len(ids) >= self.max_req_input_len:
            raise BadRequest(f"Input length ({len(ids)} tokens) exceeds the maximum allowed length "
                             f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")
        rid = body.get("rid") or uuid.uuid4().hex
        try:
            start = int(body.get("logprob_start_len", -1) if body.get("logprob_start_len") is not None else -1)
            k = int(body.get("top_logprobs_num", 0) or 0)
        except (TypeError, ValueError):
            raise BadRequest("logprob_start_len and top_logprobs_num must be integers") from None
        if start >= len(ids):
            raise BadRequest(f"logprob_start_len ({start}) is superior or equal to the input length ({len(ids)})")
        return Request(str(rid), list(ids), max_new, bool(body.get("return_logprob")), start, k)


def read_config_api_key(path: Optional[str]) -> Optional[str]:
    """The ``api-key`` of SGLang's ``--config`` YAML file (the services role writes it as JSON, a YAML subset)."""
    if not path:
        return None
    with open(path, encoding="utf-8") as f:
        return (json.load(f) or {}).get("api-key")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    engine: Engine
    api_key: Optional[str] = None

    def _authorized(self) -> bool:
        """As SGLang's --api-key (sglang.srt.utils.auth): every path but /health* and /metrics needs
        ``Authorization: Bearer KEY``; a refusal is 401."""
        if not self.api_key or self.path.startswith(("/health", "/metrics")):
            return True
        if hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {self.api_key}"):
            return True
        self._send(401, {"error": "Unauthorized"})
        return False

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    def _send(self, code: int, body: Any = None) -> None:
        data = b"" if body is None else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        self.path = self.path.split("?", 1)[0]  # query parameters (a token) are ignored, as by SGLang's router
        if self.path in ("/get_server_info", "/server_info"):
            self._send(200, self.engine.info())
        elif self.path in ("/health", "/health_generate"):
            generate = self.path == "/health_generate" or os.environ.get(
                "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "1").lower() not in ("0", "false")
            if not generate or not self.engine.idle():
                self._send(200)
                return
            try:
                self.engine.submit(Request(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], 1), timeout=20)
                self._send(200)
            except RuntimeError:
                self._send(503)
        else:
            self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        self.path = self.path.split("?", 1)[0]
        if self.path != "/generate":
            self._send(404, {"detail": "Not Found"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
            req = self.engine.parse(body)
        except (ValueError, BadRequest) as e:
            self._send(400, {"error": {"message": str(e)}})
            return
        try:
            self._send(200, self.engine.submit(req))
        except RuntimeError as e:
            self._send(500, {"error": {"message": str(e)}})


class StandinServer:
    """The stand-in, started in this process (tests) or by :func:`main`."""

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, api_key: Optional[str] = None):
        self.engine = engine
        handler = type("BoundHandler", (Handler,), {"engine": engine, "api_key": api_key})
        handler_server = type("StandinHTTPServer", (ThreadingHTTPServer,), {"request_queue_size": 128})
        self.httpd = handler_server((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "StandinServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="standin-http", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.engine.close()


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--model-path", dest="model", required=True,
                    help="model directory (tests/tiny_model.py writes one)")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--capture-dir", default=os.environ.get("HS_CAPTURE_DIR"),
                    help="where the hook writes samples (default: $HS_CAPTURE_DIR)")
    ap.add_argument("--installed-sglang", action="store_true", help="run the deepseek_v2.py of the SGLang "
                    "installed for this Python (it must be patched: e.g. by ansible-playbook site.yml); "
                    "SGLang's own server flags on the command line are then accepted and ignored")
    ap.add_argument("--release", default=RELEASE_DEFAULT, choices=list(RELEASES),
                    help="SGLang release whose patched forward runs (default: %(default)s)")
    ap.add_argument("--sglang-wheel", help="that release's wheel (default: downloaded once into "
                    "$HS_PATCH_TEST_CACHE/wheels, ~/.cache/hs-patch-tests/wheels)")
    ap.add_argument("--chunked-prefill-size", type=int, default=8192, help="token budget of one prefill pass "
                    "(default: %(default)s)")
    ap.add_argument("--batch-window-ms", type=float, default=5.0, help="requests arriving within this window are "
                    "prefilled together (default: %(default)s)")
    ap.add_argument("--context-length", type=int, help="default: the model's max_position_embeddings")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--accept-sglang-flags", action="store_true", help="accept and ignore SGLang's own server "
                    "flags (the GPU proof scripts' command line), and serve without capture when HS_CAPTURE is "
                    "not 1 (a pristine stand-in)")
    ap.add_argument("--api-key", help="require this key (Authorization: Bearer), as SGLang's --api-key")
    ap.add_argument("--config", help="SGLang's --config file: its api-key is used like --api-key")
    a, ignored = ap.parse_known_args(argv)
    if ignored and not (a.installed_sglang or a.accept_sglang_flags):
        ap.error(f"unrecognized arguments: {' '.join(ignored)}")
    if a.accept_sglang_flags and os.environ.get("HS_CAPTURE") != "1":
        a.capture_dir = None
    elif not a.capture_dir:
        ap.error("--capture-dir or HS_CAPTURE_DIR is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standin %(levelname)s %(message)s")
    torch.set_num_threads(a.threads)
    engine = Engine(a.model, a.capture_dir, release=a.release, wheel=a.sglang_wheel,
                    chunked_prefill_size=a.chunked_prefill_size, batch_window_ms=a.batch_window_ms,
                    context_length=a.context_length, installed=a.installed_sglang)
    server = StandinServer(engine, a.host, a.port, api_key=a.api_key or read_config_api_key(a.config))
    if ignored:
        log.info("stand-in: SGLang server flags accepted and ignored: %s", " ".join(ignored))
    log.warning("STAND-IN server, NOT SGLang: patched forward of SGLang %s on a tiny transformers model, "
                "capturing layers %s into %s; listening on %s", a.release, list(engine.capture.layers),
                engine.capture.directory, server.url)

    def on_term(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.httpd.server_close()
        engine.close()  # drain the capture writer, as the real server does at exit


if __name__ == "__main__":
    main()
