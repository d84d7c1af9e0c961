"""Read a served model's config and single tensors BY NAME from its directory.

Only the named tensors are read (``safe_open`` maps the shard and copies one tensor), so
Kimi-K2.5's LM head (163,840 x 7,168 bf16, 2.3 GB) comes out of a ~600 GB checkpoint in
seconds. The shard is found through ``model.safetensors.index.json`` (``weight_map``), or
a single ``model.safetensors``.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

# where the LM head and final norm sit: DeepseekV3 (and most HF decoders), then wrappers
# such as KimiK25ForConditionalGeneration (language_model = a DeepseekV3ForCausalLM)
LM_HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")
NORM_NAMES = ("model.norm.weight", "language_model.model.norm.weight", "model.language_model.norm.weight")


class ModelFileError(RuntimeError):
    """The model directory lacks what was asked, or holds it in a form we cannot use."""


@dataclass(frozen=True)
class ModelInfo:
    directory: Path
    architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    rms_norm_eps: float


def model_info(directory: str | Path) -> ModelInfo:
    """The text model's shape from ``config.json`` (a wrapper's ``text_config`` when there is one)."""
    directory = Path(directory)
    try:
        cfg = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelFileError(f"{directory}/config.json: {e}: give the served model's directory") from None
    text = cfg.get("text_config") or cfg
    try:
        return ModelInfo(directory, ",".join(cfg.get("architectures") or []), int(text["num_hidden_layers"]),
                         int(text["hidden_size"]), int(text["vocab_size"]), float(text.get("rms_norm_eps", 1e-6)))
    except (KeyError, TypeError, ValueError) as e:
        raise ModelFileError(f"{directory}/config.json lacks {e} (num_hidden_layers, hidden_size, vocab_size)") from None


def weight_map(directory: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name."""
    directory = Path(directory)
    index = sorted(directory.glob("*.safetensors.index.json"))
    if len(index) > 1:
        raise ModelFileError(f"{directory}: several safetensors indexes {[p.name for p in index]}")
    if index:
        try:
            return dict(json.loads(index[0].read_text())["weight_map"])
        except (OSError, ValueError, KeyError) as e:
            raise ModelFileError(f"{index[0]}: unreadable index ({e})") from None
    single = directory / "model.safetensors"
    if not single.is_file():
        raise ModelFileError(f"{directory}: no model.safetensors.index.json and no model.safetensors")
    from safetensors import safe_open

    with safe_open(str(single), "numpy") as f:  # the header only ("numpy": no torch import for a listing)
        return {name: single.name for name in f.keys()}


def find_name(directory: str | Path, candidates: Sequence[str], what: str) -> str:
    names = weight_map(directory)
    for name in candidates:
        if name in names:
            return name
    raise ModelFileError(f"{directory}: no {what} among {list(candidates)}; the checkpoint has e.g. "
                         f"{sorted(names)[:5]}")


@contextmanager
def _shard_of(directory: str | Path, name: str, framework: str) -> Iterator[Any]:
    """The open shard that holds tensor ``name`` (``safe_open``); ModelFileError when it cannot be read."""
    from safetensors import SafetensorError, safe_open

    directory = Path(directory)
    shard = weight_map(directory).get(name)
    if shard is None:
        raise ModelFileError(f"{directory}: no tensor {name!r}")
    try:
        with safe_open(str(directory / shard), framework) as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise ModelFileError(f"{directory / shard}: cannot read {name!r} ({e})") from None


def read_tensor(directory: str | Path, name: str) -> "torch.Tensor":
    """One tensor by name, and nothing else of the checkpoint."""
    with _shard_of(directory, name, "pt") as f:
        t = f.get_tensor(name)
    if not t.is_floating_point():
        raise ModelFileError(f"{name!r} is {t.dtype} (quantized?): the check needs a floating-point tensor")
    return t


def tensor_shape(directory: str | Path, name: str) -> tuple[tuple[int, ...], str]:
    """(shape, safetensors dtype such as ``BF16``) of one tensor, from its shard's header: nothing is read
    (``numpy``: no torch import for it)."""
    with _shard_of(directory, name, "numpy") as f:
        s = f.get_slice(name)
        return tuple(s.get_shape()), str(s.get_dtype())


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")


def check_head_and_norm(directory: str | Path) -> ModelInfo:
    """What :func:`head_and_norm` refuses, from the headers alone (names, shapes, floating-point dtypes): a
    run is refused at once, before the tensors are read (the driver reads them after its first request)."""
    info = model_info(directory)
    shapes = []
    for what, names in (("LM head", LM_HEAD_NAMES), ("final norm weight", NORM_NAMES)):
        name = find_name(directory, names, what)
        shape, dtype = tensor_shape(directory, name)
        if dtype not in FLOAT_DTYPES:
            raise ModelFileError(f"{name!r} is {dtype} (quantized?): the check needs a floating-point tensor")
        shapes.append(shape)
    _fits(directory, *shapes, info)
    return info


def _fits(directory: str | Path, head: Sequence[int], norm: Sequence[int], info: ModelInfo) -> None:
    if tuple(norm) != (info.hidden_size,) or len(head) != 2 or head[1] != info.hidden_size:
        raise ModelFileError(f"{directory}: LM head {tuple(head)} / norm {tuple(norm)} do not fit "
                             f"hidden size {info.hidden_size}")


def head_and_norm(directory: str | Path) -> tuple["torch.Tensor", "torch.Tensor", ModelInfo]:
    """(lm_head weight [V, H], final norm weight [H], model info), read by name."""
    info = model_info(directory)
    head = read_tensor(directory, find_name(directory, LM_HEAD_NAMES, "LM head"))
    norm = read_tensor(directory, find_name(directory, NORM_NAMES, "final norm weight"))
    _fits(directory, head.shape, norm.shape, info)
    return head, norm, info


def input_norm(directory: str | Path, layer: int) -> "torch.Tensor":
    """Decoder layer ``layer``'s input norm weight [H] (what it normalises its attention's input with)."""
    names = [n.replace("norm.weight", f"layers.{layer}.input_layernorm.weight") for n in NORM_NAMES]
    weight = read_tensor(directory, find_name(directory, names, f"layer {layer}'s input norm weight"))
    if weight.dim() != 1:
        raise ModelFileError(f"{directory}: layer {layer}'s input norm weight has shape {tuple(weight.shape)}")
    return weight


def rms_norm(x: "torch.Tensor", weight: "torch.Tensor", eps: float) -> "torch.Tensor":
    """The final RMSNorm in fp32 with one rounding to ``x``'s dtype (as SGLang's fused kernel does).

    Used to derive ``final.post_norm`` from a stored ``final.pre_norm``; its measured gap
    to the server's own fused norm is in docs/training.md.
    """
    import torch

    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)


def info_dict(info: ModelInfo) -> dict[str, Any]:
    return {"architecture": info.architecture, "num_hidden_layers": info.num_hidden_layers,
            "hidden_size": info.hidden_size, "vocab_size": info.vocab_size}
