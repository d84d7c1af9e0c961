"""Does the running SGLang server's KV cache hold the longest sample extraction sends? (standard library only)

SGLang sizes its KV cache pool at start: what ``--mem-fraction-static`` leaves of each GPU after
the weights, less what its CUDA graphs take. ``/server_info`` (and the older ``/get_server_info``;
the same scheduler fields in 0.5.9, 0.5.16 and 0.5.23) reports it as ``max_total_num_tokens``,
and the server cuts ``max_req_input_len`` to it: a pool smaller than a sample means every longer
sample is rejected as too long. On Kimi-K2.5 at TP 8 on a 97,887 MiB card that is no corner case
(SGLang 0.5.9's own memory choice leaves ~17K tokens: docs/deployment.md, "sglang_service"), so
``fab extract`` checks it after starting the server and ``hs-extract drive`` at its start, and
both refuse with what to change instead of a run that skips its long samples.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional


def _int(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def shortfall(info: Mapping[str, Any], max_tokens: int,
              shorter: str = "hs-extract drive --max-tokens", service: Optional[str] = None) -> Optional[str]:
    """What to do when the KV pool cannot hold the longest sample sent (``max_tokens``, or the
    server's ``context_length`` when that is shorter) with its one new token; None when it can,
    or when the server does not say. ``shorter``: the option the reader gives for shorter samples
    (``fab extract --max-tokens`` on the control node); ``service``: the server's systemd unit
    (the host's ``sglang_service_name``) when the reader knows it."""
    pool = _int(info.get("max_total_num_tokens"))
    if pool is None:
        return None
    context = _int(info.get("context_length"))
    longest = min(max_tokens, context - 2) if context and context > 2 else max_tokens
    if pool >= longest + 1:
        return None
    fraction = info.get("mem_fraction_static")
    restart = f"systemctl restart {service}" if service else "systemctl restart UNIT, the host's sglang_service_name"
    return (f"the server's KV cache holds {pool} tokens (max_total_num_tokens), fewer than the {longest + 1} of the "
            f"longest sample the driver sends ({longest} tokens, --max-tokens {max_tokens}, and one new token): every "
            "longer sample would be rejected as too long. Give the KV cache more of the GPUs' memory: raise "
            f"sglang_service_mem_fraction_static (now {fraction if fraction is not None else 'unknown'}) or lower "
            "sglang_service_cuda_graph_max_bs, run ansible-playbook site.yml --tags services and restart the server "
            f"({restart}); or send shorter samples ({shorter} {max(pool - 1, 1)})")
