"""GPU proof phase ``sabotage``: each wrong capture of issue #25 rejected by the production check, on the real server.

One capturing SGLang server (HS_CAPTURE_LAYERS=1,2,3, HS_CAPTURE_FINAL=both, chunked prefill
256) started with ``tests/gpu/sabotage_site`` first on its PYTHONPATH and HS_TEST_SABOTAGE=1:
the hook in the server is the real one, with its collectors wrapped by ``tests/lab/sabotage.py``
so a request whose id names a case is captured wrong in that way (wrong layer, a rank's partial
sum, zeros, pre-norm zeros, another prompt's rows in a chunked prompt's first chunk, the
pre-norm state as the post-norm one, rows misplaced in the staging buffer, a shift). Prompts
go one at a time, a clean "donor" before each sabotaged one (the other prompt whose rows
``other_rows`` uses), each longer than a chunk and with SGLang's top-1 at its last 32
positions (``return_logprob``), as the driver's sampled fraction sends them. Every sample then
goes through the driver's own check (:class:`hs_patch.host.fidelity.check.FidelityChecker`: the
row checks on rows of every chunk against the fingerprints and the model's norms, and the
same-pass top-1). Recorded: every clean sample passes, with the relations' chi-square per
block on the real fused kernels (the rounding the allowance is for, measured); every sabotaged
sample is rejected, and why. Then the fingerprints' GPU cost per pass at Kimi-K2.5's width
(CUDA events around the hook's block sums for 8 streams of T x 7168 bf16, T = 2048 and 8192,
and what they allocate: nothing).

One call, about 2-3 minutes on the H200 (most of it the server's start):

    python3 tests/gpu/proof.py --site SITE --out "$OUT" --phases sabotage
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time
from pathlib import Path

import requests
import torch

from common import REC, Server, start_phase, wait_for_samples
from hs_patch import store

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # tests/: lab.sabotage names the cases
from lab.sabotage import CASES, rid  # noqa: E402


def _send(server: Server, ids: list[int], rid: str, positions: int = 32) -> dict:
    body = {"input_ids": ids, "rid": rid, "return_logprob": True, "logprob_start_len": max(0, len(ids) - positions),
            "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    r = requests.post(server.url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def gpu_cost(hidden: int = 7168, streams: int = 8) -> dict:
    """Milliseconds of the hook's fingerprint kernels for one pass, and what they allocate (None without CUDA)."""
    from hs_patch.server import fingerprint

    if not torch.cuda.is_available():
        return {}
    out: dict = {"hidden": hidden, "streams": streams, "gpu": torch.cuda.get_device_name(0)}
    for tokens in (2048, 8192):
        xs = [torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(streams)]
        buf = torch.empty(streams, tokens, fingerprint.BLOCKS, device="cuda")
        for k in range(streams):  # warm-up
            fingerprint.block_sums(xs[k], buf[k])
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        reps = 20
        start.record()
        for _ in range(reps):
            for k in range(streams):
                fingerprint.block_sums(xs[k], buf[k])
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / reps
        read = streams * tokens * hidden * 2
        out[f"t{tokens}"] = {"ms_per_pass": round(ms, 4), "GBps": round(read / ms / 1e6, 1),
                             "allocated_bytes": torch.cuda.max_memory_allocated() - before}
        del xs, buf
        torch.cuda.empty_cache()
    return out


def sabotage(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    from hs_patch.host.fidelity.check import FidelityChecker, LMHead
    from hs_patch.host.fidelity.rows import Norms

    res: dict = {"model": model_dir, "cases": {}, "clean": []}
    dump = start_phase(a, "sabotage", tag, res)
    chunk = 256
    rng = random.Random(25)
    sent: list[tuple[str, list[int], dict]] = []
    server = Server(f"sabotage-{tag}", model_dir, a.port, chunk,
                    {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), "HS_CAPTURE_LAYERS": "1,2,3",
                     "HS_CAPTURE_FINAL": "both", "HS_TEST_SABOTAGE": "1"}, [],
                    first_on_path=str(HERE / "sabotage_site"), tp_size=a.tp_size, mem_fraction=a.mem_fraction)
    try:
        server.wait_ready()
        for i, case in enumerate(CASES):
            donor = [rng.randrange(3, 500) for _ in range(200)]
            sent.append((f"clean-{i}", donor, _send(server, donor, f"clean-{i}")))
            n = 600 if case == "other_rows" else 300  # longer than a chunk: rows of every chunk are checked
            ids = [rng.randrange(3, 500) for _ in range(n)]
            sent.append((case, ids, _send(server, ids, rid(case, i))))
        res["writer_lag_s"] = round(wait_for_samples(dump, {store.sample_key(x) for _, x, _ in sent}), 3)
        res["server_log_has_sabotage"] = "hs_patch sabotage installed" in server.log_path.read_text(errors="replace")
    finally:
        server.stop()
    REC.save()
    entries = store.read_manifest(dump)
    checker = FidelityChecker(LMHead.from_model_dir(model_dir), Path(a.work) / f"sabotage-{tag}",
                              norms=Norms.from_model_dir(model_dir), positions=32)
    t0 = time.time()
    try:
        for name, ids, out in sent:
            key = store.sample_key(ids)
            r = checker.check(key, dump / entries[key]["file"], out)
            row = {"tokens": len(ids), "parts": r.parts, "ok": r.ok, "top1_mismatches": r.mismatches,
                   "positions": r.checked, "problems": r.problems, "relations": r.rows.get("relations", {}),
                   "rows": r.rows.get("rows"), "chunks": r.rows.get("chunks")}
            if name.startswith("clean-"):
                res["clean"].append(row)
            else:
                res["cases"][name] = row
    finally:
        checker.close()
    res["check_seconds"] = round(time.time() - t0, 2)
    chi = [v["chi2"] / v["n"] for c in res["clean"] for v in c["relations"].values() if "chi2" in v]
    res["clean_chi2_per_block_max"] = round(max(chi), 4) if chi else None
    res["all_clean_pass"] = all(c["ok"] for c in res["clean"])
    res["all_cases_rejected"] = all(not c["ok"] for c in res["cases"].values()) and len(res["cases"]) == len(CASES)
    res["gpu_cost"] = gpu_cost()
    REC.save()
    shutil.rmtree(dump, ignore_errors=True)
    return res


def summarize_sabotage(k: str, f: dict) -> None:
    print(f"\n{k}: clean samples pass: {f['all_clean_pass']} ({len(f['clean'])}, largest chi-square per block "
          f"{f['clean_chi2_per_block_max']}); every case rejected: {f['all_cases_rejected']}")
    for case, c in f["cases"].items():
        why = (c["problems"][0][:100] if c["problems"] else f"top-1 {c['top1_mismatches']}/{c['positions']}")
        print(f"  {case:12} {'REJECTED' if not c['ok'] else 'ACCEPTED'}  {why}")
    g = f.get("gpu_cost") or {}
    for t in ("t2048", "t8192"):
        if t in g:
            print(f"  fingerprints, {g['streams']} streams x {t[1:]} tokens x {g['hidden']}: {g[t]['ms_per_pass']} ms "
                  f"a pass ({g[t]['GBps']} GB/s), {g[t]['allocated_bytes']} bytes allocated")
