"""The training features of every compared pipeline, in SpecForge's offline layout.

Each variant is a directory of ``*.ckpt`` files (``input_ids``, ``loss_mask`` int64 [L],
``hidden_state`` [1,L,H] and ``aux_hidden_state`` [1,L,3H], bf16), named as in our export so
the variants pair sample by sample:

- ``ours``: ``hs-extract export --format specforge`` of the driver's samples (made elsewhere);
- ``hf``: transformers on the same weights and token ids (bf16, as a peer extracting with HF
  would), the same planes;
- ``late``: the same transformers run, every aux plane one layer late (layer.<i+1>); served with
  the right ids, the drafter is fed the planes one layer earlier than it learnt;
- ``prenorm``: our samples' ``final.pre_norm`` where SpecForge wants the post-norm state;
- ``specforge``: SpecForge's own ``prepare_hidden_states.py`` (made elsewhere; its own
  tokenization, file names and order: paired by token ids).

``agreement`` compares a variant's teacher (argmax of the LM head on ``hidden_state``) with
ours at every loss position, so a small difference can be told from none.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Iterator

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


def hf_variants(model_dir: Path, ours: Path, out_hf: Path, out_late: Path, layers: list[int], device: str,
                log: Callable[[str], None]) -> dict:
    """``hf`` and ``late`` from one transformers pass per sample of our export."""
    import sys

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for lab
    from lab.hf_reference import reference

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).to(device).eval()
    n = model.config.num_hidden_layers
    if max(layers) + 1 >= n:
        raise ValueError(f"late variant needs layer {max(layers) + 1}, the model has {n}")
    files = ckpts(ours)
    for k, f in enumerate(files):
        rel = f.relative_to(ours)
        if (out_hf / rel).exists() and (out_late / rel).exists():
            continue
        s = load(f)
        r = reference(model, s["input_ids"].tolist())
        post = r.post_norm.to(torch.bfloat16).cpu().unsqueeze(0)
        aux = torch.cat([r.layer_in[i] for i in layers], -1).to(torch.bfloat16).cpu().unsqueeze(0)
        late = torch.cat([r.layer_in[i + 1] for i in layers], -1).to(torch.bfloat16).cpu().unsqueeze(0)
        base = {"input_ids": s["input_ids"], "loss_mask": s["loss_mask"], "hidden_state": post}
        save({**base, "aux_hidden_state": aux}, out_hf / rel)
        save({**base, "aux_hidden_state": late}, out_late / rel)
        if k % 200 == 0:
            log(f"hf states {k}/{len(files)}")
    return {"samples": len(files), "layers": layers, "late_layers": [i + 1 for i in layers]}


def prenorm_variant(samples_dir: Path, ours: Path, out: Path) -> dict:
    """``prenorm``: our export with ``hidden_state`` replaced by our sample's final.pre_norm (our export
    names each file by its sample's key)."""
    from hs_patch import lazy_sample, reader

    entries, _ = reader.manifest_entries(samples_dir)
    n = 0
    for f in ckpts(ours):
        rel = f.relative_to(ours)
        if not (out / rel).exists():
            x = load(f)
            with lazy_sample.open_sample(samples_dir / entries[f.stem]["file"], entry=entries[f.stem]) as s:
                assert torch.equal(s.tensor("input_ids"), x["input_ids"]), f
                x["hidden_state"] = s.tensor("final.pre_norm").to(torch.bfloat16).unsqueeze(0)
            save(x, out / rel)
        n += 1
    return {"samples": n}


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
