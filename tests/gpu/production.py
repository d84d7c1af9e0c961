"""GPU proof phase ``production``: the production fidelity check on real SGLang, measured.

One capturing server (HS_CAPTURE_FINAL=both); prompts of several lengths sent at once
(batched prefill), two longer than the chunked-prefill size (chunked), each with
``return_logprob`` from position 0 and ``top_logprobs_num`` 2, exactly as the driver's
sampled fraction sends them. For every sample, ``hs_patch.host.fidelity.check.FidelityChecker``
(fp32 ``lm_head`` read by name from the model dir) against SGLang's own top-1 of the same
pass, with the tolerance set to 0 so EVERY disagreement is recorded with its margin:

- agreement per position and on the first generated token; the margins (in std of the
  row's logits) of all disagreements: their maximum is the near-tie tolerance to ship;
- the same check on states made wrong the ways a capture bug makes them (shifted one
  row, another layer's state, rows of other positions): mismatch rates and margins, to
  show the tolerance separates them;
- ``--derive-post-norm``'s gap: ``final.post_norm`` derived from ``final.pre_norm`` with the
  model's norm weight against the server's fused norm (max |diff|, share of bf16 values
  that differ, relative error, argmax agreement);
- the check's CPU cost for Kimi-K2.5's head (163,840 x 7,168 fp32) on this host, per batch.

Run: python3 tests/gpu/proof.py --site SITE --out "$OUT" --phases production [--layers 4]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

from common import REC, Server, start_phase, wait_for_samples
from hs_patch.host.fidelity.check import FidelityChecker, LMHead, compare
from hs_patch.host.model_files import head_and_norm, rms_norm
from hs_patch.samples import reader, store


def generate_with_logprobs(server: Server, ids: list[int], rid: str) -> dict:
    """One prompt with SGLang's top-2 at every position, as the driver's sampled fraction sends it."""
    body = {"input_ids": ids, "rid": rid, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    r = requests.post(server.url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def _wrong(s: reader.Sample, how: str) -> torch.Tensor:
    post = s.plane("final.post_norm")
    if how == "shift":
        return torch.cat([post[:1], post[:-1]])
    if how == "other_layer":
        last = max(int(x) for x in s.metadata["layers"].split(","))
        return s.plane(f"layer.{last}")
    return torch.roll(post, 17, dims=0)   # "misplaced"


def _margins(head: LMHead, states: torch.Tensor, server: list[int]) -> dict:
    logits = head.logits(states)
    diff = compare(logits, server, list(range(len(server))), tol=0.0)
    m = sorted(d.margin_std for d in diff)
    return {"positions": len(server), "disagree": len(diff), "margin_max": max(m) if m else None,
            "margin_median": statistics.median(m) if m else None,
            "above_0.02": sum(x > 0.02 for x in m)}


def production(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    res: dict = {"model": model_dir}
    dump = start_phase(a, "production", tag, res)
    chunk = 512
    lengths = [40, 2000, 300, 777, 128, 1500, 64, 1024]
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    layers = list(range(1, a.layers))
    res.update(lengths=lengths, chunked_prefill_size=chunk, layers=layers)
    server = Server(f"production-{tag}", model_dir, a.port, chunk,
                    {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), "HS_CAPTURE_LAYERS": ",".join(map(str, layers)),
                     "HS_CAPTURE_FINAL": "both"}, [], tp_size=a.tp_size, mem_fraction=a.mem_fraction)
    try:
        server.wait_ready()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda x: generate_with_logprobs(server, x[1], f"prod-{x[0]}"), enumerate(prompts)))
        res["writer_lag_s"] = round(wait_for_samples(dump, {store.sample_key(p) for p in prompts}), 3)
    finally:
        server.stop()
    REC.save()

    head = LMHead.from_model_dir(model_dir)
    _, norm_w, info = head_and_norm(model_dir)
    entries = store.read_manifest(dump)
    checker = FidelityChecker(head, Path(a.work) / f"fidelity-{tag}", tie_tolerance=0.0, positions=max(lengths))
    per, wrong, derive = [], {h: [] for h in ("shift", "other_layer", "misplaced")}, []
    t0 = time.time()
    try:
        for ids, out in zip(prompts, outs):
            key = store.sample_key(ids)
            path = dump / entries[key]["file"]
            r = checker.check(key, path, out)
            s = reader.read_sample(path, entry=entries[key])
            first = checker.check(key, path, {"output_ids": out["output_ids"], "meta_info": {}})
            per.append({"tokens": len(ids), "parts": r.parts, "positions": r.checked,
                        "disagree": len(r.details), "margins": [d.margin_std for d in r.details],
                        "first_token_match": first.mismatches == 0 and first.ties == 0})
            from hs_patch.host.driver.client import server_top1

            top = server_top1(out, len(ids), 0)
            server_tokens = [top[p] for p in range(len(ids))]
            for how in wrong:
                wrong[how].append(_margins(head, _wrong(s, how), server_tokens))
            pre, post = s.plane("final.pre_norm"), s.plane("final.post_norm")
            d = rms_norm(pre, norm_w, info.rms_norm_eps)
            agree = int((head.logits(d).argmax(-1) == head.logits(post).argmax(-1)).sum())
            derive.append({"max_abs": float((d.float() - post.float()).abs().max()),
                           "share_differing": float((d != post).float().mean()),
                           "rel_err": float((d.float() - post.float()).norm() / post.float().norm()),
                           "argmax_agree": f"{agree}/{len(ids)}"})
    finally:
        checker.close()
    check_s = time.time() - t0
    margins = sorted(m for p in per for m in p["margins"])
    total = sum(p["positions"] for p in per)
    res.update(per_sample=per, positions=total, agree=total - len(margins),
               first_token=f"{sum(p['first_token_match'] for p in per)}/{len(per)}",
               disagree_margin_max=max(margins) if margins else None,
               disagree_margin_p99=margins[int(0.99 * (len(margins) - 1))] if margins else None,
               wrong_states={h: {"disagree": sum(x["disagree"] for x in v), "positions": sum(x["positions"] for x in v),
                                 "above_0.02": sum(x["above_0.02"] for x in v)} for h, v in wrong.items()},
               derive_post_norm=derive, check_seconds_all=round(check_s, 2))
    res["kimi_head_cpu"] = _kimi_head_cost()
    REC.save()
    shutil.rmtree(dump, ignore_errors=True)
    return res


def _kimi_head_cost() -> dict:
    """Seconds of LMHead.logits on this host's CPU for Kimi-K2.5's head, 1 and 32 rows."""
    torch.manual_seed(0)
    head = LMHead(torch.randn(163840, 7168, dtype=torch.bfloat16), torch.ones(7168, dtype=torch.bfloat16), 1e-6)
    out = {"threads": torch.get_num_threads(), "fp32_head_gb": round(head.weight.numel() * 4 / 1e9, 2)}
    for rows in (1, 32):
        x = torch.randn(rows, 7168, dtype=torch.bfloat16)
        head.logits(x)
        t = time.time()
        for _ in range(3):
            head.logits(x)
        out[f"rows_{rows}_s"] = round((time.time() - t) / 3, 4)
    del head
    return out
