#!/usr/bin/python3
"""Stand-in for `python -m sglang.launch_server` on test hosts (no GPU).

Takes the same command line, binds --host:--port, and answers like SGLang:
/health at once, /health_generate only after a short "model load" (503
before), so the role's retries are exercised. Like SGLang's --api-key (read
from --config FILE, which the role writes as JSON, a YAML subset), every path
but /health* answers 401 without "Authorization: Bearer KEY". /debug reports its argv,
capture environment, user and memlock limit, so tests can check the unit's
wiring, and the SGLang release and venv of the interpreter that runs it (the upgrade
scenario runs it with the venv's own Python, so it serves from whichever release the
venv link pointed at when it started). Every start is appended to starts.log in the
working directory (the restart test counts them).

Like the real server's libraries, it writes into every cache the unit points it at before it
serves (transformers' remote-code modules, tvm-ffi's JIT builds, FlashInfer, Triton, SGLang's
own...: each directory gpu_ready.py's caches check names, from the copy the services role
installed): a file ``.hs-standin-<variable>`` in each, kept for the tests to find. One it
cannot write stops it at once, naming the variable, the directory and the error, as the real
server would die with "Read-only file system". /server_info reports a KV cache pool
(``max_total_num_tokens``) of ``HS_STANDIN_KV_TOKENS`` tokens (default 1048576).

With HS_CAPTURE=1 and hs_patch importable (the venv's Python), it reads the capture
settings with the hook's own parser, as the patched SGLang does when it builds the
model, and exits with the parser's message on a bad value: the server fails to start,
as the real one does."""

import argparse
import hmac
import importlib.metadata
import json
import os
import resource
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOAD_SECONDS = 2.0
STARTED = time.monotonic()


def sglang_release():
    """The sglang distribution this interpreter imports (None: not installed, the system python3)."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_capture_settings():
    """What the patched deepseek_v2.py does at model build with HS_CAPTURE=1 (hs_patch.server.hook
    reads hs_patch.server.config.from_env): a bad HS_CAPTURE_* value stops the server."""
    if os.environ.get("HS_CAPTURE", "") in ("", "0"):
        return
    try:
        from hs_patch.server.config import ConfigError, from_env
    except ImportError:  # not a venv with hs_patch installed: nothing to read the settings with
        return
    try:
        from_env()
    except ConfigError as e:
        sys.exit(f"hs_patch capture: {e}")


def write_caches(check_dir):
    """Write a file into every cache directory the environment points at (gpu_ready.cache_dirs, the
    copy in the services role's check directory); exit naming the first one that refuses."""
    sys.path.insert(0, check_dir)
    import gpu_ready  # noqa: PLC0415 - the copy the services role installed on this host
    written = {}
    for what, directory in sorted(gpu_ready.cache_dirs(os.environ).items()):
        try:
            written[what] = gpu_ready.write_probe(directory, keep_as=f".hs-standin-{what.replace(' ', '-')}")
        except OSError as e:
            sys.exit(f"stand-in server: cannot write the {what} cache {directory}: {e}")
    return written


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--config")
    args, rest = p.parse_known_args()
    check_capture_settings()
    caches = write_caches(os.environ.get("HS_STANDIN_CHECK_DIR", "/usr/local/lib/hs-patch"))
    kv_tokens = int(os.environ.get("HS_STANDIN_KV_TOKENS", 1 << 20))
    # read now: the venv link may point elsewhere by the time /debug is asked
    release, venv = sglang_release(), os.path.realpath(sys.prefix)
    api_key = None
    if args.config:
        with open(args.config, encoding="utf-8") as f:
            api_key = json.load(f).get("api-key")
    # SGLang's engine logs every server argument at start, the API key among them (logger.info(f"{server_args=}")
    # to 0.5.18; a dict from 0.5.19): what the unit's LogFilterPatterns= keeps out of the journal
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] server_args=ServerArgs(model_path={args.model_path!r}, "
          f"tp_size={args.tp_size}, port={args.port}, api_key={api_key!r})", file=sys.stderr, flush=True)
    with open("starts.log", "a") as f:
        f.write(f"{os.getpid()} {time.time():.3f}\n")

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server API)
            if api_key and not self.path.startswith("/health") and not hmac.compare_digest(
                    self.headers.get("Authorization", ""), f"Bearer {api_key}"):
                self._send(401, {"error": "Unauthorized"})
            elif self.path == "/health":
                self._send(200, {})
            elif self.path == "/health_generate":
                if time.monotonic() - STARTED < LOAD_SECONDS:
                    self._send(503, {"error": "loading"})
                else:
                    self._send(200, {})
            elif self.path in ("/server_info", "/get_server_info"):
                # SGLang's fields the driver and fab read (same names in 0.5.9, 0.5.16, 0.5.23)
                self._send(200, {"version": release or "stand-in", "max_total_num_tokens": kv_tokens,
                                 "max_req_input_len": kv_tokens - 6, "context_length": None,
                                 "tp_size": args.tp_size, "disable_radix_cache": "--disable-radix-cache" in rest})
            elif self.path == "/debug":
                soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
                self._send(200, {
                    "argv": vars(args) | {"rest": rest},
                    "env": {k: v for k, v in os.environ.items() if k.startswith("HS_")},
                    "uid": os.getuid(), "cwd": os.getcwd(), "api_key": bool(api_key),
                    "tmp": sorted(os.listdir("/tmp")),
                    "memlock": "unlimited" if soft == resource.RLIM_INFINITY else soft,
                    "pid": os.getpid(),
                    "sglang": release,
                    "venv": venv,
                    "caches": caches,
                })
            else:
                self._send(404, {"error": "not found"})

        def log_message(self, *a):
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
