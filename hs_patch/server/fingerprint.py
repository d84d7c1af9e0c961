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
  rank's partial sum, not zeros, not another prompt's rows.

Standard library and torch only (imported inside the SGLang server).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Optional, Sequence

from hs_patch import store

if TYPE_CHECKING:  # pragma: no cover
    import torch

VERSION = 1
BLOCKS = 8
TENSOR = "fingerprint"   # the sample's tensor name
META = "fingerprint"     # the sample's metadata key (JSON: version, method, blocks, streams)
ATTN_PREFIX = "attn_in."


def attn_stream(layer: int) -> str:
    """The stream of what layer ``layer``'s attention read."""
    return f"{ATTN_PREFIX}{layer}"


def streams(layers: Sequence[int], final: str) -> list[str]:
    """The fingerprinted streams of a capture of ``layers`` and ``final`` (HS_CAPTURE_FINAL), in order."""
    planes = store.plane_names(layers, final)
    finals = [p for p in store.FINAL_PLANES["both"] if p not in planes]
    return planes + finals + [attn_stream(i) for i in layers]


def describe(names: Sequence[str]) -> str:
    """The sample metadata that says what its fingerprint tensor holds."""
    return json.dumps({"version": VERSION, "method": "block-sums", "blocks": BLOCKS, "dtype": "F32",
                       "streams": list(names)}, separators=(",", ":"))


def parse(metadata: dict[str, str]) -> Optional[dict]:
    """The fingerprint description of a sample's metadata (None if it has none); ValueError if unusable."""
    raw = metadata.get(META)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        ok = (doc["version"] == VERSION and doc["method"] == "block-sums" and int(doc["blocks"]) == BLOCKS
              and all(isinstance(s, str) for s in doc["streams"]))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"unknown fingerprint description {raw[:200]!r} (written by a newer hs_patch?)")
    return doc


def check_hidden(hidden: int) -> None:
    if hidden % BLOCKS:
        raise ValueError(f"hidden size {hidden} is not a multiple of {BLOCKS}: the capture's fingerprints "
                         "need it (every supported model's is)")


def block_sums(x: "torch.Tensor", out: "Optional[torch.Tensor]" = None) -> "torch.Tensor":
    """Row sums of ``x`` [T, H] over BLOCKS contiguous blocks, fp32 [T, BLOCKS] (into ``out`` if given)."""
    import torch

    with torch.no_grad():  # a record of the forward, never part of a graph
        blocks = x.unflatten(-1, (BLOCKS, x.shape[-1] // BLOCKS))
        if out is None:
            return torch.sum(blocks, dim=-1, dtype=torch.float32)
        return torch.sum(blocks, dim=-1, dtype=torch.float32, out=out)
