"""The closed loop's table: one row per drafter, accept length per serving setting, the teacher's
argmax agreement with ours, the greedy check and what training printed."""

from __future__ import annotations

import argparse
from typing import Any

ORDER = ("ours", "specforge", "hf", "late", "prenorm", "untrained")
WHAT = {"ours": "ours: hs-extract drive + export --format specforge (SGLang 0.5.16, patched)",
        "specforge": "SpecForge's own prepare_hidden_states.py (SGLang 0.5.14, its pin), batch size 1",
        "hf": "transformers (bf16) on the same weights and token ids",
        "late": "mistake: aux planes one layer late (transformers states, layer.<i+1>)",
        "prenorm": "mistake: pre-norm final state as SpecForge's teacher (ours, final.pre_norm)",
        "untrained": "floor: SpecForge's initialisation, one step at lr 1e-12"}


def _fmt(x: Any, nd: int = 3) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def render(state: dict, a: argparse.Namespace) -> str:
    done = state.get("done", {})
    runs = done.get("serve", {}).get("runs", {})
    agree = done.get("drafters", {}).get("agreement", {})
    settings = a.settings.split(";")
    names = sorted({k.split("@")[0] for k in runs}, key=lambda n: (ORDER.index(n.split("-s")[0]), n))
    head = "| drafter | " + " | ".join(f"accept length ({s})" for s in settings) + \
        " | greedy = plain (near-ties) | teacher argmax vs ours | aux cosine vs ours |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for n in names:
        cells = []
        greedy = []
        for s in settings:
            r = runs.get(f"{n}@{s}", {})
            cells.append(_fmt(r.get("accept_length")))
            g = r.get("greedy") or {}
            if g:
                greedy.append(f"{g.get('identical')}/{g.get('compared')} ({g.get('near_tie')})")
        ag = agree.get(n.split("-s")[0], {}) if not n.startswith("ours") else {"teacher_argmax_agreement": 1.0,
                                                                                 "aux_cosine_mean": 1.0}
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {'; '.join(greedy) or '-'} | "
                     f"{_fmt(ag.get('teacher_argmax_agreement'), 4)} | {_fmt(ag.get('aux_cosine_mean'), 4)} |")
    ours = [runs.get(f"{n}@{settings[0]}", {}).get("accept_length") for n in names if n.startswith("ours")]
    ours = [x for x in ours if x is not None]
    kinds = {n.split("-s")[0] for n in names}
    notes = ["", *(f"- {k}: {v}" for k, v in WHAT.items() if k in kinds)]  # the rows this run has
    if len(ours) > 1:
        notes.append(f"- run-to-run spread of ours at {settings[0]}: {min(ours):.3f}-{max(ours):.3f} "
                     f"({len(ours)} seeds)")
    t = done.get("target", {})
    notes.append(f"- target: {t.get('params')} parameters, {t.get('steps')} steps, {t.get('tokens')} tokens, "
                 f"final loss {t.get('final_loss')}")
    return "\n".join(lines + notes) + "\n"
