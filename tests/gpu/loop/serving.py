"""SGLang 0.5.16 serving each drafter with EAGLE-3 beside its target, and the measurement.

Every server is ``python -m sglang.launch_server`` (the Server of tests/gpu/common.py) on the one GPU,
started together with a bounded KV pool (``--max-total-tokens``) so that many fit; the
measurement is the product command, ``hs-extract accept``, against each EAGLE-3 server with
the plain server as the greedy reference.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

SERVE_FLAGS = ["--context-length", "4096", "--max-total-tokens", "65536", "--max-running-requests", "64"]


def spec_flags(draft: Path, steps: int, topk: int, tokens: int) -> list[str]:
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(tokens)]


def start_all(server_cls: Any, model: Path, specs: dict[str, list[str]], first_port: int,
              log: Callable[[str], None], deadline: float) -> dict[str, Any]:
    """Start one server per entry (name -> extra flags) at once; wait for each; a server that fails
    is reported, the others go on."""
    servers, failed = {}, {}
    for k, (name, extra) in enumerate(specs.items()):
        servers[name] = server_cls(name, str(model), first_port + k, 4096, None, [*SERVE_FLAGS, *extra],
                                   mem_fraction=0.5)
    for name, s in list(servers.items()):
        while True:
            if s.healthy():
                s.start_s = round(time.time() - s.t0, 1)
                log(f"server {name} up in {s.start_s}s")
                break
            if s.proc.poll() is not None or time.time() > deadline:
                failed[name] = s.tail(30)
                log(f"server {name} FAILED:\n{failed[name]}")
                s.stop()
                del servers[name]
                break
            time.sleep(1)
    return {"servers": servers, "failed": failed}


def measure(server_url: str, data: Path, model: Path, out: Path, plain_url: str | None, max_new: int,
            concurrency: int, repo: Path, env: dict[str, str]) -> dict:
    """``hs-extract accept`` (the product command) against one EAGLE-3 server."""
    cmd = [sys.executable, "-m", "hs_patch.host.extract_cli", "accept", "--server", server_url, "--data", str(data),
           "--model", str(model), "--max-new-tokens", str(max_new), "--concurrency", str(concurrency),
           "--out", str(out), "--json"]
    if plain_url:
        cmd += ["--plain", plain_url]
    t = time.time()
    p = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    res: dict[str, Any] = {"rc": p.returncode, "seconds": round(time.time() - t, 1)}
    try:
        res.update(json.loads(p.stdout.strip().splitlines()[-1]))
    except (IndexError, json.JSONDecodeError):
        res["stdout_tail"] = p.stdout[-2000:]
    if p.returncode:
        res["stderr_tail"] = p.stderr[-3000:]
    return res
