"""Every plane of a sample against what the forward pass held, on every sample: the row checks.

The capture hook fingerprinted, on the GPU and at capture time, every stored plane, the final
norm's input and output, the embedded rows and, for every captured layer, what its attention
read, its attention's output and the residual after it (:mod:`hs_patch.server.fingerprint`).
Per sample this module checks:

1. every row of every stream, from the fingerprints alone: finite (a NaN or Inf anywhere in a
   row makes its block sums non-finite), and the states not all zeros;
2. every row of every stored plane: its bytes in the file are the exact checksum the hook took
   (:mod:`hs_patch.host.fidelity.checksums`; samples written before issue #33 have none: their
   rows read below are compared with their block sums instead, within fp32 summation order);
3. every row: the embedded rows are the embedding of the sample's token ids (given the model's
   embedding weight): each row is this request's, at this position;
4. every row of every chunk: the additive relation of each captured layer (layer + attention
   output = the residual after it), from the fingerprints alone;
5. rows read in EVERY chunk (its first and last row and a key-seeded draw): what the model's own
   norm weights say the planes must be: ``layer.<i>`` normalised with layer i's input norm is what
   layer i's attention read; ``final.pre_norm`` through the final norm is the LM head's input; a
   post-norm-only capture has rms(post / w) = 1.

An fp8 sample (HS_CAPTURE_DTYPE=fp8) is checked the same way: its checksums are of the bytes stored
(fp8 rows and scales), its fingerprints of the states before quantization; the rows read, dequantized,
are compared with their plane's fingerprint within the fp8 envelope (:meth:`_Checker.quantized`) and
the norm relations widen their allowance by it (:func:`relations.quantized_allowance`).

Every relation is judged chunk by chunk (:mod:`hs_patch.host.fidelity.relations`), and every
comparison fails on a NaN (it tests that a value is within bounds, never that it is outside).
What this cannot see: states SGLang itself computed wrong before the capture points (the same-pass
top-1 and logit gaps of :mod:`hs_patch.host.fidelity.check`, and the GPU proof, are about that);
the floors of each relation are in docs/verification.md.
"""

from __future__ import annotations

import random
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from hs_patch.host.fidelity import relations
from hs_patch.host.fidelity.checksums import Embeddings, mismatched_rows
from hs_patch.samples import lazy_sample, store
from hs_patch.samples.reader import source_dtype
from hs_patch.server import fingerprint, fp8

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_ROWS = 8                  # rows read per chunk (its first, its last, and a seeded draw)
BYTES_TOLERANCE = 1e-4            # of a block's L1 norm: fp32 summation order, GPU against host (no checksums)
RMS_TOLERANCE = 0.01              # rms(post / w) of a post-norm-only capture: 1 within this
NOT_ZERO = ("layer.", "final.pre_norm", "final.post_norm", fingerprint.ATTN_PREFIX, "mid.")  # states: never zeros


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

    rows: int = 0                                                        # rows read of every plane
    chunks: int = 0
    every_row: list[str] = field(default_factory=list)                   # what was checked on every row
    problems: list[str] = field(default_factory=list)
    relations: dict[str, dict[str, float]] = field(default_factory=dict)  # name -> its worst chunk
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
    """Rows to read: in every chunk its first and last row and ``per_chunk - 2`` drawn by key (stable)."""
    rng = random.Random(key)
    rows: set[int] = set()
    for a, b in zip(starts, list(starts[1:]) + [n]):
        rows.update({a, b - 1})
        inner = range(a + 1, b - 1)
        rows.update(rng.sample(inner, min(len(inner), max(0, per_chunk - 2))))
    return sorted(rows)


def _rows(sample: lazy_sample.LazySample, name: str, rows: Sequence[int], raw: bool = False) -> "torch.Tensor":
    """The given rows of a plane, read in contiguous runs (an fp8 sample's dequantized unless ``raw``)."""
    import torch

    out, i = [], 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1] == rows[j] + 1:
            j += 1
        out.append(sample.rows(name, rows[i], rows[j] + 1, raw=raw))
        i = j + 1
    return torch.cat(out)


def _listed(rows: Sequence[int], total: int) -> str:
    return f"{len(rows)} of {total} rows (e.g. {list(rows[:5])})"


