#!/usr/bin/env python3
"""GPU proof: the patched SGLang dumps exactly what it computes, at full speed.

Runs anywhere ``import sglang`` works on a GPU (CI has none: run it by hand, record the
output in bench/RESULTS.md). In one run it:

1. patches the SGLang install in place (``hs-patch apply`` then ``verify``);
2. writes a random DeepseekV3 with Kimi-K2 head dims and YaRN rope
   (``tests/gpu/make_model.py``) and starts ``python -m sglang.launch_server`` on it with
   capture on through the HS_CAPTURE_* environment, as the service unit does;
3. fidelity: sends prompts of different lengths concurrently (batched prefill), one
   longer than the chunked-prefill size (chunking), reads every sample with the
   project's reader and checks it against:
   - transformers on the same weights in fp32, per captured layer and final state, with
     a tolerance taken from the same run: FACTOR x the error of transformers in bf16
     against fp32 on the same inputs (the bf16 envelope);
   - SGLang's own ``return_hidden_states`` for the same request (must be identical);
   - ``lm_head`` on the dumped final state at the last prompt position against the
     token SGLang generated first (must match for every request);
4. extraction (``tests/gpu/extract.py``): what a user runs, side by side on the same
   prompts: pristine SGLang with a plain client, the capturing server with the same
   client (until every sample is written), and the capturing server driven by
   ``hs-extract drive`` (until every sample is adopted);
5. throughput (``tests/gpu/throughput.py``): prefill tokens/s for PROMPTS x TOKENS on a
   TP_LAYERS-deep model, side by side: pristine SGLang (a reverted copy of the package first
   on its PYTHONPATH), patched with capture off, patched with capture on, three servers up
   at once on the one GPU, each round sending the same prompts to each in rotating order;
   ratios within each round, median over REPS rounds; the cost per captured layer against
   one layer's compute and the projection for Kimi-K2.5 (from a copy micro-benchmark);
6. tp (``tests/gpu/tp_compare.py``, not in the default phases; ``--tp-size N`` GPUs): the same
   model at TP=1 and TP=N on the same batched and chunked prompts, every plane compared
   within the bf16 envelope, the same-pass top-1 check at TP=N, one file per sample, and
   the server log showing rank 0 writing and the other N-1 ranks not;
7. production (``tests/gpu/production.py``, not in the default phases): the driver's
   same-pass fidelity check (fp32 lm_head argmax vs SGLang's own top-1 from
   return_logprob) on every position of batched and chunked prompts, its near-tie margins,
   wrong states, the --derive-post-norm gap and the check's CPU cost at Kimi-K2.5's head size;
8. sweep (``tests/gpu/sweep.py``, not in the default phases: ``--phases sweep``): issue #22's rate sweep at
   the depths of ``--sweep-layers`` (kimi-layer preset: 8, 16 and 32 layers make about 2.1, 1.0 and 0.5 GB/s
   of states; 2 and 4 outrun the writer), pristine vs capture until written vs ``hs-extract drive`` side by
   side in rotating order, the GPU memory held and grown under load by each server (with ``--chunk 16384
   --long-prompts 8``: the peak at 16K-token passes, capture on vs off) and the capture threads' CPU per GB;
   in calls of at most ``--call-seconds``, the same command again continuing the record kept in ``--work``;
9. startup (``tests/gpu/startup.py``, not in the default phases; ONE call of about 5 minutes: ``--phases
   startup``): issue #36's start-up of ``hs-extract drive`` on the GPU host's software against a real
   capturing server, before (``--startup-code``) and after, the command to the first request and the whole run;
10. sabotage (``tests/gpu/sabotage.py``, not in the default phases; ONE call of about 2-3 minutes:
   ``--phases sabotage``): issue #25's wrong captures (wrong layer, a rank's partial sum, zeros,
   pre-norm zeros, another prompt's rows in a chunked prompt's first chunk, the pre-norm state as
   the post-norm one, rows misplaced in the staging buffer, a shift) made on purpose in the real
   server's capture hook, each rejected by the driver's check while clean samples pass (with
   the norm relation's chi-square per block on the real fused kernels), and the fingerprints'
   GPU time per pass at Kimi-K2.5's width;
11. writes everything as JSON under --out as it goes and prints a table last.

usage: python3 tests/gpu/proof.py --site /tmp/site --out "$OUT"
       [--phases fidelity,extract,throughput,micro,production,tp,sabotage,sweep,startup]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import signal
import statistics
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE.parent), str(HERE)]

import torch  # noqa: E402

from common import REC, Server, hs_patch_cli, start_phase, wait_for_samples  # noqa: E402
from extract import extraction, summarize_extraction  # noqa: E402
from hs_patch.samples import reader, store  # noqa: E402
from production import production  # noqa: E402
from startup import startup, summarize_startup  # noqa: E402
from sabotage import sabotage, summarize_sabotage  # noqa: E402
from sweep import summarize_sweep, sweep  # noqa: E402
from throughput import copy_microbench, projection, summarize, throughput  # noqa: E402
from tp_compare import summarize_tp, tp_compare  # noqa: E402


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def cos(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    c = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
    return float(c.mean()), float(c.min())


# --------------------------------------------------------------------------- fidelity


def fidelity(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    from lab.hf_reference import reference
    from transformers import AutoModelForCausalLM

    res: dict = {"model": model_dir}
    dump = start_phase(a, "fidelity", tag, res)
    layers = list(range(a.layers))
    chunk = 1024
    lengths = [2500, 37, 200, 513, 1000, 64, 128, 777]  # 2500 > chunk: prefilled in 3 passes
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    res.update(lengths=lengths, chunked_prefill_size=chunk, layers=layers, final="both")
    server = Server(f"fidelity-{tag}", model_dir, a.port, chunk,
                    {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), "HS_CAPTURE_LAYERS": ",".join(map(str, layers)),
                     "HS_CAPTURE_FINAL": "both"}, ["--enable-return-hidden-states"], tp_size=a.tp_size)
    try:
        server.wait_ready()
        with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: batched prefill
            outs = list(pool.map(lambda x: server.generate(x[1], f"proof-{x[0]}", hidden=True), enumerate(prompts)))
        # SGLang's return_hidden_states slices each request's rows assuming its whole prompt is
        # in the pass, so under batching or chunking it returns missing or shifted rows; the
        # identity check therefore also sends prompts one at a time, each shorter than a chunk
        solo = [[rng.randrange(3, 512) for _ in range(n)] for n in (100, 333, 900)]
        solo_outs = [server.generate(x, f"proof-solo-{i}", hidden=True) for i, x in enumerate(solo)]
        keys = {store.sample_key(p) for p in prompts + solo}
        res["writer_lag_s"] = round(wait_for_samples(dump, keys), 3)
        res["hook_status"] = json.loads((dump / "hook_status.json").read_text()) \
            if (dump / "hook_status.json").exists() else None
    finally:
        server.stop()
    REC.save()

    samples = {s.key: s for s in reader.iter_samples(dump)}
    res["samples"] = len(samples)
    res["foreign_samples"] = len(samples) - len(prompts) - len(solo)  # SGLang's own warmup request
    res["inspect_clean"] = reader.check_dir(dump).clean
    hf32 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    hf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    lm_head = hf16.lm_head.weight  # bf16, as SGLang holds it
    planes = [store.layer_plane(i) for i in layers] + ["final.pre_norm", "final.post_norm"]
    acc: dict[str, dict[str, list]] = {p: {"rel": [], "cos": [], "cos_min": [], "env": []} for p in planes}
    per_req = []
    for ids, out in zip(prompts, outs):
        s = samples[store.sample_key(ids)]
        r32, r16 = reference(hf32, ids), reference(hf16, ids)
        got = {p: s.plane(p).cuda() for p in planes}
        ref32 = {**{store.layer_plane(i): r32.layer_in[i] for i in layers},
                 "final.pre_norm": r32.pre_norm, "final.post_norm": r32.post_norm}
        ref16 = {**{store.layer_plane(i): r16.layer_in[i] for i in layers},
                 "final.pre_norm": r16.pre_norm, "final.post_norm": r16.post_norm}
        for p in planes:
            acc[p]["rel"].append(rel(got[p], ref32[p]))
            c, cmin = cos(got[p], ref32[p])
            acc[p]["cos"].append(c)
            acc[p]["cos_min"].append(cmin)
            acc[p]["env"].append(rel(ref16[p], ref32[p]))
        # SGLang's own return_hidden_states: the same computation, so identical
        hs = out["meta_info"].get("hidden_states")
        theirs = torch.cat([torch.tensor(h, dtype=torch.float32).reshape(-1, s.plane("final.post_norm").shape[1])
                            for h in hs]) if hs else None
        post = s.plane("final.post_norm").float()
        rows = 0 if theirs is None else min(theirs.shape[0], post.shape[0])  # SGLang may return fewer rows
        same = rows > 0 and torch.equal(theirs[:rows] if theirs.shape[0] >= post.shape[0] else theirs, post[-rows:])
        # lm_head on the dumped final state at the last prompt position = SGLang's first token
        logits = (got["final.post_norm"][-1:].to(lm_head.dtype) @ lm_head.T).float()
        first = out["output_ids"][0] if out.get("output_ids") else None
        per_req.append({"tokens": len(ids), "parts": int(s.metadata["parts"]), "rid": s.metadata["rid"],
                        "return_hidden_states_identical": bool(same),
                        "return_hidden_states_rows": None if theirs is None else theirs.shape[0],
                        "max_abs_diff_vs_return_hidden_states": None if not rows else
                        float(((theirs[:rows] if theirs.shape[0] >= post.shape[0] else theirs) - post[-rows:]).abs().max()),
                        "lm_head_argmax": int(logits.argmax()), "sglang_first_token": first,
                        "lm_head_matches": int(logits.argmax()) == first})
    identity = []
    for ids, out in zip(solo, solo_outs):
        post = samples[store.sample_key(ids)].plane("final.post_norm").float()
        theirs = torch.cat([torch.tensor(h, dtype=torch.float32).reshape(-1, post.shape[1])
                            for h in out["meta_info"]["hidden_states"]])
        identity.append({"tokens": len(ids), "rows": theirs.shape[0],
                         "identical": theirs.shape == post.shape and torch.equal(theirs, post),
                         "max_abs_diff": float((theirs - post).abs().max()) if theirs.shape == post.shape else None})
    res["identity_unbatched"] = identity
    factor = a.envelope_factor
    table = []
    for p in planes:
        r_, e_ = statistics.fmean(acc[p]["rel"]), statistics.fmean(acc[p]["env"])
        table.append({"plane": p, "rel_err_vs_fp32": r_, "cos_mean": statistics.fmean(acc[p]["cos"]),
                      "cos_min": min(acc[p]["cos_min"]), "bf16_envelope": e_, "tolerance": factor * e_,
                      "ok": max(acc[p]["rel"]) <= factor * max(acc[p]["env"])})
    res.update(table=table, requests=per_req, envelope_factor=factor,
               all_within_envelope=all(t["ok"] for t in table),
               return_hidden_states_identical=all(r["identical"] for r in identity),
               return_hidden_states_batched_rows_ok=sum(r["return_hidden_states_rows"] == r["tokens"]
                                                        for r in per_req),
               lm_head_match=f"{sum(r['lm_head_matches'] for r in per_req)}/{len(per_req)}",
               chunked_reassembled=per_req[0]["parts"] >= 3)
    del hf32, hf16
    torch.cuda.empty_cache()
    REC.save()
    return res


def model(a: argparse.Namespace, hidden: int, layers: int, preset: str = "small") -> str:
    from make_model import build

    model_dir = str(Path(a.work) / f"model-{preset}-h{hidden}-l{layers}")
    if not Path(model_dir, "config.json").exists():
        t = time.time()
        build(model_dir, hidden=hidden, layers=layers, device="cuda", preset=preset)  # fast random init
        gc.collect()
        torch.cuda.empty_cache()  # give the build's GPU memory back before servers size their KV pools
        REC.log(f"built {model_dir} in {time.time() - t:.0f}s")
    return model_dir


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", required=True, help="the directory that contains sglang/ (patched in place)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-proof-out"), help="results directory")
    ap.add_argument("--work", default="/tmp/hs-proof", help="models and logs")
    ap.add_argument("--dump-root", default="/dev/shm/hs-proof", help="capture directories (tmpfs, as in production)")
    ap.add_argument("--phases", default="fidelity,throughput,micro",
                    help="any of fidelity,extract,throughput,micro,production,tp,sabotage,sweep (sabotage: one call "
                         "of 2-3 minutes on the H200, issue #25's wrong captures each rejected; sweep: one call of "
                         "about 9 minutes, issue #22's rates of states)")
    ap.add_argument("--sweep-layers", default="8,16,32", help="sweep phase: model depths (kimi-layer preset)")
    ap.add_argument("--sweep-hidden", type=int, default=7168, help="sweep phase: hidden size")
    ap.add_argument("--sweep-env", default="", metavar="HS_CAPTURE_X=V,...",
                    help="sweep phase: the capturing server's hook settings beyond the defaults, e.g. "
                    "HS_CAPTURE_SLOTS=4,HS_CAPTURE_WRITERS=12 (not LAYERS or FINAL: the rates assume the default "
                    "capture)")
    ap.add_argument("--startup-code", default=".base", help="startup phase: the checkout of the code before (its "
                    "hs_patch/ is enough: git archive main hs_patch | tar -x -C .base, carried)")
    ap.add_argument("--startup-reps", type=int, default=3, help="startup phase: runs of each row and code")
    ap.add_argument("--startup-prompts", default="1,64", help="startup phase: dataset sizes")
    ap.add_argument("--startup-models", default="fast,remote", help="startup phase: fast (a tokenizer.json: "
                    "AutoTokenizer's way, its class remembered after the first start), remote (its own code)")
    ap.add_argument("--startup-tokenizer-cache", choices=("warm", "cold"), default="warm", help="startup phase: "
                    "the tokenizer's class remembered from an earlier start (warm) or a model directory's first start")
    ap.add_argument("--call-seconds", type=float, default=0, help="sweep phase: stop cleanly before a depth or round "
                    "that would end after this many seconds from the start (0: no limit); the record is kept in "
                    "--work, and the same command again on the same (warm) machine continues it")
    ap.add_argument("--capture-mem-fraction", type=float, default=0, help="sweep phase: the capturing server's "
                    "--mem-fraction-static (0: --mem-fraction); SGLang takes it of the memory free at the server's "
                    "start, after the pristine server's (32 layers on an 80 GB card: 0.85)")
    ap.add_argument("--writer-profile", action="store_true", help="sweep phase: py-spy (on PATH) records the capturing "
                    "scheduler during each depth's first measured capture row; its hottest frames per thread group")
    ap.add_argument("--sweep-weights", action="store_true", help="sweep phase: write real random checkpoints "
                    "(slower; the driver's fidelity check on) instead of SGLang's --load-format dummy")
    ap.add_argument("--hidden", default="1024", help="comma-separated hidden sizes to run, e.g. 1024,7168")
    ap.add_argument("--layers", type=int, default=4, help="model depth for the fidelity run")
    ap.add_argument("--tp-layers", type=int, default=61, help="model depth for the throughput runs (Kimi: 61)")
    ap.add_argument("--tp-preset", default="small", choices=["small", "kimi-layer"],
                    help="per-layer shapes of the throughput model (tests/gpu/make_model.py)")
    ap.add_argument("--prompts", type=int, default=64, help="concurrent prompts per throughput round")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per throughput prompt")
    ap.add_argument("--reps", type=int, default=6, help="measured throughput rounds (after one warm-up round)")
    ap.add_argument("--chunk", type=int, default=8192, help="chunked prefill size for the throughput runs")
    ap.add_argument("--on", action="append", default=None, metavar="NAME[:HS_CAPTURE_X=V,...]",
                    help="a capturing server for the throughput run (repeatable; default: one with the "
                         "product defaults), e.g. --on on --on w8:HS_CAPTURE_WRITERS=8")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight in the extract phase "
                    "(plain client and hs-extract drive --concurrency)")
    ap.add_argument("--long-prompts", type=int, default=0, help="extract phase: this many of the prompts are "
                    "--long-tokens long (prefilled in several chunks)")
    ap.add_argument("--long-tokens", type=int, default=16384)
    ap.add_argument("--round-offset", type=int, default=0, help="extract phase: start the rows' rotating order "
                    "this many places on (a second call continuing a first one's rounds)")
    ap.add_argument("--warmup-prompts", type=int, default=0, help="extract phase: prompts of the warm-up round "
                    "(0: as many as a measured round)")
    ap.add_argument("--mem-fraction", type=float, default=0.45,
                    help="--mem-fraction-static of each throughput server (of the memory free at its start)")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="tensor parallelism of every server (HS_CAPTURE_RANK 0 writes); needs that many GPUs")
    ap.add_argument("--tp-lengths", default="40,2000,300,777,128,1500,64,1024",
                    help="tp phase: prompt lengths, sent at once (longer than --tp-chunk: chunked)")
    ap.add_argument("--tp-chunk", type=int, default=512, help="tp phase: chunked prefill size")
    ap.add_argument("--envelope-factor", type=float, default=4.0)
    ap.add_argument("--port", type=int, default=30123, help="first of four ports")
    a = ap.parse_args()
    a.on = a.on or ["on"]
    REC.out = Path(a.out)
    REC.out.mkdir(parents=True, exist_ok=True)
    REC.logs = Path(a.work) / "logs"
    REC.logs.mkdir(parents=True, exist_ok=True)
    phases = a.phases.split(",")
    rec = REC.data
    rc = 0
    signal.signal(signal.SIGTERM, _terminated)  # `timeout` at a call's limit: stop the servers, keep the record
    try:
        import sglang

        rec["args"] = vars(a)
        rec["env"] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                      "sglang": getattr(sglang, "__version__", "?"), "python": sys.version.split()[0],
                      "cpus": os.cpu_count()}
        rec["patch_apply"] = hs_patch_cli("apply", "--site", a.site)
        rec["patch_verify"] = hs_patch_cli("verify", "--site", a.site)
        assert rec["patch_verify"]["exit_code"] == 0, rec["patch_verify"]
        REC.log("patched:", rec["patch_apply"]["message"])
        REC.save()
        for h in [int(x) for x in a.hidden.split(",")]:
            tag = f"h{h}"
            if "fidelity" in phases:
                f = fidelity(a, model(a, h, a.layers), tag)
                REC.log(f"{tag} fidelity: envelope ok={f['all_within_envelope']} rhs identical="
                        f"{f['return_hidden_states_identical']} lm_head {f['lm_head_match']}")
            if "extract" in phases:
                extraction(a, model(a, h, a.tp_layers, a.tp_preset),
                           f"{tag}_l{a.tp_layers}_{a.tp_preset}_c{a.chunk}_long{a.long_prompts}")
            if "sabotage" in phases:
                s = sabotage(a, model(a, h, a.layers), tag)
                REC.log(f"{tag} sabotage: clean pass {s['all_clean_pass']}, every case rejected "
                        f"{s['all_cases_rejected']}")
            if "startup" in phases:
                startup(a, model(a, h, a.layers), tag)
            if "production" in phases:
                p = production(a, model(a, h, a.layers), tag)
                REC.log(f"{tag} production check: agree {p['agree']}/{p['positions']}, first token "
                        f"{p['first_token']}, largest disagreement margin {p['disagree_margin_max']} std")
            if "tp" in phases:
                if torch.cuda.device_count() < a.tp_size or a.tp_size < 2:
                    raise SystemExit(f"--phases tp needs --tp-size N >= 2 and N GPUs: this machine has "
                                     f"{torch.cuda.device_count()}, --tp-size is {a.tp_size}")
                summarize_tp(tag, tp_compare(a, model(a, h, a.layers, a.tp_preset), f"{tag}_{a.tp_preset}"))
            if "throughput" in phases:
                throughput(a, model(a, h, a.tp_layers, a.tp_preset), f"{tag}_l{a.tp_layers}_{a.tp_preset}")
            if "micro" in phases:
                rec[f"micro_{tag}"] = copy_microbench(h)
                REC.save()
        if "sweep" in phases:
            sweep(a, f"h{a.sweep_hidden}_c{a.chunk}_long{a.long_prompts}")
        if "micro" in phases:
            rec["micro_h7168"] = rec.get("micro_h7168") or copy_microbench(7168)
            rec["projection_kimi"] = projection(rec["micro_h7168"])
    except Exception:
        rec["error"] = traceback.format_exc()
        REC.log("FAILED\n" + rec["error"])
        rc = 1
    finally:
        hs_patch_cli("apply", "--site", a.site)  # leave the install patched
        shutil.rmtree(a.dump_root, ignore_errors=True)  # GBs in tmpfs; the results are in --out
        rec["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        REC.save()
    summary(rec)
    return rc


class Terminated(Exception):
    """SIGTERM (``timeout`` ending a call): raised in the main thread so every ``finally`` stops its servers;
    they run in sessions of their own, and a server left running answered the next call's pristine row."""


