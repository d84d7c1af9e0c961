"""Prefill passes played into the real capture hook as the patched ``deepseek_v2.py`` plays them.

For tests and benchmarks that drive :class:`hs_patch.server.hook.CaptureHook` without the
SGLang simulation (``lab.sglang_sim``): a forward batch with the fields the hook reads, and
:func:`play`, which hands the hook the embedded rows, every captured layer's residual, what its
attention read and output and the residual after it, the final norm's input and output, in the
patch's order.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import torch

from hs_patch.host.model_files import rms_norm


class _Mode:
    name = "EXTEND"


class Batch:
    """The fields of SGLang's ForwardBatch the hook reads: one prefill pass of requests."""

    def __init__(self, lens: Sequence[int], prefix: Optional[Sequence[int]] = None,
                 full: Optional[Sequence[int]] = None, rids: Optional[Sequence[str]] = None):
        self.forward_mode = _Mode()
        self.extend_seq_lens_cpu = list(lens)
        self.extend_prefix_lens_cpu = list(prefix) if prefix is not None else [0] * len(lens)
        self.orig_seq_lens = list(full) if full is not None else list(lens)
        if rids is not None:
            self.rids = list(rids)


def attention_input(x: torch.Tensor) -> torch.Tensor:
    """What a layer whose input norm weight is all ones reads: ``x`` normalised (as the check derives it)."""
    return rms_norm(x, torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), 1e-6)


def play(hook: Any, batch: Batch, ids: torch.Tensor, layers: Mapping[int, torch.Tensor], pre: torch.Tensor,
         post: torch.Tensor, *, owned: bool = False, embedded: Optional[torch.Tensor] = None,
         attn_out: Optional[Mapping[int, torch.Tensor]] = None) -> None:
    """One pass: ``layers[i]`` is the residual entering layer i for every captured i (its attention
    reads it normalised with weight one, and outputs ``attn_out[i]``, zeros if not given: the residual
    after it is their bf16 sum); ``pre``/``post`` the final norm's input and output; ``embedded`` the
    rows the residual stream began from (default: the first captured layer's)."""
    first = layers[hook.cfg.layers[0]]
    p = hook.begin(batch, ids, first if embedded is None else embedded)
    for i in hook.cfg.layers:
        tee = p.collector(i, None)
        tee.capture(layers[i], owned=owned)
        tee.hs_attn_input(attention_input(layers[i]))
        out = torch.zeros_like(layers[i]) if attn_out is None else attn_out[i]
        tee.hs_attn_output(out)
        tee.hs_mid(layers[i] + out)
    p.final_inputs(pre, None)  # a last layer whose output is the whole pre-norm state
    p.final_prenorm(pre, owned=owned)
    p.finish(post)
