#!/usr/bin/env python3
"""The smallest wrong state each relation of the fidelity check rejects, measured on the CPU.

Rows of a residual stream ``h`` (bf16, hidden --hidden, heavy-tailed like a real model's: a few
dimensions 30x the rest) and a layer's update ``a`` of --update times h's size are added the way SGLang's
fused add does (fp32, one bf16 rounding); their fingerprints are made with the hook's own functions
(:mod:`hs_patch.server.fingerprint`), and the stored plane is made wrong by a relative error:

- ``scale``: the plane times (1 + eps);
- ``partial``: the plane lacks eps / update of the layer's update (a rank's partial sum: eps relative to h);
- ``other``: another prompt's row mixed in at eps (the direction changes).

Each is judged by the check's own code (:mod:`hs_patch.host.fidelity.relations`): the additive relation
from the fingerprints alone, and the norm relation on the rows read (input norm weight of ones), per chunk
of --rows rows. Printed: the smallest eps (relative error of the plane's rows, |e|/|h|) rejected, by
bisection over 12 steps, for each relation, kind and chunk size; and the clean rows' chi-square over its
bound (the room a right sample has). Seeded: the same numbers every run.

``--fp8`` (HS_CAPTURE_DTYPE=fp8, issue #35): the wrong plane is stored as the hook stores it, fp8 with a
scale a row (:func:`hs_patch.server.fp8.quantize`), and read back dequantized; its fingerprint is still the
one taken before quantization, so the additive relation is the bf16 one; the norm relation reads the
dequantized rows with the fp8 allowance (:func:`relations.quantized_allowance`); and ``stored``: the rows
read against the plane's own fingerprint within the fp8 envelope (the row checks' bound for fp8 rows: a
plane quantized wrong, e.g. with a wrong scale), the fingerprint being of the right plane here.

    python3 bench/fidelity_floors.py                       # hidden 7168, chunks of 1, 8, 64 and 512 rows
    python3 bench/fidelity_floors.py --hidden 1024 --update 0.01
    python3 bench/fidelity_floors.py --fp8
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hs_patch.host.fidelity import relations  # noqa: E402
from hs_patch.host.model_files import rms_norm  # noqa: E402
from hs_patch.server import fingerprint, fp8  # noqa: E402

FP8 = False  # --fp8: the plane stored as fp8 with a scale a row, read dequantized


def stored(plane: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plane as it is read back: itself (bf16), or quantized to fp8 and dequantized (with its scales)."""
    if not FP8:
        return plane, torch.ones(plane.shape[0])
    q, s = torch.empty(plane.shape, dtype=torch.float8_e4m3fn), torch.empty(plane.shape[0])
    fp8.quantize(plane, torch.empty_like(plane), q, s)
    return fp8.dequantize(q, s), s


def states(rows: int, hidden: int, update: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale = torch.ones(hidden)
    scale[torch.randperm(hidden, generator=g)[:8]] = 30.0  # massive activations in a few dimensions
    h = (torch.randn(rows, hidden, generator=g) * scale).to(torch.bfloat16)
    a = (torch.randn(rows, hidden, generator=g) * scale * update).to(torch.bfloat16)
    mid = (h.float() + a.float()).to(torch.bfloat16)
    return h, a, mid


def wrong(kind: str, h: torch.Tensor, a: torch.Tensor, eps: float, update: float) -> torch.Tensor:
    if kind == "scale":
        return (h.float() * (1 + eps)).to(torch.bfloat16)
    if kind == "partial":  # lacks a share of an update the size of a (the previous layer's)
        return (h.float() - a.float() * (eps / update)).to(torch.bfloat16)
    other, _, _ = states(h.shape[0], h.shape[1], update, seed=7)  # another prompt's rows, the same statistics
    return (h.float() * (1 - eps) + other.float() * eps).to(torch.bfloat16)


def ratios(plane: torch.Tensor, h: torch.Tensor, a: torch.Tensor, mid: torch.Tensor, rows: int) -> dict[str, float]:
    """chi-square / bound of one chunk of ``rows`` rows, per relation."""
    streams = ["layer.1", "attn_out.1", "attn_out_sq.1", "mid.1", "mid_sq.1", "attn_in.1"]
    fp = torch.stack([fingerprint.block_sums(plane), fingerprint.block_sums(a), fingerprint.block_squares(a),
                      fingerprint.block_sums(mid), fingerprint.block_squares(mid),
                      fingerprint.block_sums(rms_norm(h, torch.ones(h.shape[1], dtype=h.dtype), 1e-6))], 1)
    out = {}
    z2 = relations.additive(fp, streams, 1, 1, h.shape[1])
    rec, _ = relations.judge(z2, [0] * rows, 1)
    out["additive"] = rec["ratio"]
    read, scale = stored(plane)
    ones = torch.ones(h.shape[1], dtype=h.dtype)
    pred = rms_norm(read, ones, 1e-6)
    allow = relations.quantized_allowance(pred, read, scale, ones, 1e-6) if FP8 else None
    rec, _ = relations.judge(relations.standardised(pred, fp[:, 5], allow), [0] * rows, 1)
    out["norm"] = rec["ratio"]
    if FP8:  # the rows read against the RIGHT plane's fingerprint, within the envelope (a bound: max ratio)
        deq = read.float()
        l1 = deq.abs().unflatten(-1, (fingerprint.BLOCKS, -1)).sum(-1)
        tol = fp8.block_tolerance(l1, scale, h.shape[1] // fingerprint.BLOCKS) + 1e-4 * l1
        out["stored"] = float(((fingerprint.block_sums(deq) - fingerprint.block_sums(h)).abs() / tol).max())
    return out


def floor(kind: str, relation: str, h, a, mid, rows: int, update: float) -> float:
    lo, hi = 0.0, 1.0
    if ratios(wrong(kind, h, a, hi, update), h, a, mid, rows)[relation] <= 1:
        return math.inf
    for _ in range(12):
        m = math.sqrt(lo * hi) if lo > 0 else hi / 64
        if ratios(wrong(kind, h, a, m, update), h, a, mid, rows)[relation] > 1:
            hi = m
        else:
            lo = m
    return hi


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--update", type=float, default=0.05, help="the layer's update, relative to h (default 0.05)")
    p.add_argument("--rows", default="1,8,64,512", help="chunk sizes (rows judged together)")
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--fp8", action="store_true", help="the plane stored as fp8 with a scale a row (see above)")
    a = p.parse_args()
    global FP8
    FP8 = a.fp8
    checks = ("additive", "norm", "stored") if FP8 else ("additive", "norm")
    out = []
    for rows in (int(x) for x in a.rows.split(",")):
        h, upd, mid = states(rows, a.hidden, a.update, a.seed)
        clean = ratios(h, h, upd, mid, rows)
        row = {"rows": rows, "clean_ratio": clean}
        for kind in ("scale", "partial", "other"):
            for relation in checks:
                row[f"{kind}/{relation}"] = floor(kind, relation, h, upd, mid, rows, a.update)
        out.append(row)
        print(json.dumps(row), flush=True)
    print(f"| rows in the chunk | clean ratio ({', '.join(checks)}) | " + " | ".join(
        f"{k} ({r})" for k in ("scale", "partial", "other") for r in checks) + " |")
    for row in out:
        cells = " | ".join(f"{row[f'{k}/{r}']:.2e}" for k in ("scale", "partial", "other") for r in checks)
        clean = ", ".join(f"{row['clean_ratio'][r]:.3f}" for r in checks)
        print(f"| {row['rows']} | {clean} | {cells} |")


if __name__ == "__main__":
    main()
