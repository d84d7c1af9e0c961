"""The closed loop's table, from the packed per-conversation rows alone (conversations.jsonl.xz).

One row per arm and setting: the accept length (mean over seeds, each seed's too), SGLang's gauge,
the difference to ours with its paired 95% interval and the verdict (stats.py), the share of answers
at the ``max_new_tokens`` cap, acceptance by draft position, and how many outputs equal the plain
target's (by sha256 of the output ids). Runs on the CPU from the files a GPU call brings back:

    python3 tests/gpu/loop/table.py RESULTS_DIR/conversations.jsonl.xz [--state RESULTS_DIR/results.json]
"""

from __future__ import annotations

import argparse
import json
import lzma
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Optional

import numpy as np

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loop import stats  # noqa: E402

ROLE = {"ours": "ours: hs-extract drive + export --format specforge (SGLang 0.5.16, patched)",
        "specforge": "SpecForge's own prepare_hidden_states.py (SGLang 0.5.14, its pin), batch size 1",
        "shuffled": "control: every aux plane's rows shuffled across positions within each sample",
        "zeroed": "control: aux planes all zero",
        "late": "control: aux planes one layer late (our capture's layer.<i+1>)",
        "partial": "control: partial sum, layer.<i-1> + (layer.<i> - layer.<i-1>) / 2 (what one of two TP "
                   "ranks holds before the all-reduce)",
        "scaled": "control: one aux plane (the middle one) scaled by 2",
        "fp8": "ours captured with HS_CAPTURE_DTYPE=fp8 (quantized on the GPU), exported dequantized",
        "prenorm": "pre-norm final state as SpecForge's teacher (ours, final.pre_norm)",
        "untrained": "floor: SpecForge's initialisation, one step at lr 1e-12"}
ORDER = tuple(ROLE)
CONTROLS = ("shuffled", "zeroed", "late", "partial", "scaled")


def read_rows(path: Path) -> list[dict[str, Any]]:
    opener = lzma.open if str(path).endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def group(rows: list[dict[str, Any]]) -> dict[tuple[str, float], dict[str, dict[int, list[dict]]]]:
    """(setting, temperature) -> arm -> seed -> rows (plain rows apart, under arm 'plain'). Rows another check
    measured (``tag``: the greedy check serves ours-s0 again) are not the arm's, nor is a second row of the same
    arm, seed and prompt (files packed before the tag existed hold the greedy check's rows under ours-s0 after
    serve_main's: the first is kept)."""
    out: dict = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    seen = set()
    for r in rows:
        key = (r["setting"], float(r.get("temperature", 0.0)), r["arm"], int(r.get("seed", 0)), r.get("sample_id"))
        if r.get("tag") or key in seen:
            continue
        seen.add(key)
        out[key[:2]][r["arm"]][key[3]].append(r)
    return out


