"""The loop's fp8 arm (issue #35): the same drafter chats captured again by a server with
``HS_CAPTURE_DTYPE=fp8`` (quantized on the GPU, the production fidelity check on), exported to
SpecForge's layout (dequantized), trained with ours' seeds and data order, served like every arm; the
table judges it against ours (bf16) with the same margin.

Beside the accept length the phase records what the fp8 samples cost and lose, from the two runs'
samples paired by key (the same token ids):

- bytes per token of each run's sample files (the planes, the scales, the check rows, the header);
- per plane, the fp8 run's dequantized rows against the bf16 run's: relative error (Frobenius, per row)
  and cosine. The two runs are two server runs (other batches): this is quantization plus the engine's
  run-to-run difference, so the same numbers are given for the bf16 rows quantized here on the GPU
  (quantization alone), per token (what the capture does) and per block of 128 along the hidden
  dimension (DeepSeek's own fp8 layout), to say what finer scales would buy.
"""

from __future__ import annotations

import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from common import Server
from loop import features

QBLOCK = 128


def quant_error(x: "Any", block: int | None = None) -> "Any":
    """``x`` [T, H] (bf16) quantized to e4m3 with a scale a row (``block`` None) or a block of ``block``
    columns, and dequantized: returns the dequantized rows (fp32)."""
    import torch

    from hs_patch.server.fp8 import FP8_MAX, MIN_SCALE

    xf = x.float()
    if block:
        t, h = xf.shape
        xb = xf.reshape(t, h // block, block)
        s = xb.abs().amax(-1, keepdim=True).div(FP8_MAX).clamp(min=MIN_SCALE)
        return (xb / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().mul(s).reshape(t, h)
    s = xf.abs().amax(-1, keepdim=True).div(FP8_MAX).clamp(min=MIN_SCALE)
    return (xf / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().mul(s)


def _row_stats(ref: "Any", got: "Any") -> dict[str, list[float]]:
    import torch

    ref, got = ref.float(), got.float()
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
    return {"rel": rel.tolist(), "cos": cos.tolist()}


def _summary(v: dict[str, list[float]]) -> dict[str, Any]:
    rel, cos = sorted(v["rel"]), sorted(v["cos"])
    if not rel:
        return {}
    return {"rows": len(rel), "rel_median": round(statistics.median(rel), 6),
            "rel_p99": round(rel[min(len(rel) - 1, int(0.99 * len(rel)))], 6), "rel_max": round(rel[-1], 6),
            "cos_mean": round(statistics.fmean(cos), 7), "cos_min": round(cos[0], 7)}


def compare(bf16_dir: Path, fp8_dir: Path, limit: int, device: str) -> dict[str, Any]:
    """Per plane: the fp8 run's rows against the bf16 run's, and the bf16 rows quantized here (per token,
    per block of 128), over at most ``limit`` samples paired by key (every row of each)."""
    from hs_patch.samples.reader import manifest_entries, read_sample

    a, _ = manifest_entries(bf16_dir)
    b, _ = manifest_entries(fp8_dir)
    keys = sorted(set(a or {}) & set(b or {}))[:limit]
    acc: dict[str, dict[str, dict[str, list[float]]]] = {}
    for k in keys:
        x = read_sample(bf16_dir / a[k]["file"], entry=a[k])
        y = read_sample(fp8_dir / b[k]["file"], entry=b[k])
        if not y.fp8:
            raise RuntimeError(f"{y.path}: not an fp8 sample: the server did not take HS_CAPTURE_DTYPE=fp8")
        for plane in sorted(set(x.planes) & set(y.planes)):
            ref = x.plane(plane).to(device)
            rows = {"fp8_run": y.plane(plane).to(device), "quant_token": quant_error(ref)}
            if ref.shape[-1] % QBLOCK == 0:
                rows["quant_block128"] = quant_error(ref, QBLOCK)
            for kind, got in rows.items():
                s = _row_stats(ref, got)
                d = acc.setdefault(plane, {}).setdefault(kind, {"rel": [], "cos": []})
                d["rel"] += s["rel"]
                d["cos"] += s["cos"]
    return {"paired_samples": len(keys), "bf16_samples": len(a or {}), "fp8_samples": len(b or {}),
            "planes": {p: {k: _summary(v) for k, v in kinds.items()} for p, kinds in acc.items()}}


def bytes_per_token(samples: Path) -> dict[str, Any]:
    """Every listed sample file's bytes over its tokens (the count from each file's header)."""
    from safetensors import safe_open

    from hs_patch.samples.reader import manifest_entries

    entries, _ = manifest_entries(samples)
    nbytes = tokens = 0
    for e in (entries or {}).values():
        with safe_open(str(samples / e["file"]), "pt") as f:
            tokens += int((f.metadata() or {})["num_tokens"])
        nbytes += int(e["bytes"])
    return {"samples": len(entries or {}), "tokens": tokens, "bytes": nbytes,
            "bytes_per_token": round(nbytes / tokens, 1) if tokens else None}


class Fp8Arm:
    """The ``fp8`` phase (a mixin of loop.steps.Steps: self.a, self.work, self.train, self.drive, ...)."""

    def fp8(self) -> dict:
        ext = self.state["done"]["extract"]
        self.start_specforge_capture(required=False)   # beside this capture, when it has not started yet
        cap, samples = self.shm / "loop-capture-fp8", self.shm / "loop-samples-fp8"
        for d in (cap, samples, self.work / "drive-state-fp8"):
            shutil.rmtree(d, ignore_errors=True)
        # trainings and SpecForge's capture already hold GPU memory: a fraction of what is free at start,
        # the KV pool bounded by tokens (SGLang budgets from the memory free when it starts)
        server = Server("capture-fp8", str(self.target), self.a.port + 2, 4096, {
            "HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(cap), "HS_CAPTURE_DTYPE": "fp8",
            "HS_CAPTURE_LAYERS": ",".join(map(str, ext["capture_layers"]))},
            ["--context-length", "4096", "--max-total-tokens", "131072"], mem_fraction=0.9)
        res: dict[str, Any] = {"capture_layers": ext["capture_layers"]}
        try:
            server.wait_ready()
            res["server_start_s"] = server.start_s
            res["drive"] = self.drive(server, cap, samples, self.work / "drive-state-fp8", "loop-fp8")
        finally:
            server.stop()
        feat = self.work / "feat" / "fp8"
        res["export"] = self.export_features(samples, feat)
        res["features"] = features.summary(feat)
        t = time.time()
        res["bytes"] = {"bf16": bytes_per_token(self.shm / "loop-samples"), "fp8": bytes_per_token(samples)}
        res["error"] = compare(self.shm / "loop-samples", samples, self.a.fp8_compare, self.a.device)
        res["compare_s"] = round(time.time() - t, 1)
        linked = self.ordered("fp8", feat, by_name=True)
        for s in range(self.a.seeds):
            self.train(f"fp8-s{s}", linked, s)
        res["order"] = self.state["order"]["fp8"]
        return res
