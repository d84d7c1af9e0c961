"""Every plane of a sample against what the forward pass held, on every sample: the row checks.

The capture hook fingerprinted, on the GPU and at capture time, every stored plane, the
final norm's input and output and, for every captured layer, what that layer's attention
read (:mod:`hs_patch.server.fingerprint`). Per sample this module checks:

1. every row of every stream (from the fingerprint tensor alone, no plane read): finite, and
   not all zeros;
2. rows sampled in EVERY chunk the prompt was prefilled in (its first and last row and a
   key-seeded draw): each stored plane's row equals its fingerprint (what the forward held:
   the copy, staging and writer path; another prompt's rows, a stale buffer, a shift fail);
3. on those rows, what the model's own weights say the planes must be:
   - ``layer.<i>`` normalised with layer i's input norm weight is what layer i's attention
     read: the plane is layer i's input (not i+1's), fully reduced (not one rank's partial
     sum), not zeros, this prompt's;
   - ``final.pre_norm`` through the final norm is the LM head's input; a stored
     ``final.post_norm`` is that input (bytes); a post-norm-only capture has rms(post / w) = 1.
   Rounding is allowed exactly: our norm rounds to bf16 from the rounded residual, SGLang's
   fused norm from the unrounded fp32 sum, so elements differ by at most one unit in the last
   place (measured in #12: ~20% of them). Each block sum's difference, divided by the root sum
   of squares of those units over its block, is sub-Gaussian with variance proxy <= 1; a
   relation fails when the sum of squares over all its rows and blocks exceeds the chi-square
   tail bound N + 2 sqrt(N t) + 2t (Laurent-Massart, t = ln 1e12: a right sample fails with
   probability < 1e-12). A one per cent change of the rows' direction gives ~14 per block. An fp32
   model's units are finer than the norm's own arithmetic: see :func:`allowance`.

What it cannot see, said where it is used: a row scaled by a constant (RMSNorm is
scale-invariant); states SGLang itself computed wrong (the same-pass top-1 of
:mod:`hs_patch.host.fidelity` and the GPU proof are about that).
"""

from __future__ import annotations

import math
import random
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from hs_patch import lazy_sample, store
from hs_patch.server import fingerprint

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_ROWS = 8                  # rows checked per chunk (its first, its last, and a seeded draw)
FALSE_FAILURE = 1e-12             # the chance that rounding alone fails one relation of a right sample
BYTES_TOLERANCE = 1e-4            # of a block's L1 norm: fp32 summation order, GPU against host
RMS_TOLERANCE = 0.01              # rms(post / w) of a post-norm-only capture: 1 within this
FP32_ULPS = 2                     # fp32 elements: another formula of the same norm (x * rsqrt(ms) * w against
                                  # x * w / sqrt(ms)) rounds each differently by up to about this many units
SCALE_UNITS = 4                   # a row's scale: its mean square summed in another fp32 order is off by
                                  # about sqrt(H) units of 2^-24; this many times that is allowed


class Norms:
    """The norm weights the relations need: the final norm's, and each captured layer's input norm,
    read by name from the served model's directory when a sample first needs it (only those tensors)."""

    def __init__(self, final: "torch.Tensor", eps: float, directory: Optional[Path] = None,
                 layers: Optional[dict[int, "torch.Tensor"]] = None):
        self.final, self.eps, self.directory = final, eps, directory
        self._layers: dict[int, "torch.Tensor"] = dict(layers or {})
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, directory: str | Path) -> "Norms":
        from hs_patch.host.model_files import head_and_norm

        _, final, info = head_and_norm(directory)
        return cls(final, info.rms_norm_eps, Path(directory))

    @classmethod
    def of(cls, layers: dict[int, "torch.Tensor"], final: "torch.Tensor", eps: float) -> "Norms":
        """Given weights (tests, benchmarks)."""
        return cls(final, eps, layers=layers)

    def layer(self, i: int) -> "torch.Tensor":
        with self._lock:
            if i not in self._layers:
                if self.directory is None:
                    raise KeyError(f"no input norm weight of layer {i} was given")
                from hs_patch.host.model_files import input_norm

                self._layers[i] = input_norm(self.directory, i)
            return self._layers[i]


@dataclass
class RowCheck:
    """What the row checks found in one sample; ``problems`` empty means it passed."""

    rows: int = 0
    chunks: int = 0
    problems: list[str] = field(default_factory=list)
    relations: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> n, chi2, bound
    log_norms: dict[str, float] = field(default_factory=dict)            # plane -> mean log row norm

    @property
    def ok(self) -> bool:
        return not self.problems

    def record(self) -> dict[str, Any]:
        return asdict(self)


def chunk_starts(metadata: dict[str, str], n: int) -> list[int]:
    """Where each prefill part of the sample began (``chunks`` in its metadata)."""
    try:
        starts = [int(x) for x in metadata.get("chunks", "0").split(",")]
    except ValueError:
        raise store.SampleError(f"chunks={metadata.get('chunks')!r} in the sample's metadata is not a list of "
                                "offsets") from None
    if not starts or starts[0] != 0 or starts != sorted(set(starts)) or starts[-1] >= max(n, 1):
        raise store.SampleError(f"chunks={metadata.get('chunks')!r} does not split {n} tokens")
    return starts


def sample_rows(key: str, starts: Sequence[int], n: int, per_chunk: int) -> list[int]:
    """Rows to check: in every chunk its first and last row and ``per_chunk - 2`` drawn by key (stable)."""
    rng = random.Random(key)
    rows: set[int] = set()
    for a, b in zip(starts, list(starts[1:]) + [n]):
        rows.update({a, b - 1})
        inner = range(a + 1, b - 1)
        rows.update(rng.sample(inner, min(len(inner), max(0, per_chunk - 2))))
    return sorted(rows)


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