class _Checker:
    def __init__(self, sample: lazy_sample.LazySample, fp: "torch.Tensor", streams: list[str], rows: list[int],
                 starts: list[int]):
        self.sample, self.fp, self.streams, self.rows, self.starts = sample, fp, streams, rows, starts
        self.n = sample.num_tokens
        self.result = RowCheck(rows=len(rows), chunks=len(starts))
        self.chunks = relations.chunk_of(rows, starts)

    def stream(self, name: str) -> "torch.Tensor":
        return self.fp[self.rows, self.streams.index(name)]

    def every_row(self, fp_meta_checksums: Optional[dict], embeddings: Optional[Embeddings]) -> bool:
        """Checks 1-3; True when the planes' bytes were checked on every row (by checksum)."""
        import torch

        fp, n, res = self.fp, self.n, self.result
        finite, zero = fp.isfinite().all(-1), (fp == 0).all(-1)
        for k, name in enumerate(self.streams):
            if not bool(finite[:, k].all()):
                bad = finite[:, k].logical_not().nonzero()[:, 0].tolist()
                res.problems.append(f"{name}: NaN or Inf in {_listed(bad, n)}")
            if name.startswith(NOT_ZERO) and not name.endswith("_sq") and bool(zero[:, k].any()):
                res.problems.append(f"{name}: {_listed(zero[:, k].nonzero()[:, 0].tolist(), n)} are all zeros")
        res.every_row.append("finite and not zero (fingerprints)")
        if fp_meta_checksums is None:
            return False
        names = list(fp_meta_checksums["streams"])
        cs = self.sample.tensor(fingerprint.CHECKSUM_TENSOR)
        for plane, bad in mismatched_rows(self.sample.path, cs, names, self.sample.planes, n,
                                          scaled=self.sample.fp8).items():
            res.problems.append(f"{plane}: the bytes of {_listed(bad, n)} differ from what the forward pass held at "
                                "capture: rows misplaced, replaced, shifted or corrupted between the GPU and the file")
        res.every_row.append("bytes = checksums (every stored plane)")
        if embeddings is not None and fingerprint.EMBED in names:
            dtype = source_dtype(self.sample.metadata)  # the embedding as the engine held it (fp8 samples: bf16)
            bad = embeddings.mismatched(self.sample.tensor("input_ids"), cs[:, names.index(fingerprint.EMBED)], dtype)
            if bad:
                res.problems.append(f"embed: the rows the residual stream began from are not the embedding of this "
                                    f"sample's tokens at {_listed(bad, n)}: the states are another request's, or "
                                    "shifted against the token ids")
            res.every_row.append("embedded rows = embedding of input_ids")
        return True

    def bytes(self, name: str, data: "torch.Tensor") -> None:
        """(No checksums: a sample written before #33.) The stored rows read are what the forward held."""
        got = fingerprint.block_sums(data)
        l1 = data.float().abs().unflatten(-1, (fingerprint.BLOCKS, -1)).sum(-1)
        ok = ((got - self.stream(name)).abs() <= BYTES_TOLERANCE * l1 + 1e-30) & got.isfinite()
        bad = [r for r, good in zip(self.rows, ok.all(-1).tolist()) if not good]
        if bad:
            self.result.problems.append(
                f"{name}: {len(bad)} of {len(self.rows)} checked rows (e.g. {bad[:5]}) differ from what the forward "
                "pass held at capture: the rows were misplaced, replaced or corrupted between the GPU and the file")

    def quantized(self, name: str, data: "torch.Tensor", scale: "torch.Tensor") -> None:
        """(An fp8 sample: its bytes are checked by checksum, against what the hook quantized.) The stored rows
        read, dequantized in fp32 (``data``), are what the forward pass held before quantization, within the fp8
        envelope (:func:`hs_patch.server.fp8.block_tolerance`, a bound, not a statistic) and fp32 summation
        order."""
        got = fingerprint.block_sums(data)
        l1 = data.abs().unflatten(-1, (fingerprint.BLOCKS, -1)).sum(-1)
        tol = fp8.block_tolerance(l1, scale, data.shape[-1] // fingerprint.BLOCKS) + BYTES_TOLERANCE * l1
        ok = ((got - self.stream(name)).abs() <= tol) & got.isfinite()
        bad = [r for r, good in zip(self.rows, ok.all(-1).tolist()) if not good]
        if bad:
            self.result.problems.append(
                f"{name}: {len(bad)} of {len(self.rows)} checked rows (e.g. {bad[:5]}), dequantized, are not what the "
                "forward pass held before fp8 quantization, beyond fp8's rounding: wrong rows or scales quantized")

    def judged(self, what: str, z2: "torch.Tensor", chunks: Sequence[int], meaning: str) -> None:
        record, failed = relations.judge(z2, chunks, len(self.starts))
        self.result.relations[what] = record
        if failed:
            self.result.problems.append(relations.describe_failures(what, meaning, failed, self.starts, self.n))

    def relation(self, what: str, predicted: "torch.Tensor", stream: str, meaning: str,
                 allow: Optional["torch.Tensor"] = None) -> None:
        """``predicted`` (rows computed here from the stored ones read) against the stream, chunk by chunk
        (``allow``: its allowance, for fp8 rows :func:`relations.quantized_allowance`)."""
        self.judged(what, relations.standardised(predicted, self.stream(stream), allow), self.chunks, meaning)


def check_rows(sample: lazy_sample.LazySample, norms: Optional[Norms], *, per_chunk: int = DEFAULT_ROWS,
               embeddings: Optional[Embeddings] = None) -> RowCheck:
    """Run the row checks on one opened sample (see the module's doc); ``norms`` None skips the norm
    relations, ``embeddings`` None the embedded rows' check."""
    import torch

    from hs_patch.host.model_files import rms_norm

    meta = sample.metadata
    try:
        doc, cdoc = fingerprint.parse(meta), fingerprint.parse_checksums(meta)
    except ValueError as e:
        raise store.SampleError(f"{sample.path}: {e}") from None
    if doc is None:
        return RowCheck(problems=["no fingerprints: the capture hook inside the server is older than this check; "
                                  "restart the server with this hs_patch (hs-patch apply, then restart)"])
    streams, n = list(doc["streams"]), sample.num_tokens
    fp = sample.tensor(fingerprint.TENSOR)
    starts = chunk_starts(meta, n)
    rows = sample_rows(sample.key, starts, n, per_chunk)
    c = _Checker(sample, fp, streams, rows, starts)
    checksummed = c.every_row(cdoc, embeddings)
    every = list(range(n))
    every_chunk = relations.chunk_of(every, starts)
    tp = int(meta.get("tp_size", "1") or 1)
    hidden = int(meta.get("hidden_size", fp.shape[-1]))
    additive = False
    for layer in (int(p.split(".", 1)[1]) for p in sample.planes if p.startswith("layer.")):
        z2 = relations.additive(fp, streams, layer, tp, hidden)
        if z2 is not None:
            additive = True
            c.judged(f"layer.{layer}+attn", z2, every_chunk,
                     f"layer {layer}'s stored input plus its attention's output is not the residual after it: the "
                     "plane is scaled, one tensor-parallel rank's partial sum, another layer's state, or another "
                     "prompt's rows")
    final = relations.final_additive(fp, streams, hidden)
    if final is not None:
        additive = True
        c.judged("final.pre_norm+add", final, every_chunk,
                 "the stored pre-norm state is not the final norm's addition of the residual and the last layer's "
                 "output: it is scaled, or misses the last layer's output")
    if additive:
        c.result.every_row.append("additive relations (layer + attention output = residual after it; the final "
                                  "norm's addition)")
    if sample.fp8:  # each plane's rows read once, as stored, and its scales at once (4 bytes a token),
        # dequantized once in fp32: the envelope's comparison uses that, the relations its cast to the source dtype
        scales = {p: sample.scale(p)[rows] for p in sample.planes}
        exact = {p: fp8.dequantize(_rows(sample, p, rows, raw=True), scales[p], torch.float32) for p in sample.planes}
        source = source_dtype(meta)
        planes = {p: x.to(source) for p, x in exact.items()}
    else:
        exact, scales = {}, {}
        planes = {p: _rows(sample, p, rows) for p in sample.planes}
    for p, data in planes.items():
        if sample.fp8:
            c.quantized(p, exact[p], scales[p])
        elif not checksummed:
            c.bytes(p, data)
        norms_ = data.float().norm(dim=-1)
        finite = norms_[norms_.isfinite() & (norms_ > 0)]
        if len(finite):
            c.result.log_norms[p] = round(float(finite.log().mean()), 4)
    if norms is not None:
        for p, data in planes.items():
            if p.startswith("layer."):
                i = int(p.split(".", 1)[1])
                pred = rms_norm(data, norms.layer(i), norms.eps)
                c.relation(p, pred, fingerprint.attn_stream(i),
                           f"the stored rows, normalised with layer {i}'s input norm, are not what layer {i}'s "
                           "attention read: another layer's state, one tensor-parallel rank's partial sum, or "
                           "another prompt's rows", _allow(pred, data, scales.get(p), norms.layer(i), norms.eps))
        if "final.pre_norm" in planes:
            pre = planes["final.pre_norm"]
            pred = rms_norm(pre, norms.final, norms.eps)
            c.relation("final.pre_norm", pred, "final.post_norm", "the stored pre-norm state through the final norm "
                       "is not what the LM head read: it is not the last layer's output",
                       _allow(pred, pre, scales.get("final.pre_norm"), norms.final, norms.eps))
        elif "final.post_norm" in planes:
            post = planes["final.post_norm"].float()
            w = norms.final.float()
            use = w.abs() > 1e-6
            rms = (post[:, use] / w[use]).pow(2).mean(-1).sqrt()
            err = (rms - 1).abs()
            c.result.relations["final.post_norm"] = {"n": len(rows), "max_rms_error": round(float(err.max()), 6)}
            if not bool((err <= RMS_TOLERANCE + (fp8.REL_ERROR + relations.BF16_HALF_ULP) * sample.fp8).all()):
                c.result.problems.append("final.post_norm: the stored rows are not normalised (rms of post / norm "
                                         f"weight is {rms.min():.4g}..{rms.max():.4g}, not 1): not the final "
                                         "norm's output")
    return c.result


def _allow(predicted: "torch.Tensor", stored: "torch.Tensor", scale: Optional["torch.Tensor"],
           weight: "torch.Tensor", eps: float) -> Optional["torch.Tensor"]:
    """The norm relation's allowance: the default for bf16 rows, widened by fp8's rounding for fp8 ones."""
    return None if scale is None else relations.quantized_allowance(predicted, stored, scale, weight, eps)
