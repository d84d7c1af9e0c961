"""Fingerprints of what the forward pass held at each capture point: a few fp32 numbers per row.

The capture hook computes them on the GPU, on the live tensor and in the compute stream's
order (before SGLang updates its residual in place), and the writer stores them in the
sample (tensor ``fingerprint`` F32 [L, S, BLOCKS]); the driver's fidelity check
(:mod:`hs_patch.host.fidelity`) compares them with what the file holds and with what the
model's own weights say the rows must be. A row's fingerprint is its sums over BLOCKS equal
contiguous blocks of the hidden dimension, accumulated in fp32 (on CUDA a bf16 -> fp32
reduction reads the row once and allocates nothing). Any NaN or Inf makes a sum non-finite;
a row of zeros sums to zeros; the block sums of the difference of two rows sketch the
difference's energy per block, which is what the checks test against rounding.

Streams (S of them, in this order):

- every stored plane (``layer.<i>``, ``final.pre_norm``, ``final.post_norm``): the file's rows
  must match these (the copy, staging and writer path);
- ``final.pre_norm`` / ``final.post_norm`` when not stored: the final norm's input and the LM
  head's input, for the final-norm relation;
- ``attn_in.<i>`` for every captured layer: what layer i's attention read, its input norm
  applied to the fully reduced residual (handed over by a line the patch adds after the
  layer's ``prepare_attn``). The stored ``layer.<i>``, normalised with layer i's weight, must
  be it: this proves the plane is layer i's fully reduced input, not another layer's, not one
  rank's partial sum, not zeros, not another prompt's rows, up to a scale per row (RMSNorm
  does not see scale);
- ``attn_out.<i>`` / ``attn_out_sq.<i>``: the block sums and the block sums of squares of
  layer i's attention output, as the layer holds it before the all-reduce (under tensor
  parallelism each rank's share: every rank fingerprints its own and the fingerprints are
  summed across the ranks, [T, 8] fp32 each, on the GPU); ``mid.<i>`` / ``mid_sq.<i>``: the
  same of the residual after the attention's output was added to it (the patch's lines around
  ``prepare_mlp``). Block sums are linear, so ``layer.<i> + attn_out.<i> = mid.<i>`` holds
  within the rounding of that addition (bounded from the squares): the additive relation. It
  sees what the norm relation cannot: a scaled plane, a rank's partial sum and the neighbouring
  layer whatever the size of the layer's update, down to bf16's own resolution, on every row
  and from the fingerprints alone;
- ``final.residual_in`` / ``final.update_in``: the two inputs of the final norm's fused
  addition (the residual and the last layer's output), and ``final.pre_norm_sq`` the squares of
  their sum: ``final.pre_norm = residual_in + update_in`` the same way, which ties the stored
  pre-norm state's scale (layer-point and communicator families; the layer-boundary family adds
  inside SGLang's residual stream, where the patch cannot reach the inputs).

Checksums (tensor ``checksum`` I32 [L, C, BLOCKS], metadata ``checksum``): the exact bytes of a
row, as the sum modulo 2^32 of its little-endian 32-bit words over each of BLOCKS contiguous
blocks, for every stored plane (the file's bytes must be these: every row of every plane is
compared on the host at memory speed, no tolerance) and for ``embed``, the rows the model's
residual stream began from (its embedding of the pass's token ids, in the order the model
holds its rows): the host recomputes them from the embedding weight and the sample's
``input_ids``, which ties every row of the sample to the tokens the engine ran.

Standard library and torch only (imported inside the SGLang server).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional, Sequence

from hs_patch.samples import store

if TYPE_CHECKING:  # pragma: no cover
    import torch

VERSION = 2             # 1: planes, finals, attn_in (issue #25); 2: + attn_out, mid and their squares (#33)
VERSIONS_READ = (1, VERSION)
BLOCKS = 8
TENSOR = "fingerprint"   # the sample's tensor name
META = "fingerprint"     # the sample's metadata key (JSON: version, method, blocks, streams)
CHECKSUM_TENSOR = "checksum"  # I32 [L, C, BLOCKS]: exact word sums (issue #33)
CHECKSUM_META = "checksum"
EMBED = "embed"          # the checksum stream of the rows the residual stream began from
ATTN_PREFIX = "attn_in."
ADDITIVE = ("attn_out", "attn_out_sq", "mid", "mid_sq")  # per captured layer, in this order
FINAL_ADD = ("final.residual_in", "final.update_in", "final.pre_norm_sq")  # the final norm's addition


def attn_stream(layer: int) -> str:
    """The stream of what layer ``layer``'s attention read."""
    return f"{ATTN_PREFIX}{layer}"


def layer_stream(kind: str, layer: int) -> str:
    """One of the additive relation's streams of ``layer`` (``kind`` in ADDITIVE)."""
    return f"{kind}.{layer}"


