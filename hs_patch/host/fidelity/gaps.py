"""The server's logit gaps at a sample's last positions against ours, from the stored final state.

The same-pass top-1 ties a sample's final state to its request at the positions it checks, but
a chat sample's last tokens are fixed by its template: another request's states give the same
top-1 there (issue #33). The gap between the server's two best logits is a continuous quantity
of the state itself, template-decided or not: SGLang returns both best tokens' logprobs at
every position from ``logprob_start_len`` on (``top_logprobs_num`` 2), and their difference
is the difference of their logits (the log-sum-exp cancels). Here it is recomputed from the
stored post-norm state with only those two rows of the LM head (2 dot products a position,
nothing like the full-vocabulary argmax), and must agree within what rounding explains:

- the server's logits are the model dtype's (bf16: SGLang's LM head matmul rounds its fp32
  accumulation once), so each logit is off by at most half a unit in its last place;
- the two fp32 accumulations (the GPU's, ours) differ by a few units of 2^-24 of the terms'
  root-sum-square times sqrt(H) (:data:`ACCUMULATION_UNITS`);
- a post-norm state derived here from ``final.pre_norm`` rounds otherwise than the server's fused
  norm: :func:`hs_patch.host.fidelity.check.rounding_allowance`.

A right state agrees at every position; another request's states, a shifted or scaled final
state disagree at nearly every one (a scale changes every gap in proportion).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_GAP_POSITIONS = 16   # last positions of every sample whose server logit gaps are compared
ACCUMULATION_UNITS = 8.0     # fp32 accumulation of an H-term dot product, two ways: this many x sqrt(H) x 2^-24
ROUNDING_MARGIN = 2.0        # the two half units are a tight bound (a right sample's worst gap reached 0.96 of it
                             # on the stand-in): twice them, for a GEMM that rounds its partial sums too


@dataclass
class Gap:
    pos: int
    tokens: tuple[int, int]   # the server's best two
    server: float             # its logprob difference
    ours: float               # our logit difference
    tolerance: float

    @property
    def ok(self) -> bool:
        return abs(self.server - self.ours) <= self.tolerance  # a NaN is never within


def half_ulp(x: float, dtype: "torch.dtype") -> float:
    """Half a unit in the last place of ``dtype`` at |x| (what rounding to it moves x by at most)."""
    import torch

    return math.ldexp(torch.finfo(dtype).eps, math.frexp(abs(x))[1] - 2) if x else 0.0


def compare_gaps(states: "torch.Tensor", head: "torch.Tensor", positions: Sequence[int],
                 top: dict[int, list[tuple[float, int]]], logit_dtype: "torch.dtype",
                 derived: Optional[Callable[["torch.Tensor", int, int], float]] = None) -> list[Gap]:
    """Every position of ``positions`` (rows of ``states``, post-norm [N, H]) with the server's best two:
    their gap against ours; ``derived(state, a, b)``: what a derived state's rounding may move our gap."""
    out = []
    for i, pos in enumerate(positions):
        best = top.get(pos) or []
        if len(best) < 2:
            continue
        (lp1, t1), (lp2, t2) = best[0], best[1]
        x = states[i].float()
        w1, w2 = head[t1].float(), head[t2].float()
        l1, l2 = float(w1 @ x), float(w2 @ x)
        acc = ACCUMULATION_UNITS * math.sqrt(x.numel()) * 2.0 ** -24 * \
            (float((w1 * x).norm()) + float((w2 * x).norm())) * 2
        tol = ROUNDING_MARGIN * (half_ulp(l1, logit_dtype) + half_ulp(l2, logit_dtype)) + acc
        if derived is not None:
            tol += derived(states[i], t1, t2)
        out.append(Gap(pos, (t1, t2), lp1 - lp2, l1 - l2, tol))
    return out
