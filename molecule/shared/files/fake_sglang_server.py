#!/usr/bin/python3
"""Stand-in for `python -m sglang.launch_server` on test hosts (no GPU).

Takes the same command line, binds --host:--port, and answers like SGLang:
/health at once, /health_generate only after a short "model load" (503
before), so the role's retries are exercised. /debug reports its argv,
capture environment, user and memlock limit, so tests can check the unit's
wiring. Every start is appended to starts.log in the working directory (the
restart test counts them)."""

import argparse
import json
import os
import resource
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOAD_SECONDS = 2.0
STARTED = time.monotonic()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--model-path", required=True)
    p.add_argument("--tp-size", type=int, default=1)
    args, rest = p.parse_known_args()
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
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/health_generate":
                if time.monotonic() - STARTED < LOAD_SECONDS:
                    self._send(503, {"error": "loading"})
                else:
                    self._send(200, {})
            elif self.path == "/debug":
                soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
                self._send(200, {
                    "argv": vars(args) | {"rest": rest},
                    "env": {k: v for k, v in os.environ.items() if k.startswith("HS_")},
                    "uid": os.getuid(), "cwd": os.getcwd(),
                    "memlock": "unlimited" if soft == resource.RLIM_INFINITY else soft,
                    "pid": os.getpid(),
                })
            else:
                self._send(404, {"error": "not found"})

        def log_message(self, *a):
            pass

    ThreadingHTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
