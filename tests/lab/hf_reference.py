"""Per-layer states of one request from a transformers DeepseekV3, for fidelity checks.

Used by the CPU harness (``sglang_sim``) and by the GPU proof (``tests/gpu/proof.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

@dataclass
class Reference:
    """Per-token values of one request from the transformers model, by layer."""

    ids: torch.Tensor                 # [L]
    layer_in: list[torch.Tensor]      # n_layers x [L, H]: residual stream entering layer i
    attn_out: list[torch.Tensor]      # n_layers x [L, H]
    mlp_out: list[torch.Tensor]       # n_layers x [L, H]
    pre_norm: torch.Tensor            # [L, H]
    post_norm: torch.Tensor           # [L, H]


def reference(model: Any, ids: list[int]) -> Reference:
    """Run ``model`` (a transformers DeepseekV3ForCausalLM) on one request and record, per
    layer, its input (the residual stream entering it), its attention and MLP outputs, and
    the final norm's input and output. Tensors are on the model's device."""
    inner = model.model
    n = len(inner.layers)
    rec: dict[str, list] = {"in": [None] * n, "attn": [None] * n, "mlp": [None] * n}
    hooks = []
    for i, layer in enumerate(inner.layers):
        hooks.append(layer.register_forward_pre_hook(
            lambda m, args, kwargs, i=i: rec["in"].__setitem__(i, (args[0] if args else kwargs["hidden_states"])[0].clone()),
            with_kwargs=True))
        hooks.append(layer.self_attn.register_forward_hook(
            lambda m, a, out, i=i: rec["attn"].__setitem__(i, out[0][0].clone())))
        hooks.append(layer.mlp.register_forward_hook(
            lambda m, a, out, i=i: rec["mlp"].__setitem__(i, out[0].clone())))
    norm: dict[str, torch.Tensor] = {}
    hooks.append(inner.norm.register_forward_hook(
        lambda m, a, out: norm.update(pre=a[0][0].clone(), post=out[0].clone())))
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return Reference(torch.tensor(ids, dtype=torch.int64, device=model.device), rec["in"], rec["attn"], rec["mlp"],
                     norm["pre"], norm["post"])
