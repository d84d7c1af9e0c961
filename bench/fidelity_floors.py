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

    python3 bench/fidelity_floors.py                       # hidden 7168, chunks of 1, 8, 64 and 512 rows
    python3 bench/fidelity_floors.py --hidden 1024 --update 0.01
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
from hs_patch.server import fingerprint  # noqa: E402


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
    pred = rms_norm(plane, torch.ones(h.shape[1], dtype=h.dtype), 1e-6)
    rec, _ = relations.judge(relations.standardised(pred, fp[:, 5]), [0] * rows, 1)
    out["norm"] = rec["ratio"]
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
    a = p.parse_args()
    out = []
    for rows in (int(x) for x in a.rows.split(",")):
        h, upd, mid = states(rows, a.hidden, a.update, a.seed)
        clean = ratios(h, h, upd, mid, rows)
        row = {"rows": rows, "clean_ratio": clean}
        for kind in ("scale", "partial", "other"):
            for relation in ("additive", "norm"):
                row[f"{kind}/{relation}"] = floor(kind, relation, h, upd, mid, rows, a.update)
        out.append(row)
        print(json.dumps(row), flush=True)
    print("| rows in the chunk | clean chi2/bound (additive, norm) | " + " | ".join(
        f"{k} ({r})" for k in ("scale", "partial", "other") for r in ("additive", "norm")) + " |")
    for row in out:
        cells = " | ".join(f"{row[f'{k}/{r}']:.2e}" for k in ("scale", "partial", "other") for r in ("additive", "norm"))
        print(f"| {row['rows']} | {row['clean_ratio']['additive']:.3f}, {row['clean_ratio']['norm']:.3f} | {cells} |")


if __name__ == "__main__":
    main()
