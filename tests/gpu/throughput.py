"""Throughput part of the GPU proof: pristine vs patched-off vs patched-on, side by side.

The three servers run at the same time on the one GPU (each with its own fixed KV pool,
``--sleep-on-idle`` so an idle one takes no CPU), and every round sends the same prompts
to each in turn, in an order that rotates by round. Instance and run-order effects, which
were larger than any code difference when each mode was a fresh server in sequence, then
cancel; the ratios are computed within each round and their median reported.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from common import REC, Server, hs_patch_cli, pristine_copy, wait_for_samples

from hs_patch.samples import store

def parse_on(specs: list[str]) -> dict[str, dict[str, str]]:
    """``--on NAME[:KEY=VAL,...]`` -> {"on-NAME" or "on": extra HS_CAPTURE_* settings}."""
    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, _, env = spec.partition(":")
        pairs = dict(kv.split("=", 1) for kv in env.split(",") if kv)
        bad = [k for k in pairs if not k.startswith("HS_CAPTURE_")]
        if bad:
            raise SystemExit(f"--on {spec}: only HS_CAPTURE_* settings can vary, not {bad}")
        out["on" if name in ("", "on") else f"on-{name}"] = pairs
    return out


def throughput(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    n_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    layers = sorted({2, n_layers // 2, n_layers - 3, n_layers - 1} & set(range(n_layers)))  # Kimi: 2,30,58,60
    planes = len(layers) + 1  # + final.pre_norm
    kv_tokens = a.prompts * a.tokens + a.chunk  # the same KV pool for every server
    on = parse_on(a.on)
    modes = ["pristine", "off", *on]
    res: dict = {"model": model_dir, "config": {k: cfg[k] for k in ("num_attention_heads", "intermediate_size",
                 "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")},
                 "layers": n_layers, "hidden": hidden, "prompts": a.prompts,
                 "tokens": a.tokens, "rounds": a.reps, "chunked_prefill_size": a.chunk,
                 "capture_layers": layers, "planes_captured": planes, "modes": modes,
                 "max_total_tokens": kv_tokens, "order": [], **{m: {"tok_s": []} for m in modes}}
    REC.data[f"throughput_{tag}"] = res
    st = hs_patch_cli("apply", "--site", a.site)
    assert st["exit_code"] == 0 and st["state"] == "patched", st
    pristine = pristine_copy(a.site, Path(a.work) / "pristine-site")
    dumps = {m: Path(a.dump_root) / f"dump-tp-{tag}-{m}" for m in on}
    capture = {m: {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dumps[m]), "HS_CAPTURE_FINAL": "pre",
                   "HS_CAPTURE_LAYERS": ",".join(map(str, layers)), **env} for m, env in on.items()}
    for m in on:
        shutil.rmtree(dumps[m], ignore_errors=True)
        res[m]["capture_env"] = capture[m]
    extra = ["--sleep-on-idle", "--max-total-tokens", str(kv_tokens)]
    servers: dict[str, Server] = {}
    try:
        for i, mode in enumerate(modes):  # one at a time until its KV pool is sized
            servers[mode] = Server(f"tp-{tag}-{mode}", model_dir, a.port + 1 + i, a.chunk, capture.get(mode),
                                   extra, first_on_path=str(pristine) if mode == "pristine" else None,
                                   mem_fraction=a.mem_fraction, tp_size=a.tp_size)
            servers[mode].wait_memory()
        for mode, s in servers.items():
            s.wait_ready()
            res[mode].update(start_s=s.start_s, sglang_dir=s.sglang_dir,
                             deepseek_v2_state=hs_patch_cli("status", "--site", str(Path(s.sglang_dir).parent))["state"])
        states = [res[m]["deepseek_v2_state"] for m in modes]
        assert states == ["pristine"] + ["patched"] * (len(modes) - 1), states
        rng = random.Random(11)
        for rnd in range(a.reps + 1):  # round 0 warms up (and compiles kernels)
            order = modes[rnd % len(modes):] + modes[:rnd % len(modes)]
            prompts = [[rng.randrange(3, 512) for _ in range(a.tokens)] for _ in range(a.prompts)]
            speeds = {}
            for mode in order:
                s = servers[mode]
                t = time.perf_counter()
                with ThreadPoolExecutor(a.prompts) as pool:
                    list(pool.map(s.generate, prompts, [f"tp-{rnd}-{i}" for i in range(a.prompts)]))
                speeds[mode] = a.prompts * a.tokens / (time.perf_counter() - t)
                if mode in on:  # let the writer finish before the next server's turn
                    res[mode].setdefault("writer_lag_s", []).append(
                        round(wait_for_samples(dumps[mode], {store.sample_key(p) for p in prompts}), 3))
                    for f in dumps[mode].glob("*.safetensors"):  # keep /dev/shm small between rounds
                        f.unlink()
            if rnd:
                res["order"].append(list(order))
                for m in modes:
                    res[m]["tok_s"].append(speeds[m])
            REC.log(f"{tag} round {rnd} ({'warm-up, ' if not rnd else ''}order {','.join(order)}): "
                    + ", ".join(f"{m} {speeds[m]:.0f}" for m in modes) + " tok/s")
            REC.save()
        for m in on:
            res[m]["hook_status"] = json.loads((dumps[m] / "hook_status.json").read_text())
            res[m]["samples_recorded"] = len(store.read_manifest(dumps[m]))
    finally:
        for s in servers.values():
            s.stop()
    for m in modes:
        res[m]["median_tok_s"] = statistics.median(res[m]["tok_s"])

    def ratios(x: str, y: str) -> list[float]:
        return [u / v for u, v in zip(res[x]["tok_s"], res[y]["tok_s"])]

    per_round = {"off/pristine": ratios("off", "pristine")}
    for m in on:
        per_round[f"{m}/pristine"] = ratios(m, "pristine")
        per_round[f"{m}/off"] = ratios(m, "off")
    res["ratios_per_round"] = per_round
    res["ratios"] = {k: statistics.median(v) for k, v in per_round.items()}
    res["ratio_off"] = res["ratios"]["off/pristine"]
    first = next(iter(on))
    res["ratio_on"] = res["ratios"][f"{first}/pristine"]
    res["ratio_on_vs_off"] = res["ratios"][f"{first}/off"]
    # cost per captured plane against one layer's compute, from the same medians
    off = res["off"]["median_tok_s"]
    res["capture_bytes_per_s_needed"] = off * planes * hidden * 2
    res["layer_time_per_token_s"] = 1 / off / n_layers
    for m in on:
        per_plane = (1 / res[m]["median_tok_s"] - 1 / off) / planes
        res[m]["cost_per_captured_layer_vs_layer"] = per_plane / res["layer_time_per_token_s"]
    res["cost_per_captured_layer_vs_layer"] = res[first]["cost_per_captured_layer_vs_layer"]
    REC.save()
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
    return {
        **kimi,
        "clone_ms_per_plane_per_8192_tokens": micro["clone_ms"],  # the only work on the compute stream
        "hook_ms_per_pass": kimi["planes"] * micro["clone_ms"],
        "d2h_ms_per_pass_overlapped": kimi["planes"] * micro["d2h_ms_side_stream"],
        "bytes_per_token": kimi["planes"] * kimi["hidden"] * 2,
        "note": (f"a Kimi-K2.5 prefill pass of {micro['tokens']} tokens runs 61 MoE layers (hidden 7168, 384 "
                 "experts, 8 active) under TP=8; the hook adds 5 device clones of [tokens, 7168] bf16 to the "
                 "compute stream and 5 copies to pinned host memory on a side stream"),
    }


def summarize(k: str, f: dict) -> None:
    modes = f.get("modes", ["pristine", "off", "on"])
    print(f"\n{k}: {f['layers']} layers, hidden {f['hidden']}, {f['prompts']} x {f['tokens']} tokens, "
          f"{f['rounds']} rounds, {len(modes)} servers side by side (tok/s; ratios within each round, median)")
    for m in modes:
        env = f[m].get("capture_env")
        extra = {x: v for x, v in (env or {}).items() if x not in ("HS_CAPTURE", "HS_CAPTURE_DIR",
                                                                   "HS_CAPTURE_FINAL", "HS_CAPTURE_LAYERS")}
        print(f"  {m:12}{f[m]['median_tok_s']:12.0f}  {[round(x) for x in f[m]['tok_s']]}"
              + (f"  {extra or 'defaults'}, hook waits {f[m].get('hook_status', {}).get('waits')}" if env else ""))
    for name, xs in f["ratios_per_round"].items():
        print(f"  {name:16}{statistics.median(xs):7.3f}  rounds {[round(x, 3) for x in xs]}")
    print(f"  capture data rate needed at the capture-off speed: {f['capture_bytes_per_s_needed'] / 1e9:.2f} GB/s")
    print(f"  cost per captured layer = {f['cost_per_captured_layer_vs_layer']:.3f} of one layer's compute")
