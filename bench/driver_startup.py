#!/usr/bin/env python3
"""``hs-extract drive``'s start-up: from its command to its first request, and the whole run, side by side (issue #36).

One stand-in server (tests/lab/standin_server.py, its ``/health`` answering after ``--health-sleep`` s as
SGLang's does) serves every run; ``hs-extract drive`` runs as its own process, as on the GPU host, from
this checkout and from ``--code`` (another checkout: the code before, e.g. a ``git worktree`` of main),
alternating, on the same datasets, ``--reps`` times. Per run, from the command's launch (``time.time()``
just before the process starts) and the run's ledger:

- ``first_request_s``: to the first ``sent`` (the first dataset sample's request);
- ``active_s``: first ``sent`` to last ``done`` (the rows of bench/RESULTS.md section 11 call it active);
- ``process_s``: the whole process, its exit included;
- this checkout's ``run_start`` also says where its start-up went (``startup``: tokenizer, dataset, the wait
  for the server's answers, the capture check, the fidelity check's header check).

``--tokenizer-cache warm`` (the default) starts every measured run with the tokenizer's class remembered
(driver/tokenizer.py; one unrecorded run per model and code first): a resume, a retry, a benchmark, every
start after a directory's first; ``cold`` empties that cache before every run: a directory's first start.
The bench keeps the cache in its own temporary directory.

Models: ``fast`` (the lab's tiny model, a ``tokenizer.json``: AutoTokenizer's way) and ``remote`` (the same
model with its tokenizer as its own code, like Kimi-K2.5's: ``--trust-remote-code``). ``--pythonpath DIR``
puts DIR first for the driver (not the server): e.g. transformers 5.12.1 (SGLang 0.5.16's pin) and
scikit-learn installed there with ``pip install --target``, the GPU host's import chain on this machine.
``--server URL --capture-dir DIR --model DIR``: a capturing server already running (the real SGLang on the
GPU host, whose ``/health`` is the real one; ``--fidelity off`` with dummy weights) instead of the stand-in.

    git worktree add --detach /tmp/hs-base main
    python3 bench/driver_startup.py --code /tmp/hs-base --reps 3
    python3 bench/driver_startup.py --code /tmp/hs-base --reps 3 --pythonpath /tmp/tf512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from lab.drive_runs import standin_process  # noqa: E402
from lab.remote_tokenizer import make_remote_tokenizer_dir  # noqa: E402
from lab.runcheck import write_chats  # noqa: E402
from lab.tiny_model import make_tiny_model_dir  # noqa: E402


def drive(code: Path, pythonpath: str, base: Path, url: str, capture: Path, model: Path, data: Path, remote: bool,
          fidelity: bool, tag: str, cold: bool = False) -> dict:
    run = base / "runs" / tag
    cache = base / "tokenizer-cache"
    if cold:
        shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    cmd = [sys.executable, "-m", "hs_patch.host.extract_cli", "drive", "--run", "bench", "--data", str(data),
           "--model", str(model), "--server", url, "--capture-dir", str(capture), "--state-dir", str(run / "state"),
           "--samples-dir", str(base / "samples" / tag), "--max-tokens", "2048", "--status-interval", "0.5"]
    cmd += ["--trust-remote-code"] if remote else []
    cmd += [] if fidelity else ["--no-fidelity-check"]
    env = dict(os.environ, PYTHONPATH=":".join(p for p in (pythonpath, str(code), os.environ.get("PYTHONPATH")) if p),
               HS_PATCH_CACHE_DIR=str(cache))
    t0 = time.time()
    out = subprocess.run(cmd, cwd=run, env=env, capture_output=True, text=True)
    process = time.time() - t0
    if out.returncode:
        raise SystemExit(f"{tag}: hs-extract drive exited {out.returncode}:\n{out.stderr[-3000:]}")
    ledger = [json.loads(x) for x in (run / "state" / "ledger.jsonl").read_text().splitlines() if x.strip()]
    sent = [e["t"] for e in ledger if e["event"] == "sent"]
    done = [e["t"] for e in ledger if e["event"] == "done"]
    start = next(e for e in ledger if e["event"] == "run_start")
    shutil.rmtree(base / "samples" / tag, ignore_errors=True)
    return {"first_request_s": round(min(sent) - t0, 3), "run_start_s": round(start["t"] - t0, 3),
            "active_s": round(max(done) - min(sent), 3), "process_s": round(process, 3), "samples": len(done),
            "startup": start.get("startup")}


def which_hs_patch(code: Path, pythonpath: str) -> str:
    probe = "import hs_patch as p, transformers as t; print(p.__file__, t.__version__)"
    env = dict(os.environ, PYTHONPATH=":".join(p for p in (pythonpath, str(code), os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-c", probe], env=env, cwd="/", capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", required=True, help="the other checkout (the code before), run alternately with this one")
    ap.add_argument("--pythonpath", default="", help="put this first on the driver's PYTHONPATH (another transformers)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", default="1,64", help="dataset sizes, comma-separated (default: %(default)s)")
    ap.add_argument("--models", default="fast,remote", help="fast (tokenizer.json), remote (its own code)")
    ap.add_argument("--fidelity", default="on", help="on, off or on,off (--no-fidelity-check)")
    ap.add_argument("--health-sleep", type=float, default=1.0, help="the stand-in's /health answers no sooner "
                    "(SGLang's: 1 s) (default: %(default)s)")
    ap.add_argument("--server", help="a capturing server that runs already (the real SGLang on the GPU host) instead "
                    "of the stand-in; with --capture-dir (its HS_CAPTURE_DIR) and --model (its model directory)")
    ap.add_argument("--capture-dir", help="with --server: the server's HS_CAPTURE_DIR")
    ap.add_argument("--model", help="with --server: the served model's directory (a tokenizer.json; the remote-code "
                    "copy is made from it)")
    ap.add_argument("--dir", default="/dev/shm", help="where the temporary dirs go (default: %(default)s)")
    ap.add_argument("--tokenizer-cache", choices=("warm", "cold"), default="warm", help="warm: the tokenizer's class "
                    "remembered from an earlier start (resumes, retries); cold: a directory's first start "
                    "(default: %(default)s)")
    ap.add_argument("--json", help="write every run here")
    a = ap.parse_args()
    codes = {"before": Path(a.code).resolve(), "after": ROOT}
    res: dict = {"cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "pythonpath": a.pythonpath,
                 "tokenizer_cache": a.tokenizer_cache,
                 "health_sleep_s": a.health_sleep, "runs": [],
                 "code": {k: which_hs_patch(v, a.pythonpath) for k, v in codes.items()}}
    print(json.dumps(res["code"]), flush=True)
    with tempfile.TemporaryDirectory(prefix="hs-bench-startup-", dir=a.dir, ignore_cleanup_errors=True) as tmp:
        base = Path(tmp)
        model = Path(a.model) if a.server else make_tiny_model_dir(base / "model")
        models = {"fast": model, "remote": make_remote_tokenizer_dir(model, base / "model-remote")}
        datasets = {}
        for n in (int(x) for x in a.prompts.split(",")):
            datasets[n] = base / f"chats-{n}.jsonl"
            write_chats(datasets[n], n, words=60)
        if a.server:
            if not (a.capture_dir and a.model):
                raise SystemExit("--server needs --capture-dir and --model")
            proc, url, capture = None, a.server, Path(a.capture_dir)
        else:
            capture = base / "capture"
            proc, url = standin_process(model, capture, base / "server.log", "--health-sleep-s", str(a.health_sleep))
        try:
            if a.tokenizer_cache == "warm":
                first = min(datasets)
                for name in a.models.split(","):
                    for which in codes:
                        drive(codes[which], a.pythonpath, base, url, capture, models[name], datasets[first],
                              name == "remote", False, f"warmup-{which}-{name}")
            for rep in range(a.reps):
                for name in a.models.split(","):
                    for n, data in datasets.items():
                        for fid in a.fidelity.split(","):
                            order = ["before", "after"] if rep % 2 == 0 else ["after", "before"]
                            for which in order:
                                tag = f"{which}-{name}-{n}-{fid}-r{rep}"
                                row = {"code": which, "model": name, "prompts": n, "fidelity": fid, "rep": rep,
                                       **drive(codes[which], a.pythonpath, base, url, capture, models[name], data,
                                               name == "remote", fid == "on", tag, a.tokenizer_cache == "cold")}
                                res["runs"].append(row)
                                print(json.dumps(row), flush=True)
        finally:
            if proc is not None:
                os.killpg(proc.pid, 15)
                proc.wait(30)
    summarize(res["runs"])
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


def summarize(runs: list[dict]) -> None:
    keys = sorted({(r["model"], r["prompts"], r["fidelity"]) for r in runs})
    print(f"\n{'model':8}{'prompts':>8}{'fidelity':>9}  {'first request s':>22}  {'active s':>16}  {'process s':>16}"
          "   (medians: before -> after)")
    for k in keys:
        cells = []
        for field in ("first_request_s", "active_s", "process_s"):
            m = [statistics.median(r[field] for r in runs if (r["model"], r["prompts"], r["fidelity"]) == k
                                   and r["code"] == which) for which in ("before", "after")]
            cells.append(f"{m[0]:8.2f} -> {m[1]:6.2f}")
        print(f"{k[0]:8}{k[1]:>8}{k[2]:>9}  {cells[0]:>22}  {cells[1]:>16}  {cells[2]:>16}")


if __name__ == "__main__":
    main()
