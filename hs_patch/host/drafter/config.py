"""``hs-extract drafter-config``: the ``eagle_config`` a drafter is served with.

The block makes the SGLang release the drafter will be served on feed it exactly the planes
it was trained on (rules per release in :mod:`hs_patch.engine.serving`). The planes come from an
export (``export.json``), a samples directory (a sample's header) or ``--layers``; the
model's depth and architecture from ``--model`` or the export.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

from hs_patch.engine import serving
from hs_patch.samples import store

DESCRIPTION = """\
Print (or write into a drafter's config.json) the eagle_config block that makes an SGLang
release feed the drafter the hidden states it was trained on:

  {"eagle_config": {"use_aux_hidden_state": true, "eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}

Our layer.<i> is the residual stream entering layer i; SGLang turns the ids into the layers
it captures differently per release (0.5.9 .. 0.5.12.post1: always +1; 0.5.13 on: +1 only
when the list starts with 1). 0.5.9 .. 0.5.10.post1 also feed their CUDA-graph passes the
default layers [2, n//2, n-3] whatever the config, and 0.5.9 cannot serve EAGLE-3 on
Kimi-K2.5 at all: those cases are refused with why (docs/training.md has the table).

exit codes: 0 ok; 1 error; 2 refused (no config serves these planes on that release)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--serve-release", required=True, choices=list(serving.SERVING_RULES),
                   help="the SGLang release the drafter will be served on")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--export", metavar="DST", help="an hs-extract export directory (its export.json)")
    src.add_argument("--samples", metavar="DIR", help="a samples directory or shipped run (a sample's header)")
    src.add_argument("--layers", metavar="I,J,K", help="the planes layer.<i> the drafter was trained on")
    p.add_argument("--model", metavar="DIR", help="the served model's directory (num_hidden_layers, architecture)")
    p.add_argument("--num-layers", type=int, metavar="N", help="num_hidden_layers, without --model")
    p.add_argument("--architecture", default="", metavar="NAME", help="e.g. KimiK25ForConditionalGeneration, "
                   "without --model")
    p.add_argument("--disable-cuda-graph", action="store_true", help="the server runs with --disable-cuda-graph "
                   "(0.5.9 then feeds the configured layers in every pass)")
    p.add_argument("--into", metavar="CONFIG_JSON", help="set eagle_config in this drafter config.json "
                   "(rewritten atomically, every other key kept)")


def planes_of(a: argparse.Namespace) -> tuple[list[int], dict[str, Any]]:
    """(planes, what the source says about the model)."""
    if a.layers is not None:
        try:
            planes = [int(x) for x in a.layers.replace(" ", "").split(",") if x]
        except ValueError:
            planes = []
        if not planes:
            raise ValueError(f"--layers {a.layers!r}: give the planes as comma-separated layer numbers, e.g. 2,30,58")
        return planes, {}
    if a.export:
        from hs_patch.host.export import layout

        info = layout.read_info(Path(a.export))
        if not info:
            raise SystemExit(f"{a.export}: no export.json (is it an hs-extract export?)")
        return list(info["identity"]["layers"]), dict(info.get("serving") or {})
    from hs_patch.host.export.run import first_metadata

    entries = store.read_manifest(a.samples)
    if not entries:
        raise SystemExit(f"{a.samples}: no samples in {store.MANIFEST}")
    meta = first_metadata(Path(a.samples), entries)  # a damaged sample is not this command's business
    return [int(x) for x in meta.get("layers", "").split(",") if x], {"architecture": meta.get("architecture", ""),
                                                                       **({"num_hidden_layers": meta["num_hidden_layers"]}
                                                                          if "num_hidden_layers" in meta else {})}


def eagle_config(release: str, planes: list[int], num_layers: int, architecture: str,
                 *, cuda_graph: bool = True) -> dict[str, Any]:
    ids = serving.eagle_ids(release, planes, num_layers, architecture, cuda_graph=cuda_graph)
    return {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": ids}


def run_args(a: argparse.Namespace) -> int:
    try:
        planes, known = planes_of(a)
        n: Optional[int] = a.num_layers or known.get("num_hidden_layers")
        arch = a.architecture or known.get("architecture", "")
        if a.model:
            from hs_patch.host.model_files import model_info

            info = model_info(a.model)
            n, arch = info.num_hidden_layers, info.architecture
        if n is None:
            raise SystemExit("give --model DIR or --num-layers N (the served model's num_hidden_layers)")
        block = eagle_config(a.serve_release, planes, int(n), arch, cuda_graph=not a.disable_cuda_graph)
    except serving.NotServable as e:
        print(f"hs-extract drafter-config: refused: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError, RuntimeError) as e:
        print(f"hs-extract drafter-config: {e}", file=sys.stderr)
        return 1
    if a.into:
        path = Path(a.into)
        try:
            cfg = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"hs-extract drafter-config: {path}: {e}", file=sys.stderr)
            return 1
        if not isinstance(cfg, dict) or not isinstance(cfg.get("eagle_config") or {}, dict):
            print(f"hs-extract drafter-config: {path} is not a drafter config.json (a JSON object whose eagle_config, "
                  "if any, is an object): give the config.json of the exported drafter", file=sys.stderr)
            return 1
        cfg["eagle_config"] = {**(cfg.get("eagle_config") or {}), **block}
        store.write_text_atomic(path, json.dumps(cfg, indent=2) + "\n")
    print(json.dumps({"eagle_config": block}))
    print(f"serves layer.{'/'.join(map(str, planes))} on SGLang {a.serve_release} "
          f"(layers_to_capture {serving.layers_to_capture(a.serve_release, block['eagle_aux_hidden_state_layer_ids'], int(n))})",
          file=sys.stderr)
    return 0
