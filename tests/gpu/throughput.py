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

from hs_patch import store

MODES = ("pristine", "off", "on")


def throughput(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    n_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    layers = sorted({2, n_layers // 2, n_layers - 3, n_layers - 1} & set(range(n_layers)))  # Kimi: 2,30,58,60
    planes = len(layers) + 1  # + final.pre_norm
    kv_tokens = a.prompts * a.tokens + a.chunk  # the same KV pool for all three servers
    res: dict = {"model": model_dir, "config": {k: cfg[k] for k in ("num_attention_heads", "intermediate_size",
                 "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok")},
                 "layers": n_layers, "hidden": hidden, "prompts": a.prompts,
                 "tokens": a.tokens, "rounds": a.reps, "chunked_prefill_size": a.chunk,
                 "capture_layers": layers, "planes_captured": planes, "writers": a.writers,
                 "max_total_tokens": kv_tokens, "order": [], **{m: {"tok_s": []} for m in MODES}}
    REC.data[f"throughput_{tag}"] = res
    st = hs_patch_cli("apply", "--site", a.site)
    assert st["exit_code"] == 0 and st["state"] == "patched", st
    pristine = pristine_copy(a.site, Path(a.work) / "pristine-site")
    dump = Path(a.dump_root) / f"dump-tp-{tag}"
    shutil.rmtree(dump, ignore_errors=True)
    capture = {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), "HS_CAPTURE_LAYERS": ",".join(map(str, layers)),
               "HS_CAPTURE_FINAL": "pre", "HS_CAPTURE_WRITERS": str(a.writers)}
    extra = ["--sleep-on-idle", "--max-total-tokens", str(kv_tokens)]
    servers: dict[str, Server] = {}
    try:
        for i, mode in enumerate(MODES):  # one at a time until its KV pool is sized
            servers[mode] = Server(f"tp-{tag}-{mode}", model_dir, a.port + 1 + i, a.chunk,
                                   capture if mode == "on" else None, extra,
                                   first_on_path=str(pristine) if mode == "pristine" else None,
                                   mem_fraction=a.mem_fraction)
            servers[mode].wait_memory()
        for mode, s in servers.items():
            s.wait_ready()
            res[mode].update(start_s=s.start_s, sglang_dir=s.sglang_dir,
                             deepseek_v2_state=hs_patch_cli("status", "--site", str(Path(s.sglang_dir).parent))["state"])
        assert [res[m]["deepseek_v2_state"] for m in MODES] == ["pristine", "patched", "patched"], res
        rng = random.Random(11)
        for rnd in range(a.reps + 1):  # round 0 warms up (and compiles kernels)
            order = MODES[rnd % 3:] + MODES[:rnd % 3]
            prompts = [[rng.randrange(3, 512) for _ in range(a.tokens)] for _ in range(a.prompts)]
            speeds = {}
            for mode in order:
                s = servers[mode]
                t = time.perf_counter()
                with ThreadPoolExecutor(a.prompts) as pool:
                    list(pool.map(s.generate, prompts, [f"tp-{rnd}-{i}" for i in range(a.prompts)]))
                speeds[mode] = a.prompts * a.tokens / (time.perf_counter() - t)
                if mode == "on":  # let the writer finish before the next server's turn
                    res["on"].setdefault("writer_lag_s", []).append(
                        round(wait_for_samples(dump, {store.sample_key(p) for p in prompts}), 3))
                    for f in dump.glob("*.safetensors"):  # keep /dev/shm small between rounds
                        f.unlink()
            if rnd:
                res["order"].append(list(order))
                for m in MODES:
                    res[m]["tok_s"].append(speeds[m])
            REC.log(f"{tag} round {rnd} ({'warm-up, ' if not rnd else ''}order {','.join(order)}): "
                    + ", ".join(f"{m} {speeds[m]:.0f}" for m in MODES) + " tok/s")
            REC.save()
        res["on"]["hook_status"] = json.loads((dump / "hook_status.json").read_text())
        res["on"]["samples_recorded"] = len(store.read_manifest(dump))
    finally:
        for s in servers.values():
            s.stop()
    for m in MODES:
        res[m]["median_tok_s"] = statistics.median(res[m]["tok_s"])
    per_round = {
        "off/pristine": [o / p for o, p in zip(res["off"]["tok_s"], res["pristine"]["tok_s"])],
        "on/pristine": [o / p for o, p in zip(res["on"]["tok_s"], res["pristine"]["tok_s"])],
        "on/off": [o / p for o, p in zip(res["on"]["tok_s"], res["off"]["tok_s"])]}
    res["ratios_per_round"] = per_round
    res["ratio_off"] = statistics.median(per_round["off/pristine"])
    res["ratio_on"] = statistics.median(per_round["on/pristine"])
    res["ratio_on_vs_off"] = statistics.median(per_round["on/off"])
    # cost per captured plane against one layer's compute, from the same medians
    off, on = res["off"]["median_tok_s"], res["on"]["median_tok_s"]
    res["capture_bytes_per_s_needed"] = off * planes * hidden * 2
    res["layer_time_per_token_s"] = 1 / off / n_layers
    res["capture_time_per_plane_per_token_s"] = (1 / on - 1 / off) / planes
    res["cost_per_captured_layer_vs_layer"] = res["capture_time_per_plane_per_token_s"] / res["layer_time_per_token_s"]
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
    print(f"\n{k}: {f['layers']} layers, hidden {f['hidden']}, {f['prompts']} x {f['tokens']} tokens, "
          f"{f['rounds']} rounds, three servers side by side (tok/s; ratios within each round, median)")
    for m in MODES:
        print(f"  {m:10}{f[m]['median_tok_s']:12.0f}  {[round(x) for x in f[m]['tok_s']]}")
    for name, xs in f["ratios_per_round"].items():
        print(f"  {name:14}{statistics.median(xs):7.3f}  rounds {[round(x, 3) for x in xs]}")
    print(f"  capture data rate needed at the capture-off speed: {f['capture_bytes_per_s_needed'] / 1e9:.2f} GB/s;"
          f" hook waits: {f['on'].get('hook_status', {}).get('waits')}")
    print(f"  cost per captured layer = {f['cost_per_captured_layer_vs_layer']:.3f} of one layer's compute")