def chi2_bound(n: int) -> float:
    t = math.log(1 / FALSE_FAILURE)
    return n + 2 * math.sqrt(n * t) + 2 * t


def _rows(sample: lazy_sample.LazySample, name: str, rows: Sequence[int]) -> "torch.Tensor":
    """The given rows of a plane, read in contiguous runs."""
    import torch

    out, i = [], 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        out.append(sample.rows(name, rows[i], rows[j] + 1))
        i = j + 1
    return torch.cat(out)


class _Checker:
    def __init__(self, sample: lazy_sample.LazySample, fp: "torch.Tensor", streams: list[str], rows: list[int]):
        self.sample, self.fp, self.streams, self.rows = sample, fp, streams, rows
        self.result = RowCheck(rows=len(rows))

    def stream(self, name: str) -> "torch.Tensor":
        return self.fp[self.rows, self.streams.index(name)]

    def bytes(self, name: str, data: "torch.Tensor") -> None:
        """The stored rows of ``name`` are what the forward held (deterministic tolerance)."""
        got = fingerprint.block_sums(data)
        l1 = data.float().abs().unflatten(-1, (fingerprint.BLOCKS, -1)).sum(-1)
        bad = ((got - self.stream(name)).abs() > BYTES_TOLERANCE * l1 + 1e-30).any(-1)
        if bool(bad.any()):
            rows = [r for r, b in zip(self.rows, bad.tolist()) if b]
            self.result.problems.append(
                f"{name}: {len(rows)} of {len(self.rows)} checked rows (e.g. {rows[:5]}) differ from what the forward "
                "pass held at capture: the rows were misplaced, replaced or corrupted between the GPU and the file")

    def relation(self, what: str, predicted: "torch.Tensor", stream: str, meaning: str) -> None:
        """``predicted`` (bf16 rows computed here from the stored ones) against the stream, within rounding."""
        got = fingerprint.block_sums(predicted)
        sigma = allowance(predicted)
        z2 = ((got - self.stream(stream)) / sigma.clamp_min(1e-30)).pow(2)
        n = z2.numel()
        chi2 = float(z2.sum()) if bool(z2.isfinite().all()) else math.inf
        bound = chi2_bound(n)
        self.result.relations[what] = {"n": n, "chi2": round(chi2, 3), "bound": round(bound, 3)}
        if not chi2 <= bound:
            self.result.problems.append(f"{what}: {meaning} (chi-square {chi2:.3g} over {n} block sums, a right "
                                        f"sample stays under {bound:.3g})")


def check_rows(sample: lazy_sample.LazySample, norms: Optional[Norms], *, per_chunk: int = DEFAULT_ROWS) -> RowCheck:
    """Run the row checks on one opened sample (see the module's doc); ``norms`` None skips the relations."""
    from hs_patch.host.model_files import rms_norm

    meta = sample.metadata
    try:
        doc = fingerprint.parse(meta)
    except ValueError as e:
        raise store.SampleError(f"{sample.path}: {e}") from None
    if doc is None:
        return RowCheck(problems=["no fingerprints: the capture hook inside the server is older than this check; "
                                  "restart the server with this hs_patch (hs-patch apply, then restart)"])
    streams, n = list(doc["streams"]), sample.num_tokens
    fp = sample.tensor(fingerprint.TENSOR)
    starts = chunk_starts(meta, n)
    rows = sample_rows(sample.key, starts, n, per_chunk)
    c = _Checker(sample, fp, streams, rows)
    c.result.chunks = len(starts)
    finite = fp.isfinite().all(-1)
    zero = (fp == 0).all(-1)
    for k, name in enumerate(streams):
        if not bool(finite[:, k].all()):
            c.result.problems.append(f"{name}: NaN or Inf at rows {finite[:, k].logical_not().nonzero()[:5, 0].tolist()}")
        if bool(zero[:, k].any()):
            r = zero[:, k].nonzero()[:5, 0].tolist()
            c.result.problems.append(f"{name}: rows {r} are all zeros ({int(zero[:, k].sum())} of {n})")
    planes = {p: _rows(sample, p, rows) for p in sample.planes}
    for p, data in planes.items():
        c.bytes(p, data)
        c.result.log_norms[p] = round(float(data.float().norm(dim=-1).clamp_min(1e-30).log().mean()), 4)
    if norms is not None:
        for p, data in planes.items():
            if p.startswith("layer."):
                i = int(p.split(".", 1)[1])
                c.relation(p, rms_norm(data, norms.layer(i), norms.eps), fingerprint.attn_stream(i),
                           f"the stored rows, normalised with layer {i}'s input norm, are not what layer {i}'s "
                           "attention read: another layer's state, one tensor-parallel rank's partial sum, or "
                           "another prompt's rows")
        if "final.pre_norm" in planes:
            c.relation("final.pre_norm", rms_norm(planes["final.pre_norm"], norms.final, norms.eps),
                       "final.post_norm", "the stored pre-norm state through the final norm is not what the LM "
                       "head read: it is not the last layer's output")
        elif "final.post_norm" in planes:
            post = planes["final.post_norm"].float()
            w = norms.final.float()
            use = w.abs() > 1e-6
            rms = (post[:, use] / w[use]).pow(2).mean(-1).sqrt()
            c.result.relations["final.post_norm"] = {"n": len(rows), "max_rms_error": round(float((rms - 1).abs().max()), 6)}
            if bool(((rms - 1).abs() > RMS_TOLERANCE).any()):
                c.result.problems.append("final.post_norm: the stored rows are not normalised (rms of post / norm "
                                         f"weight is {rms.min():.4g}..{rms.max():.4g}, not 1): not the final "
                                         "norm's output")
    return c.result
