"""The SGLang server settings capture needs and refuses: one table for every place that checks.

- inside the server, ``hs_patch.server.checks`` reads the settings the release resolved
  and refuses to start on any rule below (:func:`violations`);
- ``hs-patch check-args -- ARGS...`` (the Ansible role, before it installs the unit) and
  fab's preflight (the unit's command line) check a server command line against the same
  rules (:func:`args_violations`).

Standard library only: imported inside the SGLang server and on the control node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

# What each release needs on the command line with capture on: no radix cache, and the prefill
# CUDA graph off where it is on by default (0.5.10 .. 0.5.13.post1: the piecewise graph, for a
# text model; 0.5.14 on: cuda_graph_config's prefill phase). 0.5.9's piecewise graph is opt-in.
_RADIX = "--disable-radix-cache"
_PIECEWISE_ON = ("0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1")
_PREFILL_GRAPH = ("0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21",
                  "0.5.22", "0.5.23")
REQUIRED_FLAGS = {"0.5.9": [_RADIX], **{v: [_RADIX, "--disable-piecewise-cuda-graph"] for v in _PIECEWISE_ON},
                  **{v: [_RADIX, "--disable-prefill-cuda-graph"] for v in _PREFILL_GRAPH}}


@dataclass(frozen=True)
class Rule:
    setting: str                    # key in hs_patch.server.checks.read_settings()
    flag: str                       # the server flag that sets it
    bad: Callable[[Any], bool]      # True: capture cannot run with this value
    why: str                        # what goes wrong, and what to change


def _on(v: Any) -> bool:
    return bool(v)


def _over_one(v: Any) -> bool:
    return int(v or 1) > 1


RULES = (
    Rule("pp_size", "--pp-size", _over_one, "pipeline parallelism splits the layers over ranks: use --pp-size 1 "
         "(tensor parallelism is supported)"),
    Rule("dp_attention", "--enable-dp-attention", _on, "DP attention scatters tokens over ranks: remove the flag"),
    Rule("attn_dp_size", "--attn-dp-size", _over_one, "attention data parallelism scatters tokens over ranks: use "
         "--attn-dp-size 1"),
    Rule("dwdp_size", "--dwdp-size", _over_one, "DWDP (distributed weight data parallelism) runs MoE prefill outside "
         "the layer path the capture follows: use --dwdp-size 1"),
    Rule("mixed_chunk", "--enable-mixed-chunk", _on, "mixed prefill/decode batches are not captured: remove the flag"),
    Rule("two_batch_overlap", "--enable-two-batch-overlap", _on, "two-batch overlap runs layers outside the captured "
         "loop: remove the flag"),
    Rule("input_scattered", "--enable-attn-tp-input-scattered", _on, "it leaves each rank a slice of the tokens: "
         "remove the flag"),
    Rule("moe_a2a_backend", "--moe-a2a-backend", lambda v: str(v or "none") != "none", "MoE all-to-all backends "
         "scatter tokens over ranks: use --moe-a2a-backend none"),
    Rule("attn_cp_size", "--attn-cp-size", _over_one, "context parallelism splits each sequence over ranks: use "
         "--attn-cp-size 1"),
    Rule("prefill_cp", "--enable-prefill-cp", _on, "prefill context parallelism splits each sequence over ranks: "
         "remove the flag"),
    Rule("nsa_prefill_cp", "--enable-nsa-prefill-context-parallel", _on, "prefill context parallelism splits each "
         "sequence over ranks: remove the flag"),
    Rule("piecewise_graph", "--enable-piecewise-cuda-graph", _on, "prefill CUDA graphs replay without running the "
         "capture hook: remove the flag"),
    Rule("enforce_piecewise", "--enforce-piecewise-cuda-graph", _on, "it forces the prefill CUDA graph on, which "
         "replays without running the capture hook: remove the flag"),
    Rule("prefill_graph_backend", "--cuda-graph-backend-prefill", lambda v: str(v) != "disabled", "a prefill CUDA "
         "graph replays without running the capture hook: remove the flag (--disable-prefill-cuda-graph turns it off)"),
    Rule("deterministic", "--enable-deterministic-inference", _on, "deterministic inference cuts prompts at aligned "
         "positions, so a cut prompt can sit before others in a pass and its next part is not the next to come: "
         "remove the flag"),
    Rule("pdmux", "--enable-pdmux", _on, "prefill-decode multiplexing splits prefill passes (SPLIT_PREFILL), which "
         "are not captured: remove the flag"),
)
FORBIDDEN_FLAGS = tuple(r.flag for r in RULES)


def violations(settings: Mapping[str, Any]) -> list[str]:
    """One line per rule the settings break, each naming the flag to change."""
    return [f"{r.flag}: {r.why}" for r in RULES if r.setting in settings and r.bad(settings[r.setting])]


def parse_args(args: Sequence[str]) -> dict[str, Any]:
    """The settings of :data:`RULES` a server command line sets (flags not given are absent)."""
    by_flag = {r.flag: r for r in RULES}
    out: dict[str, Any] = {}
    items = list(args)
    for i, arg in enumerate(items):
        name, _, inline = arg.partition("=")
        rule = by_flag.get(name)
        if rule is None:
            continue
        takes_value = rule.bad not in (_on,)
        if not takes_value:
            out[rule.setting] = True
        else:
            value = inline if inline else (items[i + 1] if i + 1 < len(items) else "")
            out[rule.setting] = int(value) if value.lstrip("-").isdigit() else value
    return out


def args_violations(args: Sequence[str], release: str | None = None) -> list[str]:
    """What a server command line breaks: forbidden flags, and flags the release needs but lacks."""
    out = violations(parse_args(args))
    given = {a.partition("=")[0] for a in args}
    out += [f"{flag}: capture needs it on SGLang {release}" for flag in REQUIRED_FLAGS.get(release or "", [])
            if flag not in given]
    return out
