#!/usr/bin/env python3
"""STAND-IN for a capturing SGLang server, for tests and benchmarks on hosts without a GPU.

This is NOT SGLang. It speaks the subset of SGLang's native HTTP API that the driver
uses, and produces samples through the SAME capture hook and sample store as the real
patched server:

- the model is a tiny random ``transformers`` DeepseekV3 from ``--model`` (see
  tests/lab/tiny_model.py);
- every prefill pass runs the real patched ``DeepseekV2Model.forward`` of the chosen
  SGLang release (taken from the release's wheel and patched by hs_patch) in
  ``lab.sglang_sim.Sim``, with an ``hs_patch.server.hook.CaptureHook`` attached, so the files in
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
``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` makes ``/health`` answer without it; ``--health-sleep-s 1``
makes it answer no sooner than SGLang's handler does (it sleeps a second first: start-up benchmarks).
``GET /get_server_info`` (and ``/server_info``): ``version`` (the release), ``disable_radix_cache:
true``, ``chunked_prefill_size``, ``tp_size: 1``, ``context_length`` (the server argument: null unless
``--context-length`` is given, as in SGLang), ``max_total_num_tokens`` and ``max_req_input_len`` (SGLang's
scheduler fields: ``min(context_len - 1, max_total_num_tokens - 1) - 5``, where ``context_len`` is
``--context-length`` or the model's ``max_position_embeddings``), ``model_path``, ``standin: true``.
Length checks as SGLang makes them: ``len >= context_len`` and ``len + max_new_tokens >= context_len``
are refused (tokenizer manager), and ``len >= max_req_input_len`` (scheduler), with HTTP 400.

Capture settings come from the same HS_CAPTURE_* variables as the real server
(HS_CAPTURE_DIR is ``--capture-dir``; HS_CAPTURE_LAYERS defaults to the product's [2, n//2, n-3], or
1,<mid>,<last> on models too shallow for three distinct planes).
Dependencies: torch, transformers, safetensors and the standard library. The engine (model,
forward, scheduling) is :mod:`lab.standin_engine`, the requests and logprobs
:mod:`lab.standin_requests`; this module is the HTTP side and the command line.

    python3 tests/lab/standin_server.py --model DIR --port P --capture-dir D [--release 0.5.16]
            [--chunked-prefill-size N] [--sglang-wheel PATH]
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]  # run as a script: `lab` and the checkout's hs_patch

import torch  # noqa: E402

from hs_patch.engine.releases import RELEASES  # noqa: E402
from lab.standin_engine import RELEASE_DEFAULT, Engine, log  # noqa: E402
from lab.standin_requests import BadRequest, Request  # noqa: E402
from lab.standin_spec import Speculative  # noqa: E402


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
    health_sleep: float = 0.0  # SGLang's /health sleeps a second before it answers (--health-sleep-s 1: benchmarks)

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
            if not generate:
                self._send(200)
                return
            t0 = time.monotonic()
            try:
                if self.engine.idle():
                    self.engine.submit(Request(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], 1), timeout=20)
                code = 200
            except RuntimeError:
                code = 503
            time.sleep(max(0.0, self.health_sleep - (time.monotonic() - t0)))
            self._send(code)
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

    def __init__(self, engine: Engine, host: str = "127.0.0.1", port: int = 0, api_key: Optional[str] = None,
                 health_sleep: float = 0.0):
        self.engine = engine
        handler = type("BoundHandler", (Handler,), {"engine": engine, "api_key": api_key, "health_sleep": health_sleep})
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


def write_caches() -> None:
    """What the real server's libraries do first (transformers' remote-code modules, tvm-ffi's builds,
    FlashInfer ...): write into each cache directory; one that refuses stops the server, as it would."""
    from hs_patch.host.readiness.gpu_ready import cache_dirs, write_probe

    for what, directory in sorted(cache_dirs(os.environ).items()):
        try:
            write_probe(directory, keep_as=f".hs-standin-{what.replace(' ', '-')}")
        except OSError as e:
            sys.exit(f"stand-in server: cannot write the {what} cache {directory}: {e}")
    log.info("stand-in: wrote into every cache directory: %s", ", ".join(sorted(cache_dirs(os.environ).values())))


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--model-path", dest="model", required=True,
                    help="model directory (tests/lab/tiny_model.py writes one)")
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
    ap.add_argument("--settle-delay-ms", type=float, default=0.0, help="benchmarks: the capture writer settles "
                    "each pass this much later, one pass after another, as a writer slower than the engine would")
    ap.add_argument("--batch-window-ms", type=float, default=5.0, help="requests arriving within this window are "
                    "prefilled together (default: %(default)s)")
    ap.add_argument("--context-length", type=int, help="default: the model's max_position_embeddings")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    ap.add_argument("--accept-sglang-flags", action="store_true", help="accept and ignore SGLang's own server "
                    "flags (the GPU proof scripts' command line), and serve without capture when HS_CAPTURE is "
                    "not 1 (a pristine stand-in)")
    ap.add_argument("--write-caches", action="store_true", help="before serving, write a file into every cache "
                    "directory the environment names (hs_patch's gpu_ready.cache_dirs: XDG_CACHE_HOME, "
                    "TVM_FFI_CACHE_DIR, ... and transformers' module cache), as the real server's libraries do, and "
                    "exit naming the first one that refuses (the services role's sandbox must allow each)")
    ap.add_argument("--health-sleep-s", type=float, default=0.0, help="benchmarks: /health answers this long after it "
                    "was asked at the earliest, as SGLang's (0.5.9-0.5.23: its handler sleeps 1 s before it looks for "
                    "an answer) (default: %(default)s)")
    ap.add_argument("--api-key", help="require this key (Authorization: Bearer), as SGLang's --api-key")
    ap.add_argument("--config", help="SGLang's --config file: its api-key is used like --api-key")
    g = ap.add_argument_group("EAGLE-3 (emulated over greedy decoding: lab/standin_spec.py)")
    g.add_argument("--speculative-algorithm")
    g.add_argument("--speculative-draft-model-path", help="a directory with config.json "
                   "(standin_draft_accuracy, standin_flip_at)")
    g.add_argument("--speculative-num-steps", type=int)
    g.add_argument("--speculative-eagle-topk", type=int)
    g.add_argument("--speculative-num-draft-tokens", type=int)
    a, ignored = ap.parse_known_args(argv)
    if ignored and not (a.installed_sglang or a.accept_sglang_flags):
        ap.error(f"unrecognized arguments: {' '.join(ignored)}")
    if a.accept_sglang_flags and os.environ.get("HS_CAPTURE") != "1":
        a.capture_dir = None
    elif not a.capture_dir:
        ap.error("--capture-dir or HS_CAPTURE_DIR is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s standin %(levelname)s %(message)s")
    if a.write_caches:
        write_caches()
    torch.set_num_threads(a.threads)
    engine = Engine(a.model, a.capture_dir, release=a.release, wheel=a.sglang_wheel,
                    chunked_prefill_size=a.chunked_prefill_size, batch_window_ms=a.batch_window_ms,
                    settle_delay=a.settle_delay_ms / 1000.0,
                    context_length=a.context_length, installed=a.installed_sglang,
                    speculative=Speculative.from_args(a.speculative_algorithm, a.speculative_draft_model_path,
                                                      a.speculative_num_steps, a.speculative_eagle_topk,
                                                      a.speculative_num_draft_tokens))
    server = StandinServer(engine, a.host, a.port, api_key=a.api_key or read_config_api_key(a.config),
                           health_sleep=a.health_sleep_s)
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
