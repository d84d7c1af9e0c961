"""What ``hs-extract accept`` keeps of each answer and how it sums them up.

Per conversation, from SGLang's ``meta_info`` (names per release, all read):

- ``completion_tokens`` and ``spec_verify_ct`` (verification passes);
- the correct drafts (draft tokens the target accepted, the bonus token not counted):
  ``spec_num_correct_drafts`` (0.5.16 on; ``spec_accepted_drafts`` its alias) or
  ``spec_accept_token_num`` (0.5.9);
- the per-request histogram of correct drafts per verification pass (index k: the passes that
  accepted k drafts): ``spec_correct_drafts_histogram`` (0.5.16 on) or ``spec_accept_histogram``
  (0.5.9, and 0.5.16's alias);
- ``finish_reason`` (``stop``: the model ended its answer; ``length``: the ``max_new_tokens`` cap);
- a sha256 of the output token ids (the ids themselves with ``--output-ids``), so that two runs'
  outputs can be compared without keeping them.

Two accept lengths, both sums over exactly the measured requests:

- ``accept_length`` = Σ completion_tokens / Σ spec_verify_ct. It counts the first output token,
  which comes from the prefill pass, not from a verification: a drafter never right gives
  (1 + passes) / passes, slightly above 1. SGLang's per-request ``meta_info.spec_accept_length`` and
  SpecForge's ``benchmarks/bench_eagle3.py`` compute this one.
- ``accept_length_gauge`` = 1 + Σ correct drafts / Σ spec_verify_ct: tokens per verification pass
  (accepted drafts plus the bonus), without the prefill's token. SGLang's own gauge,
  ``avg_spec_accept_length`` of ``/server_info`` (scheduler ``spec_total_num_accept_tokens /
  spec_total_num_forward_ct``), computes this one, cumulatively since the server started; an
  untrained drafter gives exactly 1.0. It is ``None`` when a server reports no correct drafts.

The two differ by the prefill's token per request (about one over the passes of a request) and by
drafts accepted past a stop (counted by the gauge, cut from completion_tokens).

Acceptance by draft position (from the histograms): at position j (1 .. draft tokens - 1), the share
of verification passes that accepted at least j drafts, Σ_{k >= j} h[k] / Σ h; and the conditional
rate, accepted at j given accepted at j - 1.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Optional

CORRECT_KEYS = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
HISTOGRAM_KEYS = ("spec_correct_drafts_histogram", "spec_accept_histogram")


@dataclass
class Conversation:
    sample_id: str
    prompt_tokens: int
    completion_tokens: int = 0
    verify_ct: int = 0
    correct_drafts: Optional[int] = None
    histogram: list[int] = field(default_factory=list)
    finish: str = ""
    accept_length: Optional[float] = None
    output_sha256: str = ""
    output_ids: list[int] = field(default_factory=list)
    error: str = ""
    greedy: dict[str, Any] = field(default_factory=dict)
    unreachable: bool = False   # the server did not answer at all (not in the report)


def output_digest(ids: list[int]) -> str:
    """sha256 of the ids as comma-separated decimals (the same for any tool that writes them that way)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def read_answer(c: Conversation, out: dict[str, Any]) -> None:
    """Fill ``c`` from one ``/generate`` answer."""
    meta = out.get("meta_info") or {}
    c.output_ids = [int(t) for t in out.get("output_ids") or []]
    c.output_sha256 = output_digest(c.output_ids)
    c.completion_tokens = int(meta.get("completion_tokens") or len(c.output_ids))
    c.verify_ct = int(meta.get("spec_verify_ct") or 0)
    c.accept_length = round(c.completion_tokens / c.verify_ct, 4) if c.verify_ct else None
    hist = next((meta[k] for k in HISTOGRAM_KEYS if meta.get(k)), None)
    c.histogram = [int(x) for x in hist] if hist else []
    correct = next((meta[k] for k in CORRECT_KEYS if meta.get(k) is not None), None)
    if correct is None and c.histogram:
        correct = sum(k * n for k, n in enumerate(c.histogram))
    c.correct_drafts = int(correct) if correct is not None else None
    fin = meta.get("finish_reason")
    c.finish = str(fin.get("type", "")) if isinstance(fin, dict) else str(fin or "")
    if not c.verify_ct and c.completion_tokens > 1:
        # SGLang leaves spec_verify_ct out only when no verify pass ran (one token, from the prefill)
        c.error = (f"{c.completion_tokens} tokens without spec_verify_ct: not an EAGLE-3 answer (its tokens would "
                   "count with no verify pass and inflate the accept length)")
    elif c.histogram and sum(c.histogram) != c.verify_ct:
        c.error = (f"the server's correct-drafts histogram counts {sum(c.histogram)} verification passes, "
                   f"spec_verify_ct {c.verify_ct}: its metrics do not add up")


