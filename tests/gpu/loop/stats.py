"""The closed loop's statistics: paired intervals, the non-inferiority verdict, the controls'.

What is measured: for each arm (a feature pipeline or a control), seed (one trained drafter) and
setting, ``hs-extract accept``'s per-conversation counts on the SAME prompts. An arm's accept length
is the mean over its seeds of each drafter's Σ completion_tokens / Σ verify passes (the gauge:
1 + Σ correct drafts / Σ verify passes).

Every difference is against ours (``other - ours``), with a 95% interval that has two parts:

- the prompts: a paired bootstrap, prompts resampled with replacement, the same draw for both arms
  (the two arms answered the same prompts, so what makes a prompt easy for both cancels); its
  variance ``V_p``, and its own percentile interval (``prompts_only``: the interval if the drafters
  were fixed);
- the training: the run-to-run spread of drafters. Where both arms have the same seeds (seed k of
  each arm shares the initialisation and the data order), ``V_s`` = var_k(d_k) / S of the per-seed
  differences d_k; otherwise the arms' seed variances, pooled over the arms that have two seeds or
  more, times (1/S_ours + 1/S_other) (an arm of one seed is assumed to vary as much as ours).

The interval is ``point ± t(df) x sqrt(V_p + V_s)``, df by Welch-Satterthwaite (prompts P - 1,
seeds their degrees of freedom): with three seeds the seed part has two degrees of freedom, which
widens the interval as much as three seeds deserve. (A bootstrap over three seeds would take ten
distinct values and cover too rarely: tests/gpu/test_loop_stats.py measures the coverage.) When no
arm has two seeds, the training part is not estimated: the interval covers the prompts only and
says so (``seed_variance: null``).

Verdicts, fixed before any run:

- ours vs SpecForge's own capture at (3,1,4): **non-inferior** when the interval's lower end of
  ``ours - specforge`` is above ``-MARGIN`` (0.05), **inferior** when its upper end is below it,
  **inconclusive** otherwise (a two-sided 95% interval: a one-sided test at 2.5%);
- the fp8 arm (issue #35) vs ours (bf16 samples) at (3,1,4): the same rule on ``fp8 - ours``;
- a control: **worse** when its whole interval is below zero, **not worse** otherwise (a finding to
  explain, never to hide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import numpy as np

MARGIN = 0.05
LEVEL = 0.95
REPLICATES = 10000


@dataclass
class Arm:
    """One arm's per-conversation counts: ``comp[s, p]`` completion tokens, ``ver[s, p]`` verify passes,
    ``corr[s, p]`` correct drafts (NaN where not reported), for seeds ``seeds`` and prompts ``prompts``."""

    name: str
    seeds: list[int]
    prompts: list[str]
    comp: np.ndarray
    ver: np.ndarray
    corr: np.ndarray

    def counts(self, metric: str) -> tuple[np.ndarray, np.ndarray]:
        """(numerator, denominator) per seed and prompt for ``accept_length`` or ``gauge``."""
        if metric == "accept_length":
            return self.comp, self.ver
        if metric == "gauge":
            return self.ver + self.corr, self.ver
        raise ValueError(f"unknown metric {metric!r}")

    def value(self, metric: str = "accept_length") -> float:
        num, den = self.counts(metric)
        return float(np.mean(num.sum(1) / den.sum(1)))

    def per_seed(self, metric: str = "accept_length") -> list[float]:
        num, den = self.counts(metric)
        return [round(float(x), 4) for x in num.sum(1) / den.sum(1)]


def arm_from_reports(name: str, reports: dict[int, list[dict[str, Any]]], prompts: Optional[list[str]] = None) -> Arm:
    """An arm from ``{seed: by_conversation}`` (hs-extract accept's ``--out`` rows), on ``prompts`` (default:
    the sample ids measured without error in every seed, in the first seed's order)."""
    ok = {s: {c["sample_id"]: c for c in rows if not c.get("error") and c.get("verify_ct")}
          for s, rows in reports.items()}
    seeds = sorted(ok)
    if prompts is None:
        first = [c["sample_id"] for c in reports[seeds[0]]]
        prompts = [p for p in first if all(p in ok[s] for s in seeds)]
    missing = {s: [p for p in prompts if p not in ok[s]] for s in seeds}
    if any(missing.values()):
        raise ValueError(f"{name}: prompts not measured: " + "; ".join(
            f"seed {s}: {len(m)} ({m[:3]}...)" for s, m in missing.items() if m))

    def grid(key: str) -> np.ndarray:
        return np.array([[np.nan if ok[s][p].get(key) is None else float(ok[s][p][key]) for p in prompts]
                         for s in seeds], dtype=np.float64)

    return Arm(name, seeds, list(prompts), grid("completion_tokens"), grid("verify_ct"), grid("correct_drafts"))


def common_prompts(arms: Iterable[Arm]) -> list[str]:
    arms = list(arms)
    have = set(arms[0].prompts).intersection(*(a.prompts for a in arms[1:]))
    return [p for p in arms[0].prompts if p in have]


def restrict(arm: Arm, prompts: list[str]) -> Arm:
    idx = [arm.prompts.index(p) for p in prompts] if prompts != arm.prompts else list(range(len(prompts)))
    return Arm(arm.name, arm.seeds, list(prompts), arm.comp[:, idx], arm.ver[:, idx], arm.corr[:, idx])


def _seed_part(ra: np.ndarray, ro: np.ndarray, joint: bool) -> tuple[Optional[float], int]:
    """(V_s, its degrees of freedom) from per-seed values of ours and the other arm (module docstring)."""
    if joint and len(ra) >= 2:
        return float(np.var(ro - ra, ddof=1) / len(ra)), len(ra) - 1
    pools = [(np.var(x, ddof=1), len(x) - 1) for x in (ra, ro) if len(x) >= 2]
    df = sum(d for _, d in pools)
    if not df:
        return None, 0
    pooled = sum(v * d for v, d in pools) / df
    return float(pooled * (1 / len(ra) + 1 / len(ro))), df


def paired_difference(ours: Arm, other: Arm, metric: str = "accept_length", replicates: int = REPLICATES,
                      seed: int = 0, level: float = LEVEL) -> dict[str, Any]:
    """``other - ours`` with its interval (module docstring), over the prompts both arms have."""
    from scipy.stats import t as student

    prompts = common_prompts([ours, other])
    if not prompts:
        raise ValueError(f"{ours.name} and {other.name} share no measured prompt")
    a, o = restrict(ours, prompts), restrict(other, prompts)
    na, da = a.counts(metric)
    no, do = o.counts(metric)
    if np.isnan(na).any() or np.isnan(no).any():
        return {"metric": metric, "point": None, "why": "a server reported no correct drafts"}
    ra, ro = na.sum(1) / da.sum(1), no.sum(1) / do.sum(1)     # per seed
    point = float(ro.mean() - ra.mean())
    rng = np.random.default_rng(seed)
    p = len(prompts)
    # prompt weights: how often each prompt is drawn in each replicate (multinomial = resampling with replacement)
    w = rng.multinomial(p, np.full(p, 1.0 / p), size=replicates).astype(np.float64)   # [B, P]
    boot = ((w @ no.T) / (w @ do.T)).mean(1) - ((w @ na.T) / (w @ da.T)).mean(1)     # [B]
    v_p = float(np.var(boot, ddof=1))
    joint = a.seeds == o.seeds
    v_s, df_s = _seed_part(ra, ro, joint)
    var = v_p + (v_s or 0.0)
    df = var ** 2 / (v_p ** 2 / (p - 1) + (v_s ** 2 / df_s if v_s else 0.0)) if var > 0 and p > 1 else float(p)
    half = float(student.ppf(1 - (1 - level) / 2, df) * np.sqrt(var)) if var > 0 else 0.0
    lo, hi = np.quantile(boot, [(1 - level) / 2, 1 - (1 - level) / 2])
    return {"metric": metric, "point": round(point, 4), "low": round(point - half, 4), "high": round(point + half, 4),
            "level": level, "prompts": p, "replicates": replicates, "df": round(df, 1),
            "prompt_sd": round(float(np.sqrt(v_p)), 5), "seed_sd": None if v_s is None else round(float(np.sqrt(v_s)), 5),
            "prompts_only": [round(float(lo), 4), round(float(hi), 4)],
            "seeds": {"ours": a.seeds, other.name: o.seeds, "paired_by_seed": joint,
                      "seed_variance": None if v_s is None else "paired" if joint and len(ra) >= 2 else "pooled"}}


def noninferiority(diff: dict[str, Any], margin: float = MARGIN, *, judged: str = "ours") -> str:
    """The verdict on ``ours - other`` given ``diff`` = other - ours (so ours - other's low = -high); with
    ``judged="other"`` the verdict on ``other - ours`` (the fp8 arm judged against ours, bf16)."""
    if diff.get("point") is None:
        return "not measured"
    low, high = (-diff["high"], -diff["low"]) if judged == "ours" else (diff["low"], diff["high"])
    if low > -margin:
        return "non-inferior"
    if high < -margin:
        return "inferior"
    return "inconclusive"


def control_verdict(diff: dict[str, Any]) -> str:
    if diff.get("point") is None:
        return "not measured"
    return "worse" if diff["high"] < 0 else "NOT worse"