def _fmt(x: Optional[float], nd: int = 3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _ci(d: dict[str, Any]) -> str:
    if d.get("point") is None:
        return "-"
    return f"{d['point']:+.3f} [{d['low']:+.3f}, {d['high']:+.3f}]"


def render(rows: list[dict[str, Any]], *, margin: float = stats.MARGIN, replicates: int = stats.REPLICATES,
           anchor_setting: str = "3,1,4", notes: Optional[list[str]] = None) -> tuple[str, dict[str, Any]]:
    """(markdown, the numbers as JSON) for every (setting, temperature) in ``rows``."""
    lines, data = [], {}
    for (setting, temp), arms in sorted(group(rows).items(), key=lambda kv: (kv[0][1], kv[0][0] != anchor_setting,
                                                                            kv[0][0])):
        plain = {r["sample_id"]: r.get("output_sha256") for rs in arms.pop("plain", {}).values() for r in rs}
        built = {n: stats.arm_from_reports(n, seeds) for n, seeds in arms.items()}
        if "ours" not in built:
            continue
        prompts = stats.common_prompts(built.values())
        built = {n: stats.restrict(a, prompts) for n, a in built.items()}
        ours = built["ours"]
        key = f"{setting} T={temp:g}"
        data[key] = {"prompts": len(prompts), "arms": {}}
        lines += [f"### ({setting}), temperature {temp:g}: {len(prompts)} prompts, every arm on the same ones", "",
                  "| arm | seeds | accept length (per seed) | gauge | minus ours, 95% CI | drafters fixed | verdict | "
                  "at cap | accepted at position 1.. | = plain |", "|---|---|---|---|---|---|---|---|---|---|"]
        for name in sorted(built, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n)):
            arm = built[name]
            rs = [r for seed in arm.seeds for r in arms[name][seed] if r["sample_id"] in set(prompts)]
            cap = sum(1 for r in rs if r.get("finish") == "length") / max(1, len(rs))
            pos = _positions(rs)
            same = (sum(1 for r in rs if plain.get(r["sample_id"]) == r.get("output_sha256")), len(rs)) \
                if plain and temp == 0 else None
            row = {"seeds": arm.seeds, "accept_length": round(arm.value(), 4), "per_seed": arm.per_seed(),
                   "gauge": None if np.isnan(arm.corr).any() else round(arm.value("gauge"), 4),
                   "at_cap": round(cap, 4), "accepted_at": pos, "identical_to_plain": same}
            verdict = "-"
            if name != "ours":
                d = stats.paired_difference(ours, arm, replicates=replicates)
                row["minus_ours"] = d
                row["gauge_minus_ours"] = stats.paired_difference(ours, arm, "gauge", replicates=replicates)
                if name == "specforge":
                    verdict = stats.noninferiority(d, margin) if setting == anchor_setting and temp == 0 else "-"
                    verdict = f"ours {verdict} (margin {margin})" if verdict != "-" else verdict
                elif name == "fp8":
                    verdict = stats.noninferiority(d, margin, judged="other") \
                        if setting == anchor_setting and temp == 0 else "-"
                    verdict = f"fp8 {verdict} (margin {margin})" if verdict != "-" else verdict
                elif name in CONTROLS:
                    verdict = stats.control_verdict(d)
                row["verdict"] = verdict
            data[key]["arms"][name] = row
            lines.append(f"| {name} | {len(arm.seeds)} | {row['accept_length']:.3f} ("
                         + ", ".join(f"{x:.3f}" for x in row["per_seed"]) + f") | {_fmt(row['gauge'])} | "
                         f"{_ci(row.get('minus_ours', {})) if name != 'ours' else '-'} | "
                         f"{_fixed(row.get('minus_ours', {}))} | {verdict} | "
                         f"{cap:.1%} | {' '.join(f'{x:.2f}' for x in pos) if pos else '-'} | "
                         f"{f'{same[0]}/{same[1]}' if same else '-'} |")
        lines += _subsets(arms, built, prompts, replicates) + [""]
    if not data:
        return "no arm named ours was measured: nothing to compare\n", data
    lines += ["Intervals: paired bootstrap (stats.py), the same prompts resampled for both arms, seeds resampled "
              "jointly where both arms have seeds 0..k-1 (same initialisation and data order), "
              f"{replicates} replicates; an arm of one seed adds no seed variance of its own. 'Drafters fixed': "
              "the prompts-only interval, as if these trained drafters were the only ones (no retraining spread).",
              f"Verdicts fixed before the run: ours vs SpecForge's capture at ({anchor_setting}), temperature 0, is "
              f"non-inferior when the lower end of ours - specforge is above -{margin}, the fp8 arm when the lower "
              f"end of fp8 - ours is; a control is worse when its whole interval is below zero.", *(notes or [])]
    return "\n".join(lines) + "\n", data


def _fixed(d: dict[str, Any]) -> str:
    """The prompts-only interval: what the difference would be if these drafters were the only ones (no
    retraining spread). Outside zero while the full interval is not: the trained drafters differ on these
    prompts, and more seeds would tell whether that survives retraining."""
    lo_hi = d.get("prompts_only")
    return f"[{lo_hi[0]:+.3f}, {lo_hi[1]:+.3f}]" if lo_hi else "-"


def _positions(rows: list[dict[str, Any]]) -> list[float]:
    total: list[int] = []
    for r in rows:
        h = r.get("histogram") or []
        total += [0] * (len(h) - len(total))
        for k, n in enumerate(h):
            total[k] += n
    passes = sum(total)
    return [round(sum(total[j:]) / passes, 3) for j in range(1, len(total))] if passes else []


def _subsets(arms: dict, built: dict, prompts: list[str], replicates: int) -> list[str]:
    """ours vs specforge per prompt subset (held-out chats, HumanEval, MT-Bench)."""
    if "specforge" not in built:
        return []
    subset = {r["sample_id"]: r.get("subset", "-") for seeds in arms.values() for rs in seeds.values() for r in rs}
    out = ["", "| subset | prompts | ours | specforge | specforge minus ours, 95% CI |", "|---|---|---|---|---|"]
    for name in sorted({subset[p] for p in prompts}):
        ps = [p for p in prompts if subset[p] == name]
        a, o = stats.restrict(built["ours"], ps), stats.restrict(built["specforge"], ps)
        d = stats.paired_difference(a, o, replicates=replicates)
        out.append(f"| {name} | {len(ps)} | {a.value():.3f} | {o.value():.3f} | {_ci(d)} |")
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rows", type=Path, help="conversations.jsonl.xz (or .jsonl)")
    ap.add_argument("--margin", type=float, default=stats.MARGIN)
    ap.add_argument("--replicates", type=int, default=stats.REPLICATES)
    ap.add_argument("--json", type=Path, help="also write the numbers here")
    a = ap.parse_args(argv)
    text, data = render(read_rows(a.rows), margin=a.margin, replicates=a.replicates)
    print(text)
    if a.json:
        a.json.write_text(json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
