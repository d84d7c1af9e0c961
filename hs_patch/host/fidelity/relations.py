"""The relations a right sample's planes satisfy within rounding, each judged chunk by chunk.

A relation compares block sums (:mod:`hs_patch.server.fingerprint`) predicted here with block
sums the capture hook took on the GPU, in units of what rounding alone can move them
(``sigma``, per block). Each standardised difference is sub-Gaussian with variance proxy <= 1
for a right sample, so the sum of their squares over N block sums stays under the chi-square
tail bound N + 2 sqrt(N t) + 2t (Laurent-Massart) but with probability e^-t. Every relation is
judged in every chunk of the prompt's prefill on its own, never pooled over the prompt (issue
#33: a wrong state in one chunk of a long prompt was diluted by the right chunks): with C
chunks each gets t = ln(C / FALSE_FAILURE), so a right sample still fails a relation with
probability < FALSE_FAILURE, and a wrong chunk is judged by its own rows only, as surely as
a one-chunk prompt of that length (less ln C in t).

Relations (the row checks, :mod:`hs_patch.host.fidelity.rows`, run them):

- ``layer.<i>`` normalised with layer i's input norm weight is what layer i's attention read
  (norm relation, on the rows read: scale-invariant, see :func:`allowance`);
- the additive relation, on every row from the fingerprints alone (:func:`additive`):
  ``layer.<i> + attn_out.<i> = mid.<i>`` within the rounding of the addition and of the
  all-reduce that summed the ranks' shares (bounded from the fingerprinted squares). It is not
  scale-invariant: it rejects a scaled plane, a rank's partial sum and the neighbouring layer
  down to bf16's own resolution (docs/verification.md gives the floors measured);
- the final norm: ``final.pre_norm`` through it is the LM head's input.
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING, Any, Optional, Sequence

from hs_patch.server import fingerprint, fp8

if TYPE_CHECKING:  # pragma: no cover
    import torch

FALSE_FAILURE = 1e-12             # the chance that rounding alone fails one relation of a right sample
FP32_ULPS = 2                     # fp32 elements: another formula of the same norm (x * rsqrt(ms) * w against
                                  # x * w / sqrt(ms)) rounds each differently by up to about this many units
SCALE_UNITS = 4                   # a row's scale: its mean square summed in another fp32 order is off by
                                  # about sqrt(H) units of 2^-24; this many times that is allowed
BF16_HALF_ULP = 2.0 ** -8         # a bf16 value rounds by at most half a unit: <= 2^-8 of its magnitude
FP32_SUM = 2.0 ** -24             # an fp32 block sum of n elements errs by <= log2(n) units of this times the
                                  # sum of magnitudes (<= sqrt(n) x the root-sum-square): 1/200 of the bf16 terms


def chi2_bound(n: int, t: float) -> float:
    return n + 2 * math.sqrt(n * t) + 2 * t


def chunk_of(rows: Sequence[int], starts: Sequence[int]) -> list[int]:
    """The chunk (index into ``starts``) each row lies in."""
    return [bisect.bisect_right(starts, r) - 1 for r in rows]


def judge(z2: "torch.Tensor", chunks: Sequence[int], nchunks: int) -> tuple[dict[str, Any], list[tuple[int, float, int, float]]]:
    """Squared standardised differences [rows, blocks] and each row's chunk: the record of the relation
    (its worst chunk) and every chunk that fails, as (chunk, chi-square, n, bound). Non-finite fails."""
    import torch

    t = math.log(max(1, nchunks) / FALSE_FAILURE)
    idx = torch.tensor(list(chunks), dtype=torch.int64)
    per_row = z2.sum(-1)
    sums = torch.zeros(max(1, nchunks), dtype=per_row.dtype).index_add_(0, idx, per_row)
    counts = torch.zeros(max(1, nchunks), dtype=torch.int64).index_add_(0, idx, torch.ones_like(idx))
    blocks = z2.shape[-1] if z2.dim() > 1 else 1
    failed, worst = [], None
    for j in range(nchunks):
        n = int(counts[j]) * blocks
        if not n:
            continue
        chi2 = float(sums[j])
        chi2 = chi2 if math.isfinite(chi2) else math.inf  # a NaN anywhere: the chunk fails
        bound = chi2_bound(n, t)
        ratio = chi2 / bound
        if worst is None or not ratio <= worst[0]:
            worst = (ratio, j, chi2, n, bound)
        if not chi2 <= bound:
            failed.append((j, chi2, n, bound))
    record: dict[str, Any] = {"n": int(counts.sum()) * blocks, "chunks": nchunks}
    if worst is not None:
        record.update(worst_chunk=worst[1], chi2=round(worst[2], 3), bound=round(worst[4], 3),
                      ratio=round(worst[0], 6))
    return record, failed


def describe_failures(what: str, meaning: str, failed: list[tuple[int, float, int, float]], starts: Sequence[int],
                      n: int) -> str:
    """One problem line for a relation that failed in some chunks."""
    j, chi2, m, bound = max(failed, key=lambda f: f[1] / f[3] if math.isfinite(f[1]) else math.inf)
    end = starts[j + 1] if j + 1 < len(starts) else n
    where = "" if len(starts) == 1 else f" in {len(failed)} of {len(starts)} chunks (e.g. chunk {j}, rows {starts[j]}..{end - 1})"
    return (f"{what}: {meaning}{where} (chi-square {chi2:.3g} over {m} block sums, a right sample stays under "
            f"{bound:.3g})")


# ----------------------------------------------------------------------------- the norm relations


def ulp(x: "torch.Tensor") -> "torch.Tensor":
    """One unit in the last place of each element of ``x`` (in its dtype), as fp32."""
    import torch

    if x.dtype == torch.bfloat16:  # 2^(exponent - 7): the exponent bits alone, read as a number, times 2^-7
        return (x.view(torch.int16) & 0x7F80).view(torch.bfloat16).float() * 2.0 ** -7
    xf = x.float()
    return torch.ldexp(torch.full_like(xf, torch.finfo(x.dtype).eps), torch.frexp(xf).exponent - 1)


def allowance(predicted: "torch.Tensor") -> "torch.Tensor":
    """How far rounding alone may move each block sum of ``predicted`` [rows, H] (one standard unit, fp32
    [rows, BLOCKS]), the server having computed the same rows its own way:

    - each element by one unit in the last place of its dtype (bf16: SGLang's fused norm rounds from the
      unrounded fp32 sum, ours from the stored residual), and by at least FP32_ULPS units of fp32 (an
      fp32 model, where the formula's own rounding is what differs: bf16 and fp16 units are larger);
    - the whole row by one common factor (its mean square summed in another order), which moves each
      block sum by that factor: SCALE_UNITS x sqrt(H) x 2^-24 of the block sum. Negligible next to the
      bf16 units; in fp32 it and the floor above are what let a right sample of a chunked prompt pass
      (16 blocks and more a relation, where one fp32 unit alone gave 1.6 per block against a bound that
      tends to 1: review of 2026-12-05); a 1% change of the rows' direction still exceeds the bound by
      orders of magnitude."""
    import torch

    elem = torch.maximum(ulp(predicted), predicted.float().abs() * (FP32_ULPS * 2.0 ** -24))
    var = elem.pow(2).unflatten(-1, (fingerprint.BLOCKS, -1)).sum(-1)
    scale = SCALE_UNITS * math.sqrt(predicted.shape[-1]) * 2.0 ** -24 * fingerprint.block_sums(predicted).abs()
    return (var + scale.pow(2)).sqrt()


def standardised(predicted: "torch.Tensor", stream: "torch.Tensor",
                 allow: Optional["torch.Tensor"] = None) -> "torch.Tensor":
    """(block sums of ``predicted`` - the stream's) / allowance (``allow``, default :func:`allowance`), squared:
    [rows, BLOCKS]."""
    got = fingerprint.block_sums(predicted)
    allow = allowance(predicted) if allow is None else allow
    return ((got - stream) / allow.clamp_min(1e-30)).pow(2)


def quantized_allowance(predicted: "torch.Tensor", stored: "torch.Tensor", scale: "torch.Tensor",
                        weight: "torch.Tensor", eps: float) -> "torch.Tensor":
    """:func:`allowance` of ``predicted`` = RMSNorm(``stored``, ``weight``) widened by what fp8 storage explains,
    for an fp8 sample's rows read dequantized (``stored``, bf16 [rows, H], with their ``scale`` [rows]) while the
    stream is of the rows before quantization (:mod:`hs_patch.server.fp8`):

    - each stored element x^ errs from the engine's x by at most b = (R / (1 - R) + 2^-8) |x^| + 2 x 2^-9 s
      (R = 2^-4 + 2^-9)
      (e4m3's rounding, bounded from the stored value, plus the dequantized value's rounding to bf16); through
      the norm each predicted element by b |w| / rms(x^): these independent, bounded, round-to-nearest errors
      add to a block sum's variance proxy like the bf16 units do;
    - the row's rms moves with them, one common factor r on the whole row, bounded by
      sqrt(sum (x^ b)^2) / sum x^2 (the cross term, independent errors) + sum b^2 / (2 sum x^2) (the squares'
      bias): r times each block sum (a scale the norm relation is blind to anyway; the additive relation,
      from the fingerprints taken before quantization, still sees a scaled plane at bf16's resolution)."""
    import torch

    x = stored.float()
    rel = fp8.REL_ERROR / (1 - fp8.REL_ERROR)
    b = (rel + BF16_HALF_ULP) * x.abs() + 2 * fp8.ABS_ERROR * scale.float().reshape(-1, 1)
    inv = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    elem = b * weight.float().abs() * inv
    var = elem.pow(2).unflatten(-1, (fingerprint.BLOCKS, -1)).sum(-1)
    sx2 = x.pow(2).sum(-1, keepdim=True).clamp_min(1e-30)
    r = (x * b).pow(2).sum(-1, keepdim=True).sqrt() / sx2 + b.pow(2).sum(-1, keepdim=True) / (2 * sx2)
    common = r * fingerprint.block_sums(predicted).abs()
    return (allowance(predicted).pow(2) + var + common.pow(2)).sqrt()


# ----------------------------------------------------------------------------- the additive relation


def additive(fp: "torch.Tensor", streams: Sequence[str], layer: int, tp_size: int,
             hidden: int) -> Optional["torch.Tensor"]:
    """The additive relation of captured ``layer`` on every row: z^2 [L, BLOCKS] of
    ``layer.<i> + attn_out.<i> - mid.<i>`` over what rounding can make it (None: the sample has no such
    streams, written before issue #33).

    The residual after the attention, ``mid = bf16(layer + attn)``, rounds each element by at most half a
    unit, <= 2^-8 |mid_e|; the all-reduce that summed the ranks' shares of ``attn`` in bf16 rounds each
    of its tp_size - 1 partial sums s_k by at most 2^-8 |s_k|, with sum_k s_k^2 <= (tp-1) tp sum_r a_r^2
    (Cauchy-Schwarz), and ``attn_out_sq`` is sum_r a_r^2 summed over the ranks; each element's rounding is
    independent, so the block's error is sub-Gaussian with variance proxy
    2^-16 (sum mid^2 + (tp-1) tp sum_r a_r^2) (+ the fp32 sums' own error). A right sample's terms are
    uniform within those bounds: its chi-square sits at about a twelfth of the bound's N."""
    names = {kind: fingerprint.layer_stream(kind, layer) for kind in fingerprint.ADDITIVE}
    plane = f"layer.{layer}"
    if plane not in streams or not all(v in streams for v in names.values()):
        return None
    k = {kind: streams.index(name) for kind, name in names.items()}
    s, a, m = fp[:, streams.index(plane)], fp[:, k["attn_out"]], fp[:, k["mid"]]
    e_mid, e_attn = fp[:, k["mid_sq"]], fp[:, k["attn_out_sq"]]
    n = hidden // fingerprint.BLOCKS
    var = BF16_HALF_ULP ** 2 * (e_mid + (tp_size - 1) * tp_size * e_attn)
    var = var + (math.log2(n) * FP32_SUM) ** 2 * n * 3 * 2 * (e_mid + e_attn)  # three sums; |layer|^2 <= 2(mid + attn)
    return ((s + a - m) / var.sqrt().clamp_min(1e-30)).pow(2)


def final_additive(fp: "torch.Tensor", streams: Sequence[str], hidden: int) -> Optional["torch.Tensor"]:
    """The final norm's addition on every row: z^2 [L, BLOCKS] of ``residual_in + update_in - final.pre_norm``
    over its rounding, bounded by 2^-16 sum pre^2 as for :func:`additive` (None: no such streams: the
    layer-boundary family, or a sample written before issue #33). Not scale-invariant: a stored
    ``final.pre_norm`` that is scaled, or misses the last layer's output, fails it."""
    res, upd, sq = fingerprint.FINAL_ADD
    if not all(name in streams for name in (res, upd, sq, "final.pre_norm")):
        return None
    n = hidden // fingerprint.BLOCKS
    e_pre = fp[:, streams.index(sq)]
    var = BF16_HALF_ULP ** 2 * e_pre + (math.log2(n) * FP32_SUM) ** 2 * n * 3 * 2 * e_pre
    diff = fp[:, streams.index(res)] + fp[:, streams.index(upd)] - fp[:, streams.index("final.pre_norm")]
    return (diff / var.sqrt().clamp_min(1e-30)).pow(2)
