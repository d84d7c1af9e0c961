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
4. throughput: prefill tokens/s for PROMPTS x TOKENS, REPS repetitions, median, side by
   side: pristine SGLang, patched with capture off, patched with capture on; the cost
   per captured layer against one layer's compute and the projection for Kimi-K2.5;
5. writes everything as JSON under --out as it goes and prints a table last.

usage: python3 tests/gpu/proof.py --site /tmp/site --out "$OUT" [--phases fidelity,throughput]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import requests  # noqa: E402
import torch  # noqa: E402

from hs_patch import reader, store  # noqa: E402

RESULTS: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
OUT = Path(".")
LOGS = Path(".")


def log(*a: object) -> None:
    print(f"[proof +{time.time() - T0:6.1f}s]", *a, flush=True)


def save() -> None:
    (OUT / "results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def hs_patch_cli(*args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "hs_patch.cli", *args, "--json"], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"})
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["exit_code"] = out.returncode
    return res


class Server:
    """``python -m sglang.launch_server`` in its own process group, like the service unit."""

    def __init__(self, name: str, model: str, port: int, chunk: int, capture: dict | None, extra: list[str]):
        env = {k: v for k, v in os.environ.items() if not k.startswith("HS_CAPTURE")}
        env["PYTHONPATH"] = f"{ROOT}:{env.get('PYTHONPATH', '')}"
        env.update(capture or {})
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = LOGS / f"server-{name}.log"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--host", "127.0.0.1",
               "--port", str(port), "--tp-size", "1", "--attention-backend", "triton",
               "--sampling-backend", "pytorch", "--disable-radix-cache", "--disable-prefill-cuda-graph",
               "--disable-decode-cuda-graph", "--mem-fraction-static", "0.5", "--random-seed", "0",
               "--chunked-prefill-size", str(chunk), "--log-level", "warning", *extra]
        self.name = name
        self.proc = subprocess.Popen(cmd, env=env, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        t = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {name} exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() - t > 400:
                raise RuntimeError(f"server {name} not healthy after 400 s:\n{self.tail()}")
            time.sleep(1)
        self.start_s = round(time.time() - t, 1)
        log(f"server {name} up in {self.start_s}s")

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def generate(self, ids: list[int], rid: str, max_new: int = 1, hidden: bool = False) -> dict:
        body = {"input_ids": ids, "rid": rid, "return_hidden_states": hidden,
                "sampling_params": {"max_new_tokens": max_new, "temperature": 0.0, "ignore_eos": True}}
        r = requests.post(self.url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def wait_for_samples(directory: Path, keys: set[str], timeout: float = 120) -> float:
    t = time.time()
    while True:
        have = set(store.read_manifest(directory)) if directory.exists() else set()
        if keys <= have:
            return time.time() - t
        if time.time() - t > timeout:
            raise RuntimeError(f"{len(keys - have)} of {len(keys)} samples missing in {directory} after {timeout}s")
        time.sleep(0.05)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def cos(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    c = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
    return float(c.mean()), float(c.min())


# --------------------------------------------------------------------------- fidelity


def fidelity(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    from hf_reference import reference
    from transformers import AutoModelForCausalLM

    res: dict = {"model": model_dir}
    RESULTS[f"fidelity_{tag}"] = res
    st = hs_patch_cli("apply", "--site", a.site)  # a throughput run may have left it pristine
    assert st["exit_code"] == 0 and st["state"] == "patched", st
    layers = list(range(a.layers))
    dump = Path(a.work) / f"dump-fid-{tag}"
    shutil.rmtree(dump, ignore_errors=True)
    chunk = 1024
    lengths = [2500, 37, 200, 513, 1000, 64, 128, 777]  # 2500 > chunk: prefilled in 3 passes
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    res.update(lengths=lengths, chunked_prefill_size=chunk, layers=layers, final="both")
    server = Server(f"fidelity-{tag}", model_dir, a.port, chunk,
                    {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), "HS_CAPTURE_LAYERS": ",".join(map(str, layers)),
                     "HS_CAPTURE_FINAL": "both"}, ["--enable-return-hidden-states"])
    try:
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
    save()

    partial = store.superseded(dump)  # first parts of the chunked prompts
    samples = {s.key: s for s in reader.iter_samples(dump) if s.key not in partial}
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
    save()
    return res


# --------------------------------------------------------------------------- throughput


def throughput(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    res: dict = {"model": model_dir, "prompts": a.prompts, "tokens": a.tokens, "reps": a.reps,
                 "chunked_prefill_size": a.chunk}
    RESULTS[f"throughput_{tag}"] = res
    n_layers = int(json.loads(Path(model_dir, "config.json").read_text())["num_hidden_layers"])
    layers = [2, n_layers // 2, n_layers - 3, n_layers - 1][: min(4, n_layers)]  # Kimi-like spread
    layers = sorted(set(layers))
    planes = len(layers) + 1  # + final.pre_norm: as many planes as Kimi's 2,30,58,60 + final
    res["capture_layers"] = layers
    rng = random.Random(11)
    for mode in a.modes.split(","):
        pristine = mode.startswith("pristine")
        st = hs_patch_cli("revert" if pristine else "apply", "--site", a.site)
        assert st["exit_code"] == 0 and st["state"] == ("pristine" if pristine else "patched"), st
        dump = Path(a.work) / f"dump-tp-{tag}"
        shutil.rmtree(dump, ignore_errors=True)
        capture = {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), "HS_CAPTURE_LAYERS": ",".join(map(str, layers)),
                   "HS_CAPTURE_FINAL": "pre"} if mode == "on" else None
        server = Server(f"tp-{tag}-{mode}", model_dir, a.port, a.chunk, capture, [])
        m: dict = {"start_s": server.start_s, "tok_s": []}
        res[mode] = m
        try:
            for rep in range(a.reps + 1):  # the first round warms up (and compiles kernels)
                prompts = [[rng.randrange(3, 512) for _ in range(a.tokens)] for _ in range(a.prompts)]
                t = time.perf_counter()
                with ThreadPoolExecutor(a.prompts) as pool:
                    list(pool.map(lambda x: server.generate(x[1], f"tp-{rep}-{x[0]}"), enumerate(prompts)))
                dt = time.perf_counter() - t
                if rep:
                    m["tok_s"].append(a.prompts * a.tokens / dt)
                if mode == "on":
                    lag = wait_for_samples(dump, {store.sample_key(p) for p in prompts})
                    m.setdefault("writer_lag_s", []).append(round(lag, 3))
                    for f in dump.glob("*.safetensors"):  # keep /dev/shm small between rounds
                        f.unlink()
            if mode == "on":
                m["hook_status"] = json.loads((dump / "hook_status.json").read_text())
                m["samples_recorded"] = len(store.read_manifest(dump))
        finally:
            server.stop()
        m["median_tok_s"] = statistics.median(m["tok_s"])
        log(f"{tag} {mode}: {m['median_tok_s']:.0f} tok/s {[round(x) for x in m['tok_s']]}")
        save()
    if not {"pristine", "off", "on", "pristine2"} <= set(res):
        save()
        return res
    p0 = statistics.median(res["pristine"]["tok_s"] + res["pristine2"]["tok_s"])
    off, on = res["off"]["median_tok_s"], res["on"]["median_tok_s"]
    res["pristine_median_both_runs"] = p0
    res["pristine_run_to_run"] = res["pristine2"]["median_tok_s"] / res["pristine"]["median_tok_s"]
    res["ratio_off"] = off / p0
    res["ratio_on"] = on / p0
    res["ratio_on_vs_off"] = on / off
    # cost per captured plane against one layer's compute, from the same medians
    t_tok_off, t_tok_on = 1 / off, 1 / on
    res["layers"] = n_layers
    res["planes_captured"] = planes
    res["capture_bytes_per_s_needed"] = off * planes * int(json.loads(Path(model_dir, "config.json").read_text())
                                                           ["hidden_size"]) * 2
    res["layer_time_per_token_s"] = t_tok_off / n_layers
    res["capture_time_per_plane_per_token_s"] = (t_tok_on - t_tok_off) / planes
    res["cost_per_captured_layer_vs_layer"] = res["capture_time_per_plane_per_token_s"] / res["layer_time_per_token_s"]
    save()
    return res


def copy_microbench(hidden: int, tokens: int = 8192, reps: int = 20) -> dict:
    """GPU-side cost of one captured plane (device clone + copy to pinned host on a side
    stream) for [tokens, hidden] bf16: the per-layer work the hook adds to the forward."""
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    host = torch.empty(tokens, hidden, dtype=torch.bfloat16, pin_memory=True)
    side = torch.cuda.Stream()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    clones, d2h = [], []
    for _ in range(reps):
        e0.record()
        c = x.clone()
        e1.record()
        e1.synchronize()
        clones.append(e0.elapsed_time(e1))
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            s0.record()
            host.copy_(c, non_blocking=True)
            s1.record()
        s1.synchronize()
        d2h.append(s0.elapsed_time(s1))
    nbytes = tokens * hidden * 2
    return {"tokens": tokens, "hidden": hidden, "clone_ms": statistics.median(clones),
            "d2h_ms_side_stream": statistics.median(d2h),
            "clone_GBps": nbytes / statistics.median(clones) / 1e6, "d2h_GBps": nbytes / statistics.median(d2h) / 1e6}


def projection(micro: dict) -> dict:
    """Kimi-K2.5: 61 layers, 4 captured + final, hidden 7168; per-token cost of a plane
    scales with hidden (bytes copied), a layer's compute with hidden x expert width."""
    kimi = {"layers": 61, "planes": 5, "hidden": 7168}
    per_plane_forward_ms = micro["clone_ms"]  # the only work on the compute stream
    tokens = micro["tokens"]
    return {
        **kimi,
        "clone_ms_per_plane_per_8192_tokens": per_plane_forward_ms,
        "hook_ms_per_pass": kimi["planes"] * per_plane_forward_ms,
        "d2h_ms_per_pass_overlapped": kimi["planes"] * micro["d2h_ms_side_stream"],
        "bytes_per_token": kimi["planes"] * kimi["hidden"] * 2,
        "note": (f"a Kimi-K2.5 prefill pass of {tokens} tokens runs 61 MoE layers (hidden 7168, 384 experts, "
                 "8 active) under TP=8; the hook adds 5 device clones of [tokens, 7168] bf16 to the compute "
                 "stream and 5 copies to pinned host memory on a side stream"),
    }


def model(a: argparse.Namespace, hidden: int, layers: int) -> str:
    from make_model import build

    model_dir = str(Path(a.work) / f"model-h{hidden}-l{layers}")
    if not Path(model_dir, "config.json").exists():
        t = time.time()
        build(model_dir, hidden=hidden, layers=layers)
        log(f"built {model_dir} in {time.time() - t:.0f}s")
    return model_dir


def main() -> int:
    global OUT, LOGS, T0
    T0 = time.time()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--site", required=True, help="the directory that contains sglang/ (patched in place)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-proof-out"), help="results directory")
    ap.add_argument("--work", default="/tmp/hs-proof", help="models and dumps (dumps under /dev/shm are fine)")
    ap.add_argument("--phases", default="fidelity,throughput,micro")
    ap.add_argument("--hidden", default="1024", help="comma-separated hidden sizes to run, e.g. 1024,7168")
    ap.add_argument("--layers", type=int, default=4, help="model depth for the fidelity run")
    ap.add_argument("--tp-layers", type=int, default=61, help="model depth for the throughput runs (Kimi: 61)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--modes", default="pristine,off,on,pristine2", help="throughput runs, in order")
    ap.add_argument("--chunk", type=int, default=8192, help="chunked prefill size for the throughput runs")
    ap.add_argument("--envelope-factor", type=float, default=4.0)
    ap.add_argument("--port", type=int, default=30123)
    a = ap.parse_args()
    OUT = Path(a.out)
    OUT.mkdir(parents=True, exist_ok=True)
    LOGS = Path(a.work) / "logs"
    LOGS.mkdir(parents=True, exist_ok=True)
    phases = a.phases.split(",")
    rc = 0
    try:
        import sglang

        RESULTS["env"] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                          "sglang": getattr(sglang, "__version__", "?"), "python": sys.version.split()[0]}
        RESULTS["patch_apply"] = hs_patch_cli("apply", "--site", a.site)
        RESULTS["patch_verify"] = hs_patch_cli("verify", "--site", a.site)
        assert RESULTS["patch_verify"]["exit_code"] == 0, RESULTS["patch_verify"]
        log("patched:", RESULTS["patch_apply"]["message"])
        save()
        for h in [int(x) for x in a.hidden.split(",")]:
            tag = f"h{h}"
            if "throughput" in phases:
                throughput(a, model(a, h, a.tp_layers), f"{tag}_l{a.tp_layers}")
            if "fidelity" in phases:
                model_dir = model(a, h, a.layers)
                f = fidelity(a, model_dir, tag)
                log(f"{tag} fidelity: envelope ok={f['all_within_envelope']} rhs identical="
                    f"{f['return_hidden_states_identical']} lm_head {f['lm_head_match']}")
            if "micro" in phases:
                RESULTS[f"micro_{tag}"] = copy_microbench(h)
                save()
        if "micro" in phases:
            RESULTS["micro_h7168"] = RESULTS.get("micro_h7168") or copy_microbench(7168)
            RESULTS["projection_kimi"] = projection(RESULTS["micro_h7168"])
    except Exception:
        RESULTS["error"] = traceback.format_exc()
        log("FAILED\n" + RESULTS["error"])
        rc = 1
    finally:
        hs_patch_cli("apply", "--site", a.site)  # leave the install patched
        save()
    summary(RESULTS)
    return rc


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
        if k.startswith("throughput_") and "ratio_on" in f:
            print(f"\n{k}: {f['prompts']} x {f['tokens']} tokens, {f['reps']} reps (median tok/s)")
            for m in ("pristine", "off", "on", "pristine2"):
                print(f"  {m:10}{f[m]['median_tok_s']:12.0f}  {[round(x) for x in f[m]['tok_s']]}")
            print(f"  capture off / pristine = {f['ratio_off']:.3f}   capture on / pristine = {f['ratio_on']:.3f}"
                  f"   on / off = {f['ratio_on_vs_off']:.3f}   (pristine run-to-run {f['pristine_run_to_run']:.3f})")
            print(f"  capture data rate needed at the capture-off speed: {f['capture_bytes_per_s_needed'] / 1e9:.2f} GB/s;"
                  f" hook waits: {f['on'].get('hook_status', {}).get('waits')}")
            print(f"  cost per captured layer = {f['cost_per_captured_layer_vs_layer']:.3f} of one layer's compute")
        if k.startswith("micro_"):
            print(f"\n{k}: clone {f['clone_ms']:.3f} ms ({f['clone_GBps']:.0f} GB/s), "
                  f"D2H {f['d2h_ms_side_stream']:.3f} ms ({f['d2h_GBps']:.0f} GB/s) for {f['tokens']}x{f['hidden']} bf16")
    if "error" in r:
        print("\nERROR:", r["error"].splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
