"""The training features of every compared pipeline, in SpecForge's offline layout.

Each arm is a directory of ``*.ckpt`` files (``input_ids``, ``loss_mask`` int64 [L],
``hidden_state`` [1,L,H] and ``aux_hidden_state`` [1,L,3H], bf16):

- ``ours``: ``hs-extract export --format specforge`` of the driver's samples;
- the controls (loop/controls.py): ours with one thing changed, made from our samples;
- ``specforge``: SpecForge's own ``prepare_hidden_states.py`` (its own tokenization, file names and
  order: paired by token ids).

``agreement`` compares an arm's teacher (argmax of the LM head on ``hidden_state``) and aux planes
with ours at every loss position, so a small difference can be told from none.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Iterator

import torch


def ckpts(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*.ckpt") if ".tmp" not in p.parts)


def save(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def ids_key(ids: torch.Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()


def _pairs(ours: Path, other: Path, limit: int) -> Iterator[tuple[dict, dict]]:
    mine = {}
    for f in ckpts(ours):
        x = load(f)
        mine[ids_key(x["input_ids"])] = f
    for f in ckpts(other)[:limit]:
        y = load(f)
        m = mine.get(ids_key(y["input_ids"]))
        if m is not None:
            yield load(m), y


def agreement(ours: Path, other: Path, lm_head: torch.Tensor, device: str, limit: int = 300) -> dict:
    """Teacher argmax (LM head on ``hidden_state``) of OTHER vs OURS at loss positions; aux planes' max
    |difference|; how many samples paired by token ids and how many loss masks are equal."""
    pos = same = paired = masks_equal = 0
    aux_cos: list[float] = []
    head = lm_head.to(device, torch.float32)
    for a, b in _pairs(ours, other, limit):
        paired += 1
        masks_equal += int(torch.equal(a["loss_mask"], b["loss_mask"]))
        m = a["loss_mask"].bool()
        if not m.any():
            continue
        ha = a["hidden_state"][0][m].to(device, torch.float32)
        hb = b["hidden_state"][0][m].to(device, torch.float32)
        same += int(((ha @ head.T).argmax(-1) == (hb @ head.T).argmax(-1)).sum())
        pos += int(m.sum())
        xa, xb = a["aux_hidden_state"][0].float(), b["aux_hidden_state"][0].float()
        aux_cos.append(float(torch.nn.functional.cosine_similarity(xa, xb, dim=-1).mean()))
    return {"paired": paired, "loss_masks_equal": masks_equal, "positions": pos,
            "teacher_argmax_agreement": round(same / pos, 5) if pos else None,
            "aux_cosine_mean": round(sum(aux_cos) / len(aux_cos), 5) if aux_cos else None}


def lm_head_of(model_dir: Path) -> torch.Tensor:
    import json

    from safetensors import safe_open

    index = next(model_dir.glob("*.index.json"), None)
    name = json.loads(index.read_text())["weight_map"]["lm_head.weight"] if index else "model.safetensors"
    with safe_open(str(model_dir / name), "pt") as f:
        return f.get_tensor("lm_head.weight")


def summary(directory: Path) -> dict[str, Any]:
    files = ckpts(directory)
    tokens = loss = 0
    for f in files:
        x = load(f)
        tokens += int(x["input_ids"].numel())
        loss += int(x["loss_mask"].sum())
    return {"files": len(files), "tokens": tokens, "loss_tokens": loss,
            "bytes": sum(f.stat().st_size for f in files)}
