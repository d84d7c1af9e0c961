"""What every tensor-parallel rank does for the capture, the writing one and the others alike.

Under tensor parallelism each rank holds the full residual stream after the all-reduce, so one
rank writes (:class:`hs_patch.server.hook.CaptureHook`). But a layer's attention output, as the
layer holds it before ``prepare_mlp`` all-reduces it, is each rank's own share, and the
additive relation of the fidelity check needs the whole (:mod:`hs_patch.server.fingerprint`):
every rank fingerprints its share and the fingerprints, [T, 8] fp32 a stream, are summed over
the ranks with SGLang's own all-reduce. So a rank that does not write still begins the same
passes (:func:`capturable`: the same decision from the same batch on every rank, or the
collective would wait forever) and contributes its share (:class:`RankHook`); it allocates two
small device buffers at start and writes nothing.

Standard library and torch only (imported inside the SGLang server).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from hs_patch.server import fingerprint
from hs_patch.server.passes import attention_output

log = logging.getLogger("hs_patch")
HEALTH_CHECK_PREFIX = "HEALTH_CHECK"  # SGLang's /health_generate probes (sglang.srt.constants)


def skipped(rid: Optional[str], prefix: str) -> bool:
    """Requests the hook does not capture: the configured prefix and SGLang's health checks."""
    return rid is not None and (str(rid).startswith(HEALTH_CHECK_PREFIX) or bool(prefix) and str(rid).startswith(prefix))


def capturable(forward_batch: Any, skip_prefix: str) -> bool:
    """Whether a forward pass is captured: a plain prefill pass (never decode), not while a CUDA graph is
    captured or torch.compile traces, with at least one request not skipped. Every rank decides the same
    from the same batch. MIXED and SPLIT_PREFILL passes are refused (the startup checks forbid the flags)."""
    mode = forward_batch.forward_mode
    name = getattr(mode, "name", str(mode))
    if name != "EXTEND":
        if name in ("MIXED", "SPLIT_PREFILL"):
            raise RuntimeError(f"hs_patch: {name} prefill passes cannot be captured; see the startup checks")
        return False
    if torch.compiler.is_compiling() or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return False
    rids = getattr(forward_batch, "rids", None)
    return not (rids is not None and all(skipped(r, skip_prefix) for r in rids))


def tp_all_reduce(tp_size: int) -> Optional[Callable[[torch.Tensor], None]]:
    """Sum a tensor in place over the tensor-parallel ranks with SGLang's own all-reduce (None at TP=1)."""
    if tp_size <= 1:
        return None
    from sglang.srt.distributed import tensor_model_parallel_all_reduce

    def reduce(t: torch.Tensor) -> None:
        out = tensor_model_parallel_all_reduce(t)
        if out is not t:
            t.copy_(out)

    return reduce


class RankHook:
    """A rank that does not write: its share of each captured layer's attention-output fingerprints."""

    def __init__(self, layers: Any, slot_tokens: int, skip_prefix: str, device: torch.device,
                 all_reduce: Callable[[torch.Tensor], None]):
        self.layer_index = {layer: k for k, layer in enumerate(layers)}
        self.skip_prefix, self.all_reduce, self.slot_tokens = skip_prefix, all_reduce, slot_tokens
        self.fp = torch.empty(2, slot_tokens, fingerprint.BLOCKS, dtype=torch.float32, device=device)
        self.device_bytes = self.fp.numel() * 4

    def begin(self, forward_batch: Any, input_ids: Optional[torch.Tensor], embedded: Any = None) -> Optional["RankPass"]:
        if not capturable(forward_batch, self.skip_prefix):
            return None
        ids = input_ids if input_ids is not None else forward_batch.input_ids
        tokens = int(ids.shape[0])
        if tokens > self.slot_tokens:  # the writing rank refuses the pass the same way
            raise RuntimeError(f"hs_patch: a prefill pass of {tokens} tokens exceeds HS_CAPTURE_SLOT_TOKENS "
                               f"({self.slot_tokens}); set it to at least the largest pass and restart")
        return RankPass(self, tokens)


class RankPass:
    def __init__(self, hook: RankHook, tokens: int):
        self.hook, self.tokens = hook, tokens

    def collector(self, layer_id: int, inner: Any) -> Any:
        return inner if layer_id not in self.hook.layer_index else RankTee(self, inner)

    def final_inputs(self, update: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
        return None

    def final_prenorm(self, t: torch.Tensor, owned: bool = False) -> None:
        return None

    def finish(self, post_norm: torch.Tensor) -> None:
        return None


class RankTee:
    """SGLang's collector of a captured layer passed through, and this rank's share of its attention output."""

    __slots__ = ("_pass", "_inner")

    def __init__(self, p: RankPass, inner: Any):
        self._pass, self._inner = p, inner

    def append(self, t: torch.Tensor) -> None:
        if self._inner is not None:
            self._inner.append(t)

    def capture(self, t: torch.Tensor, *, owned: bool = False) -> None:
        if self._inner is not None:
            self._inner.capture(t, owned=owned)

    def hs_attn_input(self, t: torch.Tensor) -> None:
        return None

    def hs_attn_output(self, t: torch.Tensor) -> None:
        hook = self._pass.hook
        attention_output(hook.fp, 0, 1, t, self._pass.tokens, hook.all_reduce)

    def hs_mid(self, t: torch.Tensor) -> None:
        return None

    def __len__(self) -> int:
        return len(self._inner) if self._inner is not None else 0
