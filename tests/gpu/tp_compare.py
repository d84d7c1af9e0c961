"""GPU proof phase ``tp``: capture at TP=N equals capture at TP=1, written once, by rank 0 only.

The same model is served twice, one server after the other (each takes its GPUs): at
TP=1 and at TP=N (``--tp-size N``). Each captures every layer and both final states
of the same prompts, sent at once (batched prefill), two of them longer than the
chunked-prefill size (chunked), each with ``return_logprob`` from position 0. Then:

- planes: for every sample and plane, the relative error of the TP=N state against the
  TP=1 state, beside the bf16 envelope on the same prompt (transformers in bf16 against
  fp32 on the same weights); a plane passes when its largest error is within
  FACTOR x the largest envelope. The measured ratio is the envelope of TP's different
  summation order (row-parallel matmuls, all-reduce), recorded for the next run;
- same pass, top-1: the production fidelity check (``FidelityChecker``, the shipped
  near-tie tolerance) of every TP=N sample at every position against the TP=N server's
  own top-1 from the same pass;
- one file per sample: the TP=N manifest holds each prompt once, as many sample files as
  entries, every sample's metadata ``tp_size`` N and ``tp_rank`` 0;
- rank 0 only: the TP=N server log shows one ``hs_patch: capturing`` line, for rank 0 of
  N, and one ``does not write`` line for each of the other N-1 ranks (``hook.attach``
  logs both: a rank that does not write returns before making a hook, so it allocates
  nothing and opens no file).

Run: python3 tests/gpu/proof.py --site SITE --out "$OUT" --phases tp --tp-size 2 [--preset kimi-layer]
(NCCL_NVLS_ENABLE=0 as the machine notes ask; tests/gpu/test_gpu_scripts.py rehearses it on CPU.)
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from common import REC, Server, hs_patch_cli, wait_for_samples
from hs_patch.host.fidelity.check import DEFAULT_TIE_TOLERANCE, FidelityChecker, LMHead
from hs_patch.samples import reader, store
from production import generate_with_logprobs

CAPTURING = re.compile(r"hs_patch: capturing layers .* \(rank (\d+) of (\d+)\)")
SILENT = re.compile(r"hs_patch: rank (\d+) of (\d+) does not write")


def _serve(a: argparse.Namespace, model_dir: str, tp: int, prompts: list[list[int]], chunk: int,
           layers: list[int], tag: str) -> dict:
    """One capturing server at TP=tp: its answers, its dump dir and what its log says about the ranks."""
    dump = Path(a.dump_root) / f"dump-tp{tp}-{tag}"
    shutil.rmtree(dump, ignore_errors=True)
    server = Server(f"tp{tp}-{tag}", model_dir, a.port, chunk,
                    {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), "HS_CAPTURE_LAYERS": ",".join(map(str, layers)),
                     "HS_CAPTURE_FINAL": "both"}, [], tp_size=tp, mem_fraction=a.mem_fraction)
    try:
        server.wait_ready()
        with ThreadPoolExecutor(len(prompts)) as pool:  # at once: batched prefill
            outs = list(pool.map(lambda x: generate_with_logprobs(server, x[1], f"tp{tp}-{x[0]}"), enumerate(prompts)))
        lag = wait_for_samples(dump, {store.sample_key(p) for p in prompts})
    finally:
        server.stop()
    text = server.log_path.read_text(errors="replace")
    return {"dump": dump, "outs": outs, "writer_lag_s": round(lag, 3), "start_s": server.start_s,
            "capturing": [(int(r), int(n)) for r, n in CAPTURING.findall(text)],
            "silent": sorted(int(r) for r, _ in SILENT.findall(text))}


def _envelope(model_dir: str, prompts: list[list[int]], layers: list[int]) -> list[dict[str, float]]:
    """Per prompt and plane: rel. error of transformers in bf16 against fp32 (the bf16 envelope)."""
    from lab.hf_reference import reference
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        refs = []
        for ids in prompts:
            r = reference(m, ids)
            refs.append({**{store.layer_plane(i): r.layer_in[i].float().cpu() for i in layers},
                         "final.pre_norm": r.pre_norm.float().cpu(), "final.post_norm": r.post_norm.float().cpu()})
        out.append(refs)
        del m
        if device == "cuda":
            torch.cuda.empty_cache()
    return [{p: _rel(r16[p], r32[p]) for p in r32} for r32, r16 in zip(*out)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def tp_compare(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    res: dict = {"model": model_dir, "tp_size": a.tp_size}
    REC.data[f"tp_{tag}"] = res
    st = hs_patch_cli("apply", "--site", a.site)
    assert st["exit_code"] == 0 and st["state"] == "patched", st
    chunk = a.tp_chunk
    rng = random.Random(13)
    lengths = [int(x) for x in a.tp_lengths.split(",")]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    layers = list(range(a.layers))
    res.update(lengths=lengths, chunked_prefill_size=chunk, layers=layers)
    runs = {tp: _serve(a, model_dir, tp, prompts, chunk, layers, tag) for tp in (1, a.tp_size)}
    REC.save()
    one, many = runs[1], runs[a.tp_size]
    e1, en = store.read_manifest(one["dump"]), store.read_manifest(many["dump"])
    keys = [store.sample_key(p) for p in prompts]

    # one file per sample, each written by rank 0 of N
    files = sorted(many["dump"].rglob("*.safetensors"))
    ours = [k for k in en if k in set(keys)]
    metas = [reader.read_sample(many["dump"] / en[k]["file"], entry=en[k]).metadata for k in keys]
    res["files"] = {"manifest_entries": len(en), "sample_files": len(files), "prompts": len(prompts),
                    "prompts_in_manifest": len(ours),
                    "inspect_clean": reader.check_dir(many["dump"]).clean,
                    "metadata_tp": sorted({(m.get("tp_size"), m.get("tp_rank")) for m in metas})}
    res["files"]["ok"] = (len(ours) == len(prompts) and len(files) == len(en) and res["files"]["inspect_clean"]
                          and res["files"]["metadata_tp"] == [(str(a.tp_size), "0")])
    res["ranks"] = {"capturing": many["capturing"], "silent": many["silent"],
                    "ok": many["capturing"] == [(0, a.tp_size)] and many["silent"] == list(range(1, a.tp_size))}

    # every plane, TP=N against TP=1, beside the bf16 envelope
    env = _envelope(model_dir, prompts, layers)
    planes = [store.layer_plane(i) for i in layers] + ["final.pre_norm", "final.post_norm"]
    table = []
    for p in planes:
        errs, envs = [], []
        for k, e in zip(keys, env):
            s1 = reader.read_sample(one["dump"] / e1[k]["file"], entry=e1[k])
            sn = reader.read_sample(many["dump"] / en[k]["file"], entry=en[k])
            errs.append(_rel(sn.plane(p), s1.plane(p)))
            envs.append(e[p])
        table.append({"plane": p, "rel_tpN_vs_tp1_max": max(errs), "rel_tpN_vs_tp1_mean": statistics.fmean(errs),
                      "bf16_envelope_max": max(envs), "ratio_to_envelope": max(errs) / max(max(envs), 1e-30),
                      "ok": max(errs) <= a.envelope_factor * max(envs)})
    res["planes"] = table
    res["planes_ok"] = all(t["ok"] for t in table)

    # the production fidelity check at TP=N, every position of every sample
    head = LMHead.from_model_dir(model_dir)
    checker = FidelityChecker(head, Path(a.work) / f"fidelity-tp-{tag}", tie_tolerance=DEFAULT_TIE_TOLERANCE,
                              positions=max(lengths))
    try:
        checks = [checker.check(k, many["dump"] / en[k]["file"], out) for k, out in zip(keys, many["outs"])]
    finally:
        checker.close()
    res["top1"] = {"positions": sum(c.checked for c in checks), "mismatches": sum(c.mismatches for c in checks),
                   "near_ties": sum(c.ties for c in checks), "samples_failing": sum(c.mismatches > 0 for c in checks)}
    res["top1"]["ok"] = res["top1"]["mismatches"] == 0
    res["ok"] = res["files"]["ok"] and res["ranks"]["ok"] and res["planes_ok"] and res["top1"]["ok"]
    for r in runs.values():
        r.pop("outs")
        r["dump"] = str(r["dump"])
    res["runs"] = {str(tp): r for tp, r in runs.items()}
    REC.save()
    return res


def summarize_tp(tag: str, res: dict) -> None:
    REC.log(f"tp {tag}: TP={res['tp_size']} vs TP=1, ok={res['ok']}")
    REC.log(f"  files: {res['files']}")
    REC.log(f"  ranks: {res['ranks']}")
    REC.log(f"  top-1 at TP=N: {res['top1']}")
    for t in res["planes"]:
        REC.log(f"  {t['plane']:16s} max rel {t['rel_tpN_vs_tp1_max']:.3g} (mean {t['rel_tpN_vs_tp1_mean']:.3g}),"
                f" bf16 envelope {t['bf16_envelope_max']:.3g}, ratio {t['ratio_to_envelope']:.3g}, ok={t['ok']}")
