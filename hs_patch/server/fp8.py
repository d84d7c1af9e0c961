"""FP8 planes (HS_CAPTURE_DTYPE=fp8, issue #35): quantized on the device before the copy to the host.

Each captured row x (one token of one plane) is stored as ``q = fp8_e4m3fn(x / s)`` with one fp32
scale a row, ``s = max(amax(|x|) / 448, 2^-126)``: 448 is e4m3fn's largest value, so the row's
largest element lands on it; a row of zeros gets ``2^-126`` (fp32's smallest normal) and stores
zeros (its dequantized row is zeros again). Readers dequantize with ``q.float() * s`` (then bf16).

The quantization runs where the capture runs (the compute stream on a GPU), from memory made at
start: the scale is a max-norm reduction into the slot's scale row, the division goes through one
work buffer of the model's dtype (``x / s`` rounded to bf16, then to e4m3fn: the double rounding
adds at most bf16's 2^-9 relative to e4m3's 2^-4), clamped to +-448 and cast into the fp8 rows.
Nothing sized by the pass is allocated.

The error bound readers (the fidelity check) may rely on, per element x of a row with scale s,
dequantized in fp32: ``|q s - x| <= (2^-4 + 2^-9) |x| + 2^-9 s``. e4m3 has 3 mantissa bits: rounding
to nearest errs by at most half a unit, 2^-4 of the value at the bottom of its binade, for scaled
values in its normal range (2^-6 and up); the work buffer's rounding of x / s to bf16 first adds at
most 2^-9 of the value (double rounding; the clamp to 448 is within it); below the normal range the
subnormal spacing is 2^-9 (in units of s), half of which, with the bf16 share, 2^-9 s bounds. Read
as bf16, add bf16's own rounding, 2^-8 |x|. See :func:`block_tolerance`.

The exact checksum of a stored fp8 row (:func:`hs_patch.server.fingerprint.word_sums`, of the bytes
actually stored) covers its scale too: the scale's 32-bit word is added, modulo 2^32, to the last
block's word sum (:func:`add_scale_word`), so a changed scale fails the check like a changed byte.

Standard library at import, torch where used (imported inside the server and by the readers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch

DTYPE = "float8_e4m3fn"        # the planes' metadata "dtype" (torch's name)
SAFETENSORS_DTYPE = "F8_E4M3"
META = "quantization"          # the sample metadata naming the scheme
SCHEME = "fp8_e4m3fn/per-token-amax"
SOURCE_META = "source_dtype"   # what the engine computed (bfloat16): the check rows' dtype, the dequantized one
SOURCE_DTYPES = ("bfloat16", "float16", "float32")   # what an engine computes in, and so what fp8 planes come from
SCALE_SUFFIX = ".scale"        # tensor "<plane>.scale", F32 [N]: one scale a token
FP8_MAX = 448.0
MIN_SCALE = 2.0 ** -126
REL_ERROR = 2.0 ** -4 + 2.0 ** -9  # e4m3's half unit (3 mantissa bits), + x / s rounded to bf16 first
ABS_ERROR = 2.0 ** -9              # times the row's scale: e4m3's subnormal range


def scale_name(plane: str) -> str:
    """The tensor holding ``plane``'s scales."""
    return plane + SCALE_SUFFIX


def source_name(metadata: Mapping[str, str]) -> str:
    """The dtype name the engine computed a sample's planes in: an fp8 sample's ``source_dtype``, else its
    ``dtype`` ("" when neither is there)."""
    return metadata.get(SOURCE_META) or metadata.get("dtype", "")


def is_fp8(metadata: Mapping[str, str]) -> bool:
    """Whether a sample's planes are fp8 (its metadata names the scheme); ValueError for a scheme we cannot read."""
    scheme = metadata.get(META)
    if scheme is None:
        if metadata.get("dtype") == DTYPE:  # read as they are, they would be the e4m3 codes, not the values
            raise ValueError(f"{DTYPE} planes without a quantization scheme: no scales to read them with")
        return False
    if scheme != SCHEME or metadata.get("dtype") != DTYPE:
        raise ValueError(f"quantization {scheme!r} of {metadata.get('dtype')!r} planes is not one this hs_patch "
                         f"reads ({SCHEME} of {DTYPE}): written by a newer hs_patch?")
    if metadata.get(SOURCE_META) not in SOURCE_DTYPES:
        raise ValueError(f"fp8 planes quantized from {metadata.get(SOURCE_META)!r}: not a dtype they can be "
                         f"dequantized to ({', '.join(SOURCE_DTYPES)})")
    return True


def quantize(x: "torch.Tensor", work: "torch.Tensor", q: "torch.Tensor", scale: "torch.Tensor") -> None:
    """Rows ``x`` [T, H] into ``q`` (fp8 [T, H]) and ``scale`` (fp32 [T]), through ``work`` ([T, H] of x's
    dtype), all made beforehand: nothing is allocated on a GPU's forward path (the reductions and element-wise
    ops write into these)."""
    import torch

    with torch.no_grad():
        torch.linalg.vector_norm(x, float("inf"), dim=-1, dtype=torch.float32, out=scale)
        scale.div_(FP8_MAX).clamp_(min=MIN_SCALE)
        work.copy_(x)
        work.div_(scale.unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX)
        q.copy_(work)


def dequantize(q: "torch.Tensor", scale: "torch.Tensor", dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """``q`` fp8 [T, H] with its scales fp32 [T] -> [T, H] of ``dtype`` (default bfloat16), via fp32."""
    import torch

    out = q.to(torch.float32).mul_(scale.to(torch.float32).reshape(-1, 1))
    return out.to(dtype or torch.bfloat16)


def add_scale_word(sums: "torch.Tensor", scale: "torch.Tensor") -> None:
    """Fold each row's scale (its fp32 bits as a 32-bit word) into the last block of the row's word sums
    ``sums`` int32 [T, BLOCKS], modulo 2^32, in place."""
    import torch

    sums[:, -1].add_(scale.view(torch.int32))


def block_tolerance(abs_block_sums: "torch.Tensor", scale: "torch.Tensor", block: int) -> "torch.Tensor":
    """How far the block sums of a dequantized row may lie from the block sums of the row the engine held:
    ``sum |e| <= REL sum |x| + block * 2^-9 s``, and ``sum |x| <= (sum |dequantized| + block * 2^-9 s) / (1 - REL)``
    (REL = 2^-4 + 2^-9). From the
    dequantized rows' block sums of absolute values [T, BLOCKS] and their scales [T]; fp32 [T, BLOCKS]."""
    rel = REL_ERROR / (1.0 - REL_ERROR)
    absolute = scale.float().reshape(-1, 1) * (block * ABS_ERROR)
    return abs_block_sums * rel + absolute * (1.0 + rel)