def by_position(histograms: list[list[int]], chain: Optional[int]) -> Optional[dict[str, Any]]:
    """Acceptance at each draft position from per-request histograms (None without any)."""
    total: list[int] = []
    for h in histograms:
        total += [0] * (len(h) - len(total))
        for k, n in enumerate(h):
            total[k] += n
    passes = sum(total)
    if not passes:
        return None
    positions = max(chain or 0, len(total) - 1)
    at_least = [sum(total[j:]) for j in range(positions + 1)]  # at_least[j]: passes with >= j correct drafts
    return {"passes": passes, "histogram": total,
            "accepted_at": [round(at_least[j] / passes, 5) for j in range(1, positions + 1)],
            "accepted_given_previous": [round(at_least[j] / at_least[j - 1], 5) if at_least[j - 1] else None
                                        for j in range(1, positions + 1)]}


def summarize(convs: list[Conversation], settings: dict[str, Any], rejects: list[dict], plain: bool,
              seconds: float) -> dict[str, Any]:
    ok = [c for c in convs if not c.error]
    comp, ver = sum(c.completion_tokens for c in ok), sum(c.verify_ct for c in ok)
    correct = [c.correct_drafts for c in ok]
    gauge = round(1 + sum(correct) / ver, 4) if ver and ok and None not in correct else None  # type: ignore[arg-type]
    s: dict[str, Any] = {"server_settings": settings, "conversations": len(convs), "measured": len(ok),
                         "failed": len(convs) - len(ok), "rejected_lines": len(rejects),
                         "completion_tokens": comp, "verify_ct": ver,
                         "accept_length": round(comp / ver, 4) if ver else None,
                         "accept_length_gauge": gauge,
                         "correct_drafts": sum(correct) if gauge is not None else None,  # type: ignore[arg-type]
                         "finish": _count(c.finish or "none" for c in ok),
                         "at_cap": sum(1 for c in ok if c.finish == "length"),
                         "seconds": round(seconds, 1)}
    chain = settings.get("speculative_num_draft_tokens")
    s["by_position"] = by_position([c.histogram for c in ok], chain - 1 if isinstance(chain, int) else None)
    if len(ok) < len(convs):
        s["first_error"] = next(c.error for c in convs if c.error)
    per = sorted(c.accept_length for c in ok if c.accept_length is not None)
    if per:
        s["per_conversation"] = {"min": per[0], "median": per[len(per) // 2], "max": per[-1]}
    if plain:
        g = [c.greedy for c in ok]
        diff = [x for x in g if x.get("identical") is False]
        s["greedy"] = {"compared": len([x for x in g if "identical" in x]), "identical": sum(1 for x in g if x.get(
            "identical")), "differing": len(diff), "near_tie": sum(1 for x in diff if x.get("near_tie")),
            "mismatch": sum(1 for x in diff if not x.get("near_tie")), "errors": sum(1 for x in g if "error" in x)}
        if s["greedy"]["errors"]:
            s["greedy"]["first_error"] = next(x["error"] for x in g if "error" in x)
    return s


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))