def streams(layers: Sequence[int], final: str, final_add: bool = True) -> list[str]:
    """The fingerprinted streams of a capture of ``layers`` and ``final`` (HS_CAPTURE_FINAL), in order;
    ``final_add``: the patch hands the final norm's inputs (not the layer-boundary family)."""
    planes = store.plane_names(layers, final)
    finals = [p for p in store.FINAL_PLANES["both"] if p not in planes]
    return planes + finals + [attn_stream(i) for i in layers] + \
        [layer_stream(kind, i) for i in layers for kind in ADDITIVE] + (list(FINAL_ADD) if final_add else [])


def checksum_streams(layers: Sequence[int], final: str) -> list[str]:
    """The checksummed streams: every stored plane, then the embedding rows."""
    return store.plane_names(layers, final) + [EMBED]


def describe(names: Sequence[str]) -> str:
    """The sample metadata that says what its fingerprint tensor holds."""
    return json.dumps({"version": VERSION, "method": "block-sums", "blocks": BLOCKS, "dtype": "F32",
                       "streams": list(names)}, separators=(",", ":"))


def describe_checksums(names: Sequence[str]) -> str:
    """The sample metadata that says what its checksum tensor holds."""
    return json.dumps({"version": 1, "method": "u32-word-sums", "blocks": BLOCKS, "dtype": "I32",
                       "streams": list(names)}, separators=(",", ":"))


def parse(metadata: dict[str, str]) -> Optional[dict]:
    """The fingerprint description of a sample's metadata (None if it has none); ValueError if unusable."""
    return _parse(metadata, META, VERSIONS_READ, "block-sums")


def parse_checksums(metadata: dict[str, str]) -> Optional[dict]:
    """The checksum description of a sample's metadata (None: written before issue #33); ValueError if unusable."""
    return _parse(metadata, CHECKSUM_META, (1,), "u32-word-sums")


def _parse(metadata: dict[str, str], key: str, versions: Sequence[int], method: str) -> Optional[dict]:
    raw = metadata.get(key)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        ok = (doc["version"] in versions and doc["method"] == method and int(doc["blocks"]) == BLOCKS
              and all(isinstance(s, str) for s in doc["streams"]))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"unknown {key} description {raw[:200]!r} (written by a newer hs_patch?)")
    return doc


def check_hidden(hidden: int, itemsize: int = 2) -> None:
    """The fingerprints' blocks need the hidden size to split evenly (and the checksums' into 32-bit words)."""
    if hidden % BLOCKS or (hidden * itemsize) % (4 * BLOCKS):
        raise ValueError(f"hidden size {hidden} does not split into {BLOCKS} blocks of whole 32-bit words: the "
                         "capture's fingerprints need it (every supported model's does)")


def block_sums(x: "torch.Tensor", out: "Optional[torch.Tensor]" = None) -> "torch.Tensor":
    """Row sums of ``x`` [T, H] over BLOCKS contiguous blocks, fp32 [T, BLOCKS] (into ``out`` if given)."""
    import torch

    with torch.no_grad():  # a record of the forward, never part of a graph
        blocks = x.unflatten(-1, (BLOCKS, x.shape[-1] // BLOCKS))
        if out is None:
            return torch.sum(blocks, dim=-1, dtype=torch.float32)
        return torch.sum(blocks, dim=-1, dtype=torch.float32, out=out)


def block_squares(x: "torch.Tensor", out: "Optional[torch.Tensor]" = None) -> "torch.Tensor":
    """Row sums of squares of ``x`` [T, H] over BLOCKS contiguous blocks, fp32 [T, BLOCKS] (into ``out``)."""
    import torch

    with torch.no_grad():
        blocks = x.unflatten(-1, (BLOCKS, x.shape[-1] // BLOCKS))
        norms = torch.linalg.vector_norm(blocks, 2, dim=-1, dtype=torch.float32, out=out)
        return norms.square_()


def word_sums(x: "torch.Tensor", out: "Optional[torch.Tensor]" = None) -> "torch.Tensor":
    """The exact checksum of each row of ``x`` [T, H] (contiguous rows): its bytes read as little-endian
    32-bit words, summed modulo 2^32 over BLOCKS contiguous blocks, int32 [T, BLOCKS] (into ``out``).
    Integer addition is associative modulo 2^32, so the GPU's reduction order and the host's
    (:func:`hs_patch.host.fidelity.checksums.host_word_sums`) give the same bits."""
    import torch

    with torch.no_grad():
        if x.stride(-1) != 1:
            x = x.contiguous()  # never on the capture path: SGLang's residual rows are contiguous
        words = x.view(torch.int32).unflatten(-1, (BLOCKS, -1))
        return torch.sum(words, dim=-1, dtype=torch.int32, out=out)

