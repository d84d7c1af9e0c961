"""Drafters trained with SpecForge's own trainer and exported with its own exporter.

One draft config for every compared run (same architecture, vocab = the target's, so no
vocab mapping is involved), one ``run.yaml`` per feature variant that differs only in
``data.hidden_states_path``, ``run_id``, ``output_dir`` (and the seed for the spread runs).
The trainings run as parallel ``specforge train`` processes on the one GPU.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def draft_config(target_cfg: dict, eagle_ids: list[int], out: Path) -> dict:
    """LlamaForCausalLMEagle3, one layer, hidden = the target's, draft_vocab_size written (absent,
    SGLang replaces the trained head by the target's)."""
    h = int(target_cfg["hidden_size"])
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": h,
           "intermediate_size": 3 * h, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": h // 8,
           "num_hidden_layers": 1, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "silu",
           "rope_theta": 10000.0, "vocab_size": int(target_cfg["vocab_size"]),
           "draft_vocab_size": int(target_cfg["vocab_size"]), "tie_word_embeddings": False,
           "torch_dtype": "bfloat16", "bos_token_id": target_cfg.get("bos_token_id"),
           "eos_token_id": target_cfg.get("eos_token_id"), "pad_token_id": target_cfg.get("pad_token_id") or 0,
           "initializer_range": 0.02, "use_cache": True,
           "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": eagle_ids}}
    out.write_text(json.dumps(cfg, indent=1))
    return cfg


def run_yaml(*, target: Path, draft_cfg: Path, features: Path, out: Path, run_id: str, steps: int, batch: int,
             lr: float, seed: int, max_length: int, cache: Path) -> str:
    return f"""model:
  target_model_path: {target}
  draft_model_config: {draft_cfg}
  torch_dtype: bfloat16
data:
  hidden_states_path: {features}
  max_length: {max_length}
  cache_dir: {cache}
training:
  strategy: eagle3
  num_epochs: 1000
  max_steps: {steps}
  batch_size: {batch}
  learning_rate: {lr}
  warmup_ratio: 0.03
  max_grad_norm: 0.5
  ttt_length: 7
  attention_backend: sdpa
  seed: {seed}
  log_interval: 100
  save_interval: {steps}
run_id: {run_id}
output_dir: {out}
"""


def losses(log_path: Path) -> list[str]:
    """The trainer's logged loss/accuracy lines (what it printed, unparsed)."""
    return [ln for ln in log_path.read_text(errors="replace").splitlines()
            if "loss" in ln.lower() and ("step" in ln.lower() or "acc" in ln.lower())][-8:]


def export(run_out: Path, run_id: str, draft_cfg: Path, dst: Path, env: dict[str, str]) -> dict:
    ckpt = run_out / f"{run_id}-latest"
    if not ckpt.exists():
        steps = sorted(run_out.glob(f"{run_id}-step*"), key=lambda p: int(p.name.rsplit("step", 1)[1]))
        if not steps:
            return {"error": f"no checkpoint under {run_out}"}
        ckpt = steps[-1]
    cmd = [sys.executable, "-m", "specforge.cli", "export", "--to", "sglang", "--checkpoint", str(ckpt),
           "--draft-config", str(draft_cfg), "--output-dir", str(dst)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return {"rc": out.returncode, "checkpoint": str(ckpt), "tail": (out.stdout + out.stderr).splitlines()[-5:]}