def _terminated(signum: int, frame: object) -> None:
    raise Terminated("terminated by SIGTERM (a time limit?): the phase in progress is cut; results so far are kept")


def summary(r: dict) -> None:
    for k, f in r.items():
        if k.startswith("fidelity_") and "table" in f:
            print(f"\n{k}: {f['samples']} samples, lengths {f['lengths']}, chunk {f['chunked_prefill_size']}")
            print(f"{'plane':18}{'rel err':>10}{'cos mean':>10}{'cos min':>10}{'bf16 env':>10}{'tol':>10}  ok")
            for t in f["table"]:
                print(f"{t['plane']:18}{t['rel_err_vs_fp32']:10.2e}{t['cos_mean']:10.6f}{t['cos_min']:10.6f}"
                      f"{t['bf16_envelope']:10.2e}{t['tolerance']:10.2e}  {t['ok']}")
            print(f"return_hidden_states identical (unbatched): {f['return_hidden_states_identical']} "
                  f"{[(x['tokens'], x['identical']) for x in f['identity_unbatched']]}; batched/chunked requests "
                  f"for which SGLang returned all rows: {f['return_hidden_states_batched_rows_ok']}/{len(f['requests'])}")
            print(f"lm_head first token: "
                  f"{f['lm_head_match']}; chunked sample reassembled: {f['chunked_reassembled']}")
        if k.startswith("sabotage_") and "cases" in f:
            summarize_sabotage(k, f)
        if k.startswith("production_") and "positions" in f:
            print(f"\n{k}: same-pass top-1 {f['agree']}/{f['positions']} positions, first token {f['first_token']}; "
                  f"disagreement margins max {f['disagree_margin_max']} p99 {f['disagree_margin_p99']} std; "
                  f"wrong states {f['wrong_states']}; derive-post-norm {f['derive_post_norm'][:2]}; "
                  f"Kimi head on CPU {f['kimi_head_cpu']}")
        if k.startswith("throughput_") and "ratio_on" in f:
            summarize(k, f)
        if k.startswith("extract_") and "ratios" in f:
            summarize_extraction(k, f)
        if k.startswith("sweep_") and "runs" in f:
            summarize_sweep(k, f)
        if k.startswith("startup_") and "runs" in f:
            summarize_startup(k, f)
        if k.startswith("micro_"):
            print(f"\n{k}: clone {f['clone_ms']:.3f} ms ({f['clone_GBps']:.0f} GB/s), "
                  f"D2H {f['d2h_ms_side_stream']:.3f} ms ({f['d2h_GBps']:.0f} GB/s) for {f['tokens']}x{f['hidden']} bf16")
    if "error" in r:
        print("\nERROR:", r["error"].splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
