"""Which SGLang server settings the capture hook supports, checked once at model build.

``read_settings`` runs inside the SGLang process and reads the settings in effect
through whichever accessor the release has; ``refusals`` is pure and says, for each
unsupported setting, what to change. The patched server refuses to start with capture
on rather than produce a sample that is silently partial, misaligned or missing.
"""

from __future__ import annotations

from typing import Any, Mapping

from hs_patch.engine.flags import violations


def _server_args() -> Any:
    try:  # 0.5.15 and later
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except ImportError:  # 0.5.9 .. 0.5.14
        from sglang.srt.server_args import get_global_server_args

        return get_global_server_args()


def _prefill_graph(args: Any) -> str:
    """The prefill CUDA-graph backend in effect ('disabled' when prefill runs eagerly)."""
    try:
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend
    except ImportError:  # 0.5.9 .. 0.5.13.post1: the piecewise prefill graph is the only one
        if hasattr(args, "disable_piecewise_cuda_graph"):  # 0.5.10 on: on by default, resolved in place
            return "disabled" if args.disable_piecewise_cuda_graph else "piecewise"
        return "piecewise" if getattr(args, "enable_piecewise_cuda_graph", False) else "disabled"
    for backend in Backend.ALL:
        if backend != Backend.DISABLED and check_cuda_graph_backend(Phase.PREFILL, backend):
            return str(backend)
    return "disabled"


def _getter(args: Any) -> Any:
    """Read a setting as the release resolved it: 0.5.19 on keep raw input on the record and
    the resolved values apart (from 0.5.22 the deprecated ``enable_dp_attention`` stays false
    while ``--attn-dp-size`` turns attention DP on), earlier releases resolve in place."""
    if hasattr(args, "resolved_dict"):
        resolved = args.resolved_dict()
        return lambda name, default=None: resolved.get(name, getattr(args, name, default))
    return lambda name, default=None: getattr(args, name, default)


def read_settings() -> dict[str, Any]:
    """The settings ``refusals`` looks at, read inside the SGLang server process."""
    from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    args = _server_args()
    get = _getter(args)
    return {
        "tp_rank": get_tensor_model_parallel_rank(),
        "tp_size": get_tensor_model_parallel_world_size(),
        "pp_size": int(get("pp_size", 1) or 1),
        "dp_attention": bool(get("enable_dp_attention", False)),
        "attn_dp_size": int(get("attn_dp_size", 1) or 1),
        "dwdp_size": int(get("dwdp_size", 1) or 1),
        "radix_cache": not bool(get("disable_radix_cache", False)),
        "prefill_graph": _prefill_graph(args),
        "mixed_chunk": bool(get("enable_mixed_chunk", False)),
        "two_batch_overlap": bool(get("enable_two_batch_overlap", False)),
        "input_scattered": bool(get("enable_attn_tp_input_scattered", False)),
        "moe_a2a_backend": str(get("moe_a2a_backend", "none") or "none"),
        "attn_cp_size": int(get("attn_cp_size", 1) or 1),
        "prefill_cp": bool(get("enable_prefill_cp", False)),
        "nsa_prefill_cp": bool(get("enable_nsa_prefill_context_parallel", False)),
        "deterministic": bool(get("enable_deterministic_inference", False)),
        "pdmux": bool(get("enable_pdmux", False)),
        "chunked_prefill_size": get("chunked_prefill_size"),
        "watchdog_timeout": float(get("watchdog_timeout", 300) or 300),
    }


def refusals(s: Mapping[str, Any]) -> list[str]:
    """One line per unsupported setting, each saying which server flag to change."""
    out = []
    if s.get("radix_cache"):
        out.append("the radix cache skips cached prefixes, so their states are never computed: "
                   "add --disable-radix-cache")
    if s.get("prefill_graph", "disabled") != "disabled":
        out.append(f"prefill CUDA graphs ({s['prefill_graph']}) replay without running the capture hook: "
                   "add --disable-prefill-cuda-graph (0.5.14 and later) or --disable-piecewise-cuda-graph (0.5.10 .. "
                   "0.5.13.post1), or remove --enable-piecewise-cuda-graph (0.5.9)")
    return out + violations(s)


def capture_refusals(cfg: Any, s: Mapping[str, Any]) -> list[str]:
    """What the HS_CAPTURE_* settings cannot do with this server, each saying what to set."""
    out = []
    if cfg.rank >= int(s.get("tp_size", 1)):
        out.append(f"HS_CAPTURE_RANK={cfg.rank}, but the server has {s.get('tp_size', 1)} tensor-parallel ranks "
                   f"(0..{int(s.get('tp_size', 1)) - 1}): no rank would write; use HS_CAPTURE_RANK=0")
    chunk = s.get("chunked_prefill_size")
    chunk = int(chunk) if chunk not in (None, "") else -1
    if not cfg.slot_tokens and chunk <= 0:
        out.append("chunked prefill is off (--chunked-prefill-size -1), so one pass can hold any prompt: set "
                   "--chunked-prefill-size N (e.g. 8192), or HS_CAPTURE_SLOT_TOKENS to the largest pass")
    elif cfg.slot_tokens and 0 < chunk and cfg.slot_tokens < chunk:
        out.append(f"HS_CAPTURE_SLOT_TOKENS={cfg.slot_tokens} is below --chunked-prefill-size {chunk}: a pass would "
                   "not fit its staging buffer; unset HS_CAPTURE_SLOT_TOKENS or raise it")
    watchdog = float(s.get("watchdog_timeout", 300) or 300)
    if cfg.stall_seconds >= watchdog:
        out.append(f"HS_CAPTURE_STALL_SECONDS={cfg.stall_seconds:g} is not below SGLang's --watchdog-timeout "
                   f"{watchdog:g}: the watchdog would kill the server first, without saying why; lower it")
    return out
