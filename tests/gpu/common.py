"""Shared pieces of the GPU proof: the results record, ``hs-patch`` calls, and SGLang servers.

Used by ``tests/gpu/proof.py`` (fidelity, main) and ``tests/gpu/throughput.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from hs_patch.samples import store

ROOT = Path(__file__).resolve().parents[2]


class Record:
    """Everything the run measured, written as JSON under --out after every step."""

    def __init__(self) -> None:
        self.t0 = time.time()
        self.data: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        self.out = Path(".")
        self.logs = Path(".")

    def log(self, *a: object) -> None:
        print(f"[proof +{time.time() - self.t0:6.1f}s]", *a, flush=True)

    def save(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.data, indent=1, default=str))


REC = Record()


def hs_patch_cli(*args: str) -> dict:
    """Run ``hs-patch ARGS --json`` from this checkout; its JSON answer plus ``exit_code``."""
    out = subprocess.run([sys.executable, "-m", "hs_patch.host.patch_cli", *args, "--json"], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["exit_code"] = out.returncode
    return res


def start_phase(a: Any, name: str, tag: str, res: dict) -> Path:
    """A phase's start: its results recorded under ``name_tag``, the install patched (a throughput
    run may have left it pristine), and its capture directory, empty."""
    REC.data[f"{name}_{tag}"] = res
    st = hs_patch_cli("apply", "--site", a.site)
    assert st["exit_code"] == 0 and st["state"] == "patched", st
    dump = Path(a.dump_root) / f"dump-{name}-{tag}"
    shutil.rmtree(dump, ignore_errors=True)
    return dump


def pristine_copy(site: str, dest: Path) -> Path:
    """A copy of ``SITE/sglang`` with the patch reverted. A server that puts DEST first on its
    PYTHONPATH runs pristine SGLang while servers beside it run the patched install."""
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(Path(site) / "sglang", dest / "sglang", symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    st = hs_patch_cli("revert", "--site", str(dest))
    assert st["exit_code"] == 0 and st["state"] == "pristine", st
    return dest


class Server:
    """``python -m sglang.launch_server`` in its own process group, like the service unit.

    ``first_on_path``: a directory put before everything on PYTHONPATH (a pristine copy).
    Construct, then ``wait_ready()``; ``wait_memory()`` returns once the KV pool is
    allocated, so the next server on the same GPU can size its own from what is left.
    """

    # what starts a server; tests/gpu/test_gpu_scripts.py puts the CPU stand-in here to rehearse the scripts
    LAUNCHER = [sys.executable, "-m", "sglang.launch_server"]

    def __init__(self, name: str, model: str, port: int, chunk: int, capture: dict | None, extra: list[str],
                 first_on_path: str | None = None, mem_fraction: float = 0.5, tp_size: int = 1):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise RuntimeError(f"port {port} already answers before server {name} starts: a server left by an "
                                   "earlier run (a call cut by its time limit) would be measured instead of this "
                                   "one; stop it, or give another --port")
        env = {k: v for k, v in os.environ.items() if not k.startswith("HS_CAPTURE")}
        env["PYTHONPATH"] = ":".join(p for p in (first_on_path, str(ROOT), env.get("PYTHONPATH")) if p)
        env.update(capture or {})
        self.env = env
        self.name, self.url, self.t0 = name, f"http://127.0.0.1:{port}", time.time()
        self.log_path = REC.logs / f"server-{name}.log"
        # which sglang this server imports (find_spec of a top-level package imports nothing)
        probe = "import importlib.util as u; print(u.find_spec('sglang').submodule_search_locations[0])"
        self.sglang_dir = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                                         text=True).stdout.strip()
        cmd = [*self.LAUNCHER, "--model-path", model, "--host", "127.0.0.1",
               "--port", str(port), "--tp-size", str(tp_size), "--attention-backend", "triton",
               "--sampling-backend", "pytorch", "--disable-radix-cache", "--disable-prefill-cuda-graph",
               "--disable-decode-cuda-graph", "--mem-fraction-static", str(mem_fraction), "--random-seed", "0",
               "--chunked-prefill-size", str(chunk), "--log-level", "info", *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.start_s: float | None = None

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"server {self.name} exited with {self.proc.returncode}:\n{self.tail()}")
        if time.time() - self.t0 > 400:
            raise RuntimeError(f"server {self.name} not healthy after 400 s:\n{self.tail()}")

    def healthy(self) -> bool:
        try:
            return requests.get(self.url + "/health_generate", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def wait_memory(self) -> None:
        while "Memory pool end" not in self.log_path.read_text(errors="replace") and not self.healthy():
            self._check_alive()
            time.sleep(0.5)

    def wait_ready(self) -> Server:
        while not self.healthy():
            self._check_alive()
            time.sleep(1)
        self.start_s = round(time.time() - self.t0, 1)
        REC.log(f"server {self.name} up in {self.start_s}s (sglang from {self.sglang_dir})")
        return self

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def generate(self, ids: list[int], rid: str, max_new: int = 1, hidden: bool = False) -> dict:
        body = {"input_ids": ids, "rid": rid, "return_hidden_states": hidden,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}
        r = requests.post(self.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        """The server's whole process group, its leader alive or not (SGLang's scheduler and detokenizer
        outlive a launcher that died), SIGKILL for what is left after 30 s."""
        for sig, seconds in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and _group_alive(self.proc):
                time.sleep(0.1)
            if not _group_alive(self.proc):
                break
        self.proc.poll()


def _group_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of ``proc``'s group (its own session) is still there; reaps the leader."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_for_samples(directory: Path, keys: set[str], timeout: float = 120) -> float:
    """Seconds until every key is in DIRECTORY's manifest (the writer is asynchronous)."""
    t = time.time()
    while True:
        have = set(store.read_manifest(directory)) if directory.exists() else set()
        if keys <= have:
            return time.time() - t
        if time.time() - t > timeout:
            raise RuntimeError(f"{len(keys - have)} of {len(keys)} samples missing in {directory} after {timeout}s")
        time.sleep(0.05)
