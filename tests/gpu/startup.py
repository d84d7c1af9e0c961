"""Start-up phase of the GPU proof (issue #36): ``hs-extract drive`` from its command to its first request,
on the GPU host's own software (torch with CUDA, SGLang's pinned transformers) against a real capturing server.

One capturing SGLang server (the small random model with weights, so the fidelity check runs as in
production), then ``bench/driver_startup.py --server``: the driver as its own process, this checkout and
``--startup-code`` (the code before: ``git archive main hs_patch | tar -x -C .base`` here, carried) alternating,
on a 1-line and a 64-line chat dataset, with the model's own tokenizer (AutoTokenizer's way) and with the
same tokenizer as remote code (Kimi's way, ``--trust-remote-code``). Rows: the command to the first request,
active (first sent to last done), the whole process, and where this checkout's start-up went.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from common import REC, ROOT, Server, start_phase

from hs_patch.host.driver.runstate import read_jsonl


def startup(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    res: dict = {"model": model_dir, "code_before": a.startup_code, "reps": a.startup_reps}
    dump = start_phase(a, "startup", tag, res)
    server = Server(f"startup-{tag}", model_dir, a.port, a.chunk, {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump)},
                    [], mem_fraction=a.mem_fraction, tp_size=a.tp_size)
    out_json = Path(a.work) / f"startup-{tag}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    # the bench prints each run as a JSON line as it ends: into a file under --out, so a call cut by its time limit
    # still brings back (and records) the runs done before the cut
    lines, errors = Path(a.out) / f"startup-{tag}.stdout", Path(a.out) / f"startup-{tag}.stderr"
    lines.parent.mkdir(parents=True, exist_ok=True)
    try:
        server.wait_ready()
        cmd = [sys.executable, str(ROOT / "bench" / "driver_startup.py"), "--code", str(Path(a.startup_code).resolve()),
               "--server", server.url, "--capture-dir", str(dump), "--model", model_dir, "--reps",
               str(a.startup_reps), "--prompts", a.startup_prompts, "--models", a.startup_models,
               "--tokenizer-cache", a.startup_tokenizer_cache, "--dir", a.dump_root, "--json", str(out_json)]
        with open(lines, "w") as out, open(errors, "w") as err:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=err, text=True)
            try:
                res["exit_code"] = proc.wait()
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        res["table"] = lines.read_text()[-3000:]
        if res["exit_code"]:
            raise RuntimeError(f"bench/driver_startup.py exited {res['exit_code']}:\n{errors.read_text()[-3000:]}")
        got = json.loads(out_json.read_text())
        res["runs"], res["code"] = got["runs"], got["code"]
    finally:
        server.stop()
        if "runs" not in res and lines.exists():  # cut: the runs it printed so far
            res["runs"] = [r for r in read_jsonl(lines) if "rep" in r]
            res["cut"] = True
        REC.save()
    return res


def summarize_startup(k: str, f: dict) -> None:
    before = f.get("code", {}).get("before")
    print(f"\n{k}: hs-extract drive's start-up against {f['model']} (the code before: {before})")
    print(f.get("table", ""))
