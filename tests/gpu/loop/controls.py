"""The controls: ours with one thing changed, each a mistake a pipeline can make, each expected to
accept worse. Made from our export (``ours``: aux planes layer.2,4,5 of an 8-layer target) and our
samples, which the loop captures with more layers (1..6) than ours trains on, so every control is
the same server's states of the same tokens, sample by sample (same file names as ours):

- ``shuffled``: the aux planes' rows permuted across positions within each sample (one permutation
  for the three planes, seeded by the file name): states that belong to other tokens;
- ``zeroed``: the aux planes all zero: a drafter with no target states;
- ``late``: every aux plane one layer late (layer.3,5,6): an off-by-one in the layer convention;
- ``partial``: layer.<i-1> + (layer.<i> - layer.<i-1>) / 2 for each aux plane: the layer's input plus
  half its update, what one of two tensor-parallel ranks holds before the all-reduce;
- ``scaled``: the middle aux plane times 2 (a plane summed twice: an all-reduce over a replicated tensor);
- ``prenorm``: ``final.pre_norm`` as SpecForge's teacher state where it wants the post-norm state.

Each control is written file by file (atomic), in a process of its own (``make_all``).
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from loop import features

CONTROLS = ("shuffled", "zeroed", "late", "partial", "scaled", "prenorm")


def seeds_for(spec: str, kind: str) -> int:
    """Trainings of control ``kind`` by ``--control-seeds``: ``N`` for every control, or ``kind:N,...``
    (a control not named gets 1), so one control's verdict can get seeds without the others'."""
    spec = str(spec).strip()
    if spec.isdigit():
        return int(spec)
    counts = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, n = part.partition(":")
        if not sep or name not in CONTROLS or not n.isdigit():
            raise ValueError(f"--control-seeds {spec!r}: expected N or kind:N,... with kind one of {CONTROLS}")
        counts[name] = int(n)
    return counts.get(kind, 1)


def planes_needed(layers: list[int]) -> list[int]:
    """The layers the capture must hold for every control of aux planes ``layers``."""
    return sorted({*layers, *(i - 1 for i in layers), *(i + 1 for i in layers)})


def transform(kind: str, x: dict[str, torch.Tensor], plane: Any, layers: list[int], name: str) -> dict:
    """The control ``kind`` of one sample ``x`` (ours); ``plane(name)`` reads our sample's planes."""
    aux, h = x["aux_hidden_state"], x["hidden_state"]
    hidden = h.shape[-1]
    if kind == "shuffled":
        g = torch.Generator().manual_seed(int(hashlib.sha256(name.encode()).hexdigest()[:8], 16))
        aux = aux[:, torch.randperm(aux.shape[1], generator=g)]
    elif kind == "zeroed":
        aux = torch.zeros_like(aux)
    elif kind == "late":
        aux = torch.cat([plane(f"layer.{i + 1}") for i in layers], -1).unsqueeze(0)
    elif kind == "partial":
        aux = torch.cat([(plane(f"layer.{i - 1}").float() + plane(f"layer.{i}").float()) / 2 for i in layers],
                        -1).to(aux.dtype).unsqueeze(0)
    elif kind == "scaled":
        aux = aux.clone()
        aux[..., hidden:2 * hidden] = (aux[..., hidden:2 * hidden].float() * 2).to(aux.dtype)
    elif kind == "prenorm":
        h = plane("final.pre_norm").unsqueeze(0)
    else:
        raise ValueError(f"unknown control {kind!r}")
    return {**x, "aux_hidden_state": aux.to(x["aux_hidden_state"].dtype).contiguous(),
            "hidden_state": h.to(x["hidden_state"].dtype).contiguous()}


def make(kind: str, samples_dir: Path, ours: Path, out: Path, layers: list[int]) -> dict:
    """Write control ``kind`` of every file of ``ours`` under ``out`` (files already there are kept)."""
    from hs_patch.samples import lazy_sample, reader

    t0 = time.time()
    entries, _ = reader.manifest_entries(samples_dir)
    n = written = 0
    for f in features.ckpts(ours):
        rel = f.relative_to(ours)
        n += 1
        if (out / rel).exists():
            continue
        written += 1
        x = features.load(f)
        with lazy_sample.open_sample(samples_dir / entries[f.stem]["file"], entry=entries[f.stem]) as s:
            if not torch.equal(s.tensor("input_ids").to(torch.int64), x["input_ids"].to(torch.int64)):
                raise ValueError(f"{f}: our sample {f.stem} holds other tokens")
            y = transform(kind, x, lambda name: s.tensor(name), layers, f.stem)
        features.save(y, out / rel)
    return {"files": n, "written": written, "s": round(time.time() - t0, 1)}


def make_all(kinds: list[str], samples_dir: Path, ours: Path, feat: Path, layers: list[int], workers: int,
             done: Any = None) -> dict[str, dict]:
    """Every control in ``kinds`` under ``feat/<kind>``, one process each; ``done(kind)`` as each ends."""
    res: dict[str, dict] = {}
    with ProcessPoolExecutor(max(1, min(workers, len(kinds)))) as pool:
        futs = {pool.submit(make, k, samples_dir, ours, feat / k, layers): k for k in kinds}
        from concurrent.futures import as_completed

        for fut in as_completed(futs):
            k = futs[fut]
            res[k] = fut.result()
            if done is not None:
                done(k)
    return res
