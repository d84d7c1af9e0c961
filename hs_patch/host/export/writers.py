"""Write one exported sample: a SpecForge ``.ckpt`` or a speculators ``hs_<row>.safetensors``.

Each file is written under ``<dst>/.tmp/``, hashed while it is written, fsynced and renamed
into place, so a trainer (or a re-run) never sees a partial file under its final name.
Memory per call: the sample's planes once plus one output plane (each plane is copied into
the output and dropped), never the whole dataset.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Sequence

from hs_patch.samples import store
from hs_patch.samples.lazy_sample import LazySample

if TYPE_CHECKING:  # pragma: no cover
    import torch

TOKEN_CHUNK = 2048   # tokens per fp32 working block (rms norm, fp8 quantization)
FP8_SCALES_KEY = "hidden_states_scales"   # hs_connectors.fp8_utils.SCALES_KEY


@dataclass
class Out:
    file: str       # relative to the export's root
    nbytes: int
    sha256: str


class _Hashing:
    """A binary file that hashes what is written through it (torch.save writes sequentially)."""

    def __init__(self, f: BinaryIO):
        self.f, self.h, self.n = f, hashlib.sha256(), 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.h.update(view)
        self.f.write(view)   # a buffered file writes it all or raises (ENOSPC, EIO)
        self.n += len(view)
        return len(view)

    def flush(self) -> None:
        self.f.flush()


def _tmp(root: Path, name: str) -> Path:
    d = root / store.TMPDIR
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{Path(name).name}.{os.getpid()}.{threading.get_ident()}.tmp"


def _publish(tmp: Path, final: Path) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, final)


def stack_planes(sample: LazySample, names: Sequence[str], *, layout: str) -> "torch.Tensor":
    """Planes side by side: ``concat`` -> [L, K*H] (SpecForge), ``stack`` -> [L, K, H] (speculators)."""
    import torch

    first = sample.tensor(names[0])
    n, h = first.shape
    out = torch.empty((n, len(names), h), dtype=first.dtype)
    out[:, 0].copy_(first)
    del first
    for k, name in enumerate(names[1:], 1):
        out[:, k].copy_(sample.tensor(name))
    return out.view(n, len(names) * h) if layout == "concat" else out


def post_norm_from_pre(pre: "torch.Tensor", weight: "torch.Tensor", eps: float) -> "torch.Tensor":
    """``final.post_norm`` derived from ``final.pre_norm`` with the model's norm weight, in blocks."""
    import torch

    from hs_patch.host.model_files import rms_norm

    out = torch.empty_like(pre)
    for s in range(0, pre.shape[0], TOKEN_CHUNK):
        out[s:s + TOKEN_CHUNK] = rms_norm(pre[s:s + TOKEN_CHUNK], weight, eps)
    return out


def write_specforge(root: Path, rel: str, sample: LazySample, aux: Sequence[str], final: "torch.Tensor",
                    *, fsync: bool = True) -> Out:
    """``torch.save`` of SpecForge's offline dict: input_ids, loss_mask (int64 [L]),
    hidden_state [1, L, H] (post-norm final), aux_hidden_state [1, L, 3H] (aux planes concatenated)."""
    import torch

    n = sample.num_tokens
    record = {
        "input_ids": sample.tensor("input_ids"),
        "loss_mask": sample.tensor("loss_mask").to(torch.int64),
        "hidden_state": final.reshape(1, n, -1),
        "aux_hidden_state": stack_planes(sample, aux, layout="concat").reshape(1, n, -1),
    }
    tmp = _tmp(root, rel)
    try:
        with open(tmp, "wb") as f:
            hf = _Hashing(f)
            torch.save(record, hf)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        if tmp.stat().st_size != hf.n:
            raise OSError(f"{tmp}: {tmp.stat().st_size} bytes on disk, {hf.n} written")
        _publish(tmp, root / rel)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return Out(rel, hf.n, hf.h.hexdigest())


def quantize_fp8(x: "torch.Tensor") -> tuple["torch.Tensor", "torch.Tensor"]:
    """hs_connectors' ``quantize_tensor_to_fp8`` (fp8_utils.py of hs-connectors 0.9.0), in token blocks.

    One fp32 scale per token over all other dims: ``scale = clamp(amax / 448, 1e-12)``,
    ``fp8 = (x.float() / scale).to(float8_e4m3fn)``; the scale has shape [L, 1, ..., 1].
    Per-token work, so blocks give the same bits as the whole tensor at once.
    """
    import torch

    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    dims = tuple(range(1, x.dim()))
    q = torch.empty(x.shape, dtype=fp8)
    scale = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), dtype=torch.float32)
    for s in range(0, x.shape[0], TOKEN_CHUNK):
        xf = x[s:s + TOKEN_CHUNK].float()
        sc = (xf.abs().amax(dim=dims, keepdim=True) / fmax).clamp(min=1e-12)
        scale[s:s + TOKEN_CHUNK] = sc
        q[s:s + TOKEN_CHUNK] = (xf / sc).to(fp8)
    return q, scale


def write_speculators(root: Path, rel: str, sample: LazySample, planes: Sequence[str], *, fp8: bool,
                      fsync: bool = True) -> Out:
    """speculators' ``hs_<row>.safetensors``: token_ids int64 [L], hidden_states [L, K, H] (aux layers
    ascending, then the pre-norm final state); with ``fp8`` also ``hidden_states_scales`` fp32 [L, 1, 1]."""
    stacked = stack_planes(sample, planes, layout="stack")
    tensors = {"token_ids": sample.tensor("input_ids")}
    if fp8:
        tensors["hidden_states"], tensors[FP8_SCALES_KEY] = quantize_fp8(stacked)
        del stacked
    else:
        tensors["hidden_states"] = stacked
    path = root / rel
    w = store.write_tensors(path.parent, path.name[: -len(store.SUFFIX)], tensors, {}, fsync=fsync)
    return Out(rel, w.nbytes, w.sha256)
