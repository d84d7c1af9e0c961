#!/usr/bin/env python3
"""Write a random-weight DeepseekV3 checkpoint with Kimi-K2 head dims, loadable by SGLang and transformers.

usage: python3 tests/gpu/make_model.py OUT_DIR [--hidden 1024] [--layers 4] [--seed 0]
                                      [--preset small|kimi-layer] [--device cuda]

Kimi-K2/DeepSeek-V3 attention dims (qk_nope 128, rope 64, v 128, kv_lora 512, q_lora 1536:
the MLA shapes SGLang's Triton kernels accept), YaRN rope as in Kimi-K2's config.json, MoE
with 8 routed experts (2 active) + 1 shared, the first layer dense (preset "small"; preset
"kimi-layer" has a Kimi-K2.5 layer's per-token compute). ``--hidden 7168`` gives
Kimi-K2.5's hidden size. Weights are random (seeded), saved as bf16 safetensors, with a
small byte-level BPE tokenizer and a chat template.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

# per-layer shapes; "kimi-layer" has the per-token compute of one Kimi-K2.5 layer (64 heads,
# 8 active experts of width 2048 + 1 shared, a dense first layer of width 18432), with only
# 8 routed experts stored (all active) so that a few copies fit on one GPU
PRESETS = {
    "small": {"num_attention_heads": 8, "intermediate_size": 1024, "moe_intermediate_size": 256,
              "n_routed_experts": 8, "num_experts_per_tok": 2},
    "kimi-layer": {"num_attention_heads": 64, "intermediate_size": 18432, "moe_intermediate_size": 2048,
                   "n_routed_experts": 8, "num_experts_per_tok": 8},
}
YARN = {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


def build(out: str, hidden: int = 1024, layers: int = 4, seed: int = 0, device: str = "cpu",
          preset: str = "small", weights: bool = True) -> dict:
    """Write the model to OUT; ``device="cuda"`` draws the random weights there (seconds, not
    minutes, for 61 layers of hidden 7168). ``weights=False``: the config and tokenizer only, for
    SGLang's ``--load-format dummy`` (random weights made by the server: nothing to write or read)."""
    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world the quick brown fox jumps over the lazy dog " * 10,
                             "speculative decoding drafter hidden states kimi deepseek"], trainer)
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    ft.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}assistant:{% endif %}")
    ft.save_pretrained(out)

    cfg = DeepseekV3Config(
        vocab_size=512, hidden_size=hidden, num_hidden_layers=layers, **PRESETS[preset],
        num_key_value_heads=PRESETS[preset]["num_attention_heads"], n_shared_experts=1,
        first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        max_position_embeddings=131072, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        rope_theta=50000.0, rope_scaling={**YARN, "rope_type": "yarn"})
    if weights:
        torch.manual_seed(seed)
        torch.set_default_dtype(torch.bfloat16)  # drawn in bf16: half the memory of fp32 then a cast
        try:
            with torch.device(device):
                model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16)  # the router's fp32 weights too
        finally:
            torch.set_default_dtype(torch.float32)
        with torch.no_grad():  # non-trivial routing
            for name, p in model.named_parameters():
                if name.endswith("e_score_correction_bias"):
                    p.copy_(torch.randn_like(p) * 0.01)
        model.save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    # a plain DeepSeek/Kimi-style config.json: explicit rope keys and the attributes
    # SGLang's deepseek_v2.py reads that transformers' config does not write
    cj = json.load(open(os.path.join(out, "config.json")))
    cj.update({"rope_theta": 50000.0, "rope_scaling": dict(YARN), "torch_dtype": "bfloat16",
               "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
               "num_nextn_predict_layers": 0, "ep_size": 1, "aux_loss_alpha": 0.001, "seq_aux": True,
               "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
    json.dump(cj, open(os.path.join(out, "config.json"), "w"), indent=2)
    return cj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda is much faster)")
    ap.add_argument("--preset", default="small", choices=list(PRESETS), help="per-layer shapes (see PRESETS)")
    a = ap.parse_args()
    cj = build(a.out, a.hidden, a.layers, a.seed, a.device, a.preset)
    print(f"wrote {a.out}: hidden {cj['hidden_size']}, {cj['num_hidden_layers']} layers", flush=True)


if __name__ == "__main__":
    main()
