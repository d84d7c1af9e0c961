"""Finished samples for tests of what reads them (exporters, fidelity), written like the driver's.

The files are written with :func:`hs_patch.samples.store.write_tensors` and recorded in the
directory's manifest with the hook's metadata keys plus the driver's loss mask and
provenance, so :mod:`hs_patch.samples.reader` reads them exactly as it reads a real run's samples.
States are random bf16 unless ``states`` gives them (e.g. a transformers reference).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from hs_patch.samples import store
from hs_patch.server import fp8 as quantize


def write_finished(directory: Path, ids: Sequence[int], *, layers: Sequence[int] = (2, 30, 58), final: str = "both",
                   hidden: int = 32, seed: int = 0, loss_mask: Optional[Sequence[int]] = None,
                   states: Optional[Callable[[str], torch.Tensor]] = None, shipped: bool = False,
                   meta: Optional[dict] = None, fp8: bool = False) -> store.Written:
    """One finished sample in ``directory`` (``shipped``: under ``samples/`` as at a destination; ``fp8``: its
    planes quantized as HS_CAPTURE_DTYPE=fp8 stores them, format 5, with a scale a token)."""
    t = torch.tensor(list(ids), dtype=torch.int64)
    key = store.sample_key(t)
    planes = store.plane_names(layers, final)
    g = torch.Generator().manual_seed(seed)
    tensors = {"input_ids": t}
    for p in planes:
        tensors[p] = states(p) if states else (torch.randn(len(ids), hidden, generator=g) * 3).to(torch.bfloat16)
    mask = list(loss_mask) if loss_mask is not None else [i % 3 != 0 for i in range(len(ids))]
    tensors["loss_mask"] = torch.tensor(mask, dtype=torch.uint8)
    h = next(iter(tensors[p] for p in planes)).shape[1]
    if fp8:
        for p in planes:
            x = tensors[p]
            tensors[p], tensors[quantize.scale_name(p)] = torch.empty(x.shape, dtype=torch.float8_e4m3fn), \
                torch.empty(x.shape[0])
            quantize.quantize(x, torch.empty_like(x), tensors[p], tensors[quantize.scale_name(p)])
        meta = {"format": store.FORMAT_FP8, "dtype": quantize.DTYPE, quantize.META: quantize.SCHEME,
                quantize.SOURCE_META: "bfloat16", **(meta or {})}
    md = {"format": store.FORMAT, "key": key, "num_tokens": str(len(ids)), "planes": ",".join(planes),
          "layers": ",".join(map(str, layers)), "final": final, "dtype": "bfloat16", "hidden_size": str(h),
          "sglang_release": "0.5.16", "model": "/models/test", "architecture": "DeepseekV3ForCausalLM",
          "tp_size": "1", "rid": f"r-{key[:8]}", "parts": "1", "sample_id": f"data.jsonl:{seed}", "run": "test",
          **(meta or {})}
    where = directory / "samples" if shipped else directory
    w = store.write_tensors(where, key, tensors, md)
    rec = {"op": "add", "key": key, "file": f"samples/{w.path.name}" if shipped else w.path.name,
           "bytes": w.nbytes, "sha256": w.sha256, "tokens": len(ids)}
    store.Manifest(directory).append(rec)
    return w


def write_run(directory: Path, n: int, *, lengths: Sequence[int] = (5, 17, 1, 40, 9, 23), **kw) -> list[str]:
    """``n`` finished samples of varied lengths; their keys."""
    keys = []
    for i in range(n):
        length = lengths[i % len(lengths)]
        ids = [(7 * i + 3 * j + 1) % 500 for j in range(length)]
        keys.append(write_finished(directory, ids, seed=i, **kw).key)
    return keys


def flip_byte(path: Path, at: int, mask: int = 0xFF) -> None:
    """XOR the byte at offset ``at`` of ``path`` with ``mask``, in place: damage on disk or on the wire."""
    data = bytearray(path.read_bytes())
    data[at] ^= mask
    path.write_bytes(bytes(data))
