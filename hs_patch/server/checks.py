"""Which SGLang server settings the capture hook supports, checked once at model build.

``read_settings`` runs inside the SGLang process and reads the settings in effect
through whichever accessor the release has; ``refusals`` is pure and says, for each
unsupported setting, what to change. The patched server refuses to start with capture
on rather than produce a sample that is silently partial, misaligned or missing.
"""

from __future__ import annotations

from typing import Any, Mapping

from hs_patch.flags import REQUIRED_FLAGS  # noqa: F401  (re-exported: what refusals asks for)


def _server_args() -> Any:
    try:  # 0.5.16 and later
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except ImportError:  # 0.5.9
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()


def _prefill_graph(args: Any) -> str:
    """The prefill CUDA-graph backend in effect ('disabled' when prefill runs eagerly)."""
    try:
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
    except ImportError:  # 0.5.9: only the opt-in piecewise graph exists
        return "piecewise" if getattr(args, "enable_piecewise_cuda_graph", False) else "disabled"
    for backend in Backend.ALL:
        if backend != Backend.DISABLED and check_cuda_graph_backend(Phase.PREFILL, backend):
            return str(backend)
    return "disabled"


def read_settings() -> dict[str, Any]:
    """The settings ``refusals`` looks at, read inside the SGLang server process."""
    from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    args = _server_args()
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    return {
        "tp_rank": get_tensor_model_parallel_rank(),
        "tp_size": get_tensor_model_parallel_world_size(),
        "pp_size": int(get("pp_size", 1) or 1),
        "dp_attention": bool(get("enable_dp_attention", False)),
        "radix_cache": not bool(get("disable_radix_cache", False)),
        "prefill_graph": _prefill_graph(args),
        "mixed_chunk": bool(get("enable_mixed_chunk", False)),
        "two_batch_overlap": bool(get("enable_two_batch_overlap", False)),
        "input_scattered": bool(get("enable_attn_tp_input_scattered", False)),
        "moe_a2a_backend": str(get("moe_a2a_backend", "none") or "none"),
        "context_parallel": bool(get("enable_prefill_cp", False) or get("enable_nsa_prefill_context_parallel", False)
                                 or int(get("attn_cp_size", 1) or 1) > 1),
        "chunked_prefill_size": get("chunked_prefill_size"),
    }


def refusals(s: Mapping[str, Any]) -> list[str]:
    """One line per unsupported setting, each saying which server flag to change."""
    out = []
    if s.get("pp_size", 1) > 1:
        out.append("pipeline parallelism (--pp-size > 1) splits the layers over ranks: use --pp-size 1 "
                   "(tensor parallelism is supported)")
    if s.get("dp_attention"):
        out.append("DP attention (--enable-dp-attention) scatters tokens over ranks: remove the flag")
    if s.get("radix_cache"):
        out.append("the radix cache skips cached prefixes, so their states are never computed: "
                   "add --disable-radix-cache")
    if s.get("prefill_graph", "disabled") != "disabled":
        out.append(f"prefill CUDA graphs ({s['prefill_graph']}) replay without running the capture hook: "
                   "add --disable-prefill-cuda-graph (0.5.16+) or remove --enable-piecewise-cuda-graph (0.5.9)")
    if s.get("mixed_chunk"):
        out.append("mixed prefill/decode batches (--enable-mixed-chunk) are not captured: remove the flag")
    if s.get("two_batch_overlap"):
        out.append("two-batch overlap (--enable-two-batch-overlap) runs layers outside the captured loop: "
                   "remove the flag")
    if s.get("input_scattered"):
        out.append("--enable-attn-tp-input-scattered leaves each rank a slice of the tokens: remove the flag")
    if s.get("moe_a2a_backend", "none") != "none":
        out.append(f"--moe-a2a-backend {s['moe_a2a_backend']} is not supported: use --moe-a2a-backend none")
    if s.get("context_parallel"):
        out.append("prefill context parallelism splits each sequence over ranks: remove the context-parallel flags")
    return out
