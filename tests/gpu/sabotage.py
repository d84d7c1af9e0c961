"""GPU proof phase ``sabotage``: each wrong capture of issues #25 and #33 rejected by the production check, on
the real server.

Two capturing SGLang servers one after the other (HS_CAPTURE_LAYERS=1,2,3, chunked prefill 256):
HS_CAPTURE_FINAL=both, then =none (the LM head's input kept at the last 16 positions), each started
with ``tests/gpu/sabotage_site`` first on its PYTHONPATH and HS_TEST_SABOTAGE=1: the hook in the
server is the real one, with its entry points wrapped by ``tests/lab/sabotage.py`` so a request
whose id names a case is captured wrong in that way (every case that module lists: #25's wrong
layer, partial sum, zeros, other rows, post-is-pre, staging, shift; #33's damaged row, NaN and
garbage in stored post-norm rows after the copy, scaled plane and pre-norm state, a partial sum in
one chunk of a 16,384-token prompt, another request's states and a shift consistent in every
stream, the last two with FINAL=none too). Prompts go one at a time, a clean "donor" before each
sabotaged one, with SGLang's best two at the last 32 positions (``return_logprob``). Every sample
then goes through the driver's own check (:class:`hs_patch.host.fidelity.check.FidelityChecker`:
every row's bytes by checksum, the additive relations on every row, the norm relations on rows
of every chunk, judged per chunk; the logit gaps; the same-pass top-1). Recorded: every clean
sample passes, with its worst chunk's chi-square over the bound and its worst logit gap over the
tolerance on the real fused kernels (the room); every sabotaged sample is rejected, and why. Then
the hook's own GPU work per pass at Kimi-K2.5's width (:func:`gpu_cost`).

One call, about 4-5 minutes on the H200 (most of it the two servers' starts):

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
from hs_patch.samples import store

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent))  # tests/: lab.sabotage names the cases
from lab.sabotage import CASES, rid  # noqa: E402


def _send(server: Server, ids: list[int], rid: str, positions: int = 32) -> dict:
    body = {"input_ids": ids, "rid": rid, "return_logprob": True, "logprob_start_len": max(0, len(ids) - positions),
            "top_logprobs_num": 2, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    r = requests.post(server.url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def gpu_cost(hidden: int = 7168, layers: tuple[int, ...] = (2, 30, 58), n_layers: int = 61) -> dict:
    """The capture hook's own work on the forward path for one pass, on the GPU, at Kimi-K2.5's width and
    default capture (layers 2, 30, 58 + both finals; and with HS_CAPTURE_FINAL=none): the real hook playing
    a pass the way the patched model does (the embedded rows, each captured layer's residual, attention
    input and output and the residual after it, the final norm's inputs and outputs), its writer told to
    give each staging buffer back unwritten. CUDA events around the pass on the compute stream (the
    copies to the host run on the hook's side stream, off this path); what it allocates beyond what it
    made at start. None without CUDA."""
    import tempfile

    from hs_patch.server import config, hook
    from lab.passes import Batch, attention_input

    if not torch.cuda.is_available():
        return {}
    out: dict = {"hidden": hidden, "layers": list(layers), "gpu": torch.cuda.get_device_name(0)}
    dev = torch.device("cuda", 0)
    for final in ("both", "none"):
        for tokens in (2048, 8192):
            with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="hs-gpu-cost-") as tmp:
                cfg = config.CaptureConfig(enabled=True, directory=tmp, layers=layers, final=final, slots=3,
                                           slot_tokens=tokens)
                h = hook.CaptureHook(cfg, hidden_size=hidden, metadata={"sglang_release": "0.5.16"}, pinned=True,
                                     device=dev, release="0.5.16")
                h.writer.submit = lambda rec: (rec.wait and rec.wait(), rec.release())  # nothing written
                x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
                attn_in = attention_input(x)
                ids = torch.arange(tokens, device=dev)

                def one_pass() -> None:
                    p = h.begin(Batch([tokens]), ids, x)
                    for i in layers:
                        tee = p.collector(i, None)
                        tee.capture(x)
                        tee.hs_attn_input(attn_in)
                        tee.hs_attn_output(x)
                        tee.hs_mid(x)
                    p.final_inputs(x, x)
                    p.final_prenorm(x)
                    p.finish(x)

                one_pass()  # warm-up
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                reps = 10
                start.record()
                for _ in range(reps):
                    one_pass()
                end.record()
                torch.cuda.synchronize()
                out[f"{final}_t{tokens}"] = {"ms_per_pass": round(start.elapsed_time(end) / reps, 4),
                                             "allocated_bytes": torch.cuda.max_memory_allocated() - before,
                                             "made_at_start_bytes": h.device_bytes, "streams": len(h.streams),
                                             "checksums": len(h.checksums)}
                h.close()
                del x, attn_in
                torch.cuda.empty_cache()
    return out


def _run_server(a: argparse.Namespace, name: str, model_dir: str, dump: Path, final: str, chunk: int,
                plan: list[tuple[str, int, int]], rng: random.Random, env: dict) -> list[tuple[str, list[int], dict]]:
    """One capturing server with the sabotage installed; ``plan``: (case, donor length, target length) each,
    a clean donor sent before each target."""
    sent: list[tuple[str, list[int], dict]] = []
    server = Server(name, model_dir, a.port, chunk,
                    {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), "HS_CAPTURE_LAYERS": "1,2,3",
                     "HS_CAPTURE_FINAL": final, "HS_TEST_SABOTAGE": "1", **env}, [],
                    first_on_path=str(HERE / "sabotage_site"), tp_size=a.tp_size, mem_fraction=a.mem_fraction)
    try:
        server.wait_ready()
        for i, (case, donor_len, n) in enumerate(plan):
            donor = [rng.randrange(3, 500) for _ in range(donor_len)]
            sent.append((f"clean-{final}-{i}", donor, _send(server, donor, f"clean-{i}")))
            ids = [rng.randrange(3, 500) for _ in range(n)]
            sent.append((case, ids, _send(server, ids, rid(case, i))))
        wait_for_samples(dump, {store.sample_key(x) for _, x, _ in sent})
        if "hs_patch sabotage installed" not in server.log_path.read_text(errors="replace"):
            raise RuntimeError(f"server {name} did not install the sabotage: its samples prove nothing")
    finally:
        server.stop()
    return sent


def sabotage(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    from hs_patch.host.fidelity.check import FidelityChecker, LMHead
    from hs_patch.host.fidelity.rows import Norms

    res: dict = {"model": model_dir, "cases": {}, "clean": []}
    dump = start_phase(a, "sabotage", tag, res)
    chunk, long_tokens = 256, getattr(a, "sabotage_long", 16384)  # the CPU rehearsal's stand-in holds less
    rng = random.Random(25)
    # issue #25's and #33's cases with both finals stored; a partial sum in one chunk (the 33rd of 64) of a
    # 16,384-token prompt; another request's states: a donor of the same length. With HS_CAPTURE_FINAL=none
    # the two cases only the logit gaps see (the LM head's input kept at the last 16 positions).
    both = [(c, 300 if c == "other_request" else 200,
             long_tokens if c == "chunk_partial" else 600 if c == "other_rows" else 300) for c in CASES]
    none = [(c, 300, 300) for c in ("other_request", "shift_all")]
    t0 = time.time()
    sent = _run_server(a, f"sabotage-{tag}", model_dir, dump / "both", "both", chunk, both, rng,
                       {"HS_TEST_SABOTAGE_AT_PREFIX": str(max(1, -(-long_tokens // chunk) // 2) * chunk)})
    sent_none = _run_server(a, f"sabotage-none-{tag}", model_dir, dump / "none", "none", chunk, none, rng, {})
    res["servers_s"] = round(time.time() - t0, 1)
    REC.save()
    checker = FidelityChecker(LMHead.from_model_dir(model_dir), Path(a.work) / f"sabotage-{tag}",
                              norms=Norms.from_model_dir(model_dir), positions=32)
    t0 = time.time()
    try:
        for where, batch in (("both", sent), ("none", sent_none)):
            entries = store.read_manifest(dump / where)
            for name, ids, out in batch:
                key = store.sample_key(ids)
                r = checker.check(key, dump / where / entries[key]["file"], out)
                row = {"final": where, "tokens": len(ids), "parts": r.parts, "ok": r.ok,
                       "top1_mismatches": r.mismatches, "positions": r.checked, "problems": r.problems,
                       "gaps": r.gaps, "gap_mismatches": len(r.gap_mismatches),
                       "gap_worst": r.gap_worst,
                       "relations": r.rows.get("relations", {}), "every_row": r.rows.get("every_row", []),
                       "rows": r.rows.get("rows"), "chunks": r.rows.get("chunks")}
                if name.startswith("clean-"):
                    res["clean"].append(row)
                else:
                    res["cases"][f"{name}" if where == "both" else f"{name}/final=none"] = row
    finally:
        checker.close()
    res["check_seconds"] = round(time.time() - t0, 2)
    ratios = [v["ratio"] for c in res["clean"] for v in c["relations"].values() if "ratio" in v]
    res["clean_worst_chunk_ratio"] = round(max(ratios), 4) if ratios else None
    res["clean_gap_worst_of_tolerance"] = round(max(c["gap_worst"] for c in res["clean"]), 4)
    res["all_clean_pass"] = all(c["ok"] for c in res["clean"])
    res["all_cases_rejected"] = all(not c["ok"] for c in res["cases"].values()) and \
        len(res["cases"]) == len(both) + len(none)
    res["gpu_cost"] = gpu_cost()
    REC.save()
    shutil.rmtree(dump, ignore_errors=True)
    return res


def summarize_sabotage(k: str, f: dict) -> None:
    print(f"\n{k}: clean samples pass: {f['all_clean_pass']} ({len(f['clean'])}, worst chunk at "
          f"{f['clean_worst_chunk_ratio']} of its bound, worst logit gap at {f['clean_gap_worst_of_tolerance']} of its "
          f"tolerance); every case rejected: {f['all_cases_rejected']}")
    for case, c in f["cases"].items():
        why = (c["problems"][0][:100] if c["problems"] else f"top-1 {c['top1_mismatches']}/{c['positions']}, "
               f"logit gaps {c['gap_mismatches']}/{c['gaps']}")
        print(f"  {case:28} {'REJECTED' if not c['ok'] else 'ACCEPTED'}  {why}")
    g = f.get("gpu_cost") or {}
    for key, v in g.items():
        if isinstance(v, dict):
            print(f"  hook, {key}: {v['ms_per_pass']} ms a pass on the compute stream ({v['streams']} fingerprint, "
                  f"{v['checksums']} checksum streams), {v['allocated_bytes']} bytes allocated beyond "
                  f"{v['made_at_start_bytes']} made at start")
