"""Which hidden states each SGLang release feeds an EAGLE-3 drafter (standard library only).

Our ``layer.<i>`` is the residual stream entering decoder layer i, which is entry i of
SGLang's ``DeepseekV2Model.layers_to_capture``. A drafter's ``config.json`` names its aux
layers in ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the EAGLE convention: the
OUTPUT of layer i, our ``layer.<i+1>``), and SGLang turns that list into
``layers_to_capture`` in ``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``, read from
each release's wheel:

- 0.5.9 .. 0.5.12.post1: always add 1; 0.5.13 and later: add 1 only when the list starts with 1.
- 0.5.9, 0.5.10, 0.5.10.post1: the CUDA-graph runner calls ``set_eagle3_layers_to_capture()``
  without ids BEFORE capturing its graphs, and the configured ids are set only after
  ``init_device_graphs``: CUDA-graph decode/verify passes feed the DEFAULT layers, eager passes
  the configured ones. From 0.5.11 ``init_aux_hidden_state_capture`` sets the configured ids
  before any graph is captured.
- ``KimiK25ForConditionalGeneration`` has ``set_eagle3_layers_to_capture`` (delegating to its
  language model) from 0.5.10: EAGLE-3 cannot be served on Kimi-K2.5 with 0.5.9.
- no ids in the config: ``[2, n // 2, n - 3]`` (n = ``num_hidden_layers``) on every release.

The hook may import this module (it is in the server's shared set): a sample can say which
ids serve its planes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

KIMI_K25 = "KimiK25ForConditionalGeneration"


@dataclass(frozen=True)
class ServingRule:
    release: str
    plus_one: str             # "always" | "starts_with_1"
    graphs_use_default: bool  # CUDA-graph passes capture the default layers whatever the config
    serves_kimi_k25: bool     # the Kimi-K2.5 wrapper forwards set_eagle3_layers_to_capture


def _rules() -> dict[str, ServingRule]:
    always = ("0.5.9", "0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1")
    later = ("0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19",
             "0.5.20", "0.5.21", "0.5.22", "0.5.23")
    graphs_default = ("0.5.9", "0.5.10", "0.5.10.post1")
    return {v: ServingRule(v, "always" if v in always else "starts_with_1", v in graphs_default, v != "0.5.9")
            for v in always + later}


SERVING_RULES = _rules()


class NotServable(ValueError):
    """No ``eagle_config`` makes this SGLang release feed these planes to a drafter."""


def default_layers(num_layers: int) -> list[int]:
    """SGLang's ``layers_to_capture`` when the drafter config names no ids."""
    return [2, num_layers // 2, num_layers - 3]


def rule(release: str) -> ServingRule:
    r = SERVING_RULES.get(release.split()[0])
    if r is None:
        raise NotServable(f"SGLang {release}: its set_eagle3_layers_to_capture has not been read; the rules of every "
                          f"release from {next(iter(SERVING_RULES))} to {list(SERVING_RULES)[-1]} are known")
    return r


def layers_to_capture(release: str, ids: Sequence[int] | None, num_layers: int | None) -> list[int]:
    """What ``set_eagle3_layers_to_capture(ids)`` of ``release`` sets (eager passes)."""
    if ids is None:
        if num_layers is None:
            raise ValueError("the default layers depend on num_hidden_layers")
        return default_layers(num_layers)
    ids = list(ids)
    if rule(release).plus_one == "always" or (ids and ids[0] == 1):
        return [i + 1 for i in ids]
    return ids


def eagle_ids(release: str, planes: Sequence[int], num_layers: int | None, architecture: str = "",
              *, cuda_graph: bool = True) -> list[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` that make ``release`` feed our ``layer.<p>`` planes.

    Raises :class:`NotServable` saying why when no list does. Without ``num_layers`` the
    checks that need it (range, 0.5.9's CUDA-graph default layers) are skipped.
    """
    r = rule(release)
    planes = list(planes)
    if KIMI_K25 in architecture and not r.serves_kimi_k25:
        raise NotServable(f"SGLang {r.release} cannot serve an EAGLE-3 drafter on Kimi-K2.5: its {KIMI_K25} has no "
                          "set_eagle3_layers_to_capture (0.5.10 and later delegate it to the language model); "
                          "serve on 0.5.10 or later")
    bad = [p for p in planes if not 0 < p < (num_layers or p + 1)]
    if bad or not planes or planes != sorted(set(planes)):
        raise NotServable(f"planes {planes}: SGLang feeds the inputs of layers 1..n-1, ascending and distinct "
                          "(layer.0, the embedding, and the final state are never fed)")
    if num_layers and r.graphs_use_default and cuda_graph and planes != default_layers(num_layers):
        raise NotServable(f"SGLang {r.release} feeds its CUDA-graph decode/verify passes the default layers "
                          f"{default_layers(num_layers)} whatever the drafter config says, but these samples hold "
                          f"{planes}: capture layers {default_layers(num_layers)}, or serve with --disable-cuda-graph")
    for ids in ([p - 1 for p in planes], planes):
        if layers_to_capture(r.release, ids, num_layers) == planes:
            return ids
    raise NotServable(f"SGLang {r.release} cannot feed layers {planes}: an id list starting with 1 gets +1 and any "
                      "other is used as it is, so layer.1 cannot lead; capture another first layer")


def serving_table(planes: Sequence[int], num_layers: int | None, architecture: str = "") -> dict[str, dict[str, object]]:
    """Per known release: the ids that serve these planes, or why none does."""
    out: dict[str, dict[str, object]] = {}
    for release in SERVING_RULES:
        try:
            out[release] = {"eagle_aux_hidden_state_layer_ids": eagle_ids(release, planes, num_layers, architecture)}
        except NotServable as e:
            out[release] = {"refused": str(e)}
    return out
