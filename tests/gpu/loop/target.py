"""The target: its own tokenizer and chat template, a DeepseekV3 (MLA + MoE) trained from scratch.

Shapes SGLang's Triton MLA kernels take (Kimi-K2 head dims: qk_nope 128, rope 64, v 128,
kv_lora 512; Lk = 576), YaRN rope as in Kimi-K2, 8 routed experts (2 active) + 1 shared, the
first layer dense. The chat template is ChatML without a default system prompt, the shape
SpecForge registers as ``lfm`` (assistant header ``<|im_start|>assistant\\n``, end of turn
``<|im_end|>\\n``), so SpecForge's own preprocessing and our driver tokenize a chat the same way.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from pathlib import Path
from typing import Any, Callable

import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
YARN = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def render(chat: dict) -> str:
    """The template, in Python (for training text; the tokenizer's jinja is the same)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat["messages"])


def train_tokenizer(texts: list[str], vocab_size: int, out: Path) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                 additional_special_tokens=["<|im_start|>"])
    ft.chat_template = CHAT_TEMPLATE
    ft.save_pretrained(str(out))
    return ft


def config(vocab_size: int, *, hidden: int = 1024, layers: int = 8, eos_id: int, pad_id: int) -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=8, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=131072, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id,
        tie_word_embeddings=False, rope_theta=50000.0, rope_scaling={**YARN, "rope_type": "yarn"},
        initializer_range=0.02)


def packed_blocks(token_lists: list[list[int]], block: int, seed: int) -> torch.Tensor:
    """Shuffle the chats (seeded), concatenate, cut into [N, block] (the tail dropped)."""
    order = list(range(len(token_lists)))
    random.Random(seed).shuffle(order)
    flat = [t for i in order for t in token_lists[i]]
    n = len(flat) // block
    return torch.tensor(flat[: n * block], dtype=torch.long).view(n, block)


def train(cfg: Any, blocks: torch.Tensor, *, steps: int, batch: int, lr: float, seed: int, device: str,
          log: Callable[[str], None]) -> tuple[Any, dict]:
    """Train for exactly ``steps`` steps of ``batch`` blocks (a fixed count, whatever the GPU's speed, so a
    re-run trains the same target), cycling through the blocks in a seeded order. Returns (model in bf16,
    stats)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).to(device)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.startswith("cuda"))
    gen = torch.Generator().manual_seed(seed)
    epochs = -(-steps * batch // len(blocks))
    perm = torch.cat([torch.randperm(len(blocks), generator=gen) for _ in range(epochs)])
    warmup, total = 50, steps
    losses: list[tuple[int, float]] = []
    t0 = time.time()
    step = 0
    while step < total:
        idx = perm[step * batch:(step + 1) * batch]
        x = blocks[idx].to(device, non_blocking=True)
        frac = step / max(total, 1)
        cur = lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for g in opt.param_groups:
            g["lr"] = cur
        with torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == 20:
            per = (time.time() - t0) / step
            log(f"target: {per * 1000:.0f} ms/step, {batch * blocks.shape[1] / per:,.0f} tok/s, {total} steps")
        if step % 50 == 0 or step == total:
            loss = float(out.loss.detach())
            losses.append((step, round(loss, 4)))
            log(f"target step {step}/{total} loss {loss:.3f} ({time.time() - t0:.0f}s)")
    model.eval()
    stats = {"steps": step, "epochs": round(step * batch / len(blocks), 2), "tokens": step * batch * blocks.shape[1],
             "seconds": round(time.time() - t0, 1),
             "loss_curve": losses, "final_loss": losses[-1][1] if losses else None,
             "params": sum(p.numel() for p in model.parameters())}
    return model.to(torch.bfloat16), stats


def save(model: Any, tokenizer: Any, out: Path) -> None:
    """bf16 safetensors in two shards (SpecForge reads lm_head through ``*.index.json``), a plain
    DeepSeek-style config.json (the keys SGLang's deepseek_v2.py reads), generation_config."""
    model.save_pretrained(str(out), max_shard_size="150MB")
    tokenizer.save_pretrained(str(out))
    cj = json.loads((out / "config.json").read_text())
    cj.update({"rope_theta": 50000.0, "rope_scaling": dict(YARN), "torch_dtype": "bfloat16",
               "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
               "num_nextn_predict_layers": 0, "ep_size": 1, "aux_loss_alpha": 0.001, "seq_aux": True,
               "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
    (out / "config.json").write_text(json.dumps(cj, indent=2))
    eos = cj["eos_token_id"]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": eos,
                                                             "do_sample": False}))
    if not list(out.glob("*.index.json")):  # one shard: write the index SpecForge needs
        from safetensors import safe_open

        (f,) = out.glob("*.safetensors")
        with safe_open(str(f), "pt") as st:
            keys = list(st.keys())
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": f.stat().st_size}, "weight_map": {k: f.name for k in keys}}))
    os.sync()
