"""SGLang 0.5.16 serving each drafter with EAGLE-3 beside its target, and the measurement.

Every server is ``python -m sglang.launch_server`` (the Server of tests/gpu/common.py) on the one GPU. A
measurement is one job: wait for its drafter (training ended, exported), start its server, run the
product command ``hs-extract accept`` on every eval prompt at once, stop the server. Jobs run side by
side (``--max-servers`` at a time), so an arm whose training ended early is measured while others still
train; each job's report is kept as it ends, so a call cut short loses none, and the next call runs only
the jobs left.

Servers: a KV pool bounded by ``--max-total-tokens`` and ``--mem-fraction-static 0.9``: SGLang 0.5.16
budgets the pool from the memory free when it profiles, less (1 - fraction) x the memory free before
it loaded its weights (kv_cache_configurator._profile_available_bytes), so 0.9 lets many servers and the
trainings share the GPU, each pool capped by the token bound rather than by the fraction.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional


def serve_flags(kv_tokens: int, max_running: int, context: int = 4096) -> list[str]:
    return ["--context-length", str(context), "--max-total-tokens", str(kv_tokens),
            "--max-running-requests", str(max_running)]


def spec_flags(draft: Path, steps: int, topk: int, tokens: int) -> list[str]:
    return ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(tokens)]


@dataclass
class Job:
    key: str                       # arm-sN@steps,topk,tokens[@T1]
    drafter: str                   # the training's name (arm-sN)
    setting: str                   # "3,1,4"
    temperature: float = 0.0
    plain: bool = False            # with --plain (the greedy check against a plain server)
    meta: dict = field(default_factory=dict)


def measure(server_url: str, data: Path, model: Path, out: Path, plain_url: Optional[str], max_new: int,
            concurrency: int, repo: Path, env: dict[str, str], temperature: float = 0.0,
            extra: Optional[list[str]] = None) -> dict:
    """``hs-extract accept`` (the product command) against one EAGLE-3 server."""
    cmd = [sys.executable, "-m", "hs_patch.host.extract_cli", "accept", "--server", server_url, "--data", str(data),
           "--model", str(model), "--max-new-tokens", str(max_new), "--concurrency", str(concurrency),
           "--temperature", str(temperature), "--out", str(out), "--json", *(extra or [])]
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


class Runner:
    """Runs jobs side by side. ``ready(drafter)`` blocks until the drafter is exported (its directory) or
    raises; ``run_one(job, server_url)`` measures; ``left()`` is the call's time left."""

    def __init__(self, server_cls: Any, model: Path, flags: list[str], first_port: int, max_servers: int,
                 need_s: float, left: Callable[[], float], log: Callable[[str], None]):
        self.server_cls, self.model, self.flags = server_cls, model, flags
        self.port, self.lock = first_port, threading.Lock()
        self.slots = threading.Semaphore(max_servers)
        self.need_s, self.left, self.log = need_s, left, log

    def _port(self) -> int:
        with self.lock:
            self.port += 1
            return self.port

    def run(self, jobs: list[Job], ready: Callable[[str], Path], run_one: Callable[[Job, str], dict],
            record: Callable[[Job, dict], None]) -> dict[str, str]:
        """Every job; returns key -> 'done' / why not."""
        status: dict[str, str] = {}

        def one(job: Job) -> None:
            try:
                draft = ready(job.drafter)
            except Exception as e:  # noqa: BLE001
                status[job.key] = f"drafter not ready: {e}"
                return
            with self.slots:
                if self.left() < self.need_s:
                    status[job.key] = f"not started: {self.left():.0f}s left, a server and its measurement need " \
                                      f"about {self.need_s:.0f}s"
                    return
                steps, topk, toks = map(int, job.setting.split(","))
                name = job.key.replace("@", "_").replace(",", "-")
                server = self.server_cls(name, str(self.model), self._port(), 4096, None,
                                         [*self.flags, *spec_flags(draft, steps, topk, toks)], mem_fraction=0.9)
                try:
                    server.wait_ready()
                    res = run_one(job, server.url)
                    res["server_start_s"] = server.start_s
                    record(job, res)
                    status[job.key] = "done" if res.get("rc") in (0, 3) else f"accept exit {res.get('rc')}"
                    self.log(f"{job.key}: " + res.get("summary", f"accept length {res.get('accept_length')} gauge "
                                                             f"{res.get('accept_length_gauge')} at cap {res.get('at_cap')}"))
                except Exception as e:  # noqa: BLE001
                    status[job.key] = f"failed: {e}"[:3000]
                    self.log(f"{job.key} FAILED: {str(e)[:500]}")
                finally:
                    server.stop()

        with ThreadPoolExecutor(max(1, len(jobs))) as pool:
            list(pool.map(one, jobs))
        return status
