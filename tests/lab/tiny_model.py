"""Write a tiny random DeepseekV3 model directory for tests and benchmarks.

usage: python3 tests/lab/tiny_model.py OUT_DIR [--hidden 64] [--layers 4]

The directory holds what a served model's directory holds and the driver and the
stand-in server read: ``config.json`` (DeepseekV3: MLA + MoE + YaRN rope), bf16
``model.safetensors`` with random weights (seed 0), and a byte-level BPE tokenizer
(vocabulary 512, trained here on a few sentences) with a Kimi-style chat template
(``<|im_user|>user<|im_middle|>...<|im_end|>``) whose end-of-turn token is the EOS.
Builds in about a second on a CPU; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SPECIALS = ["<unk>", "[BOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
            "<|im_middle|>"]

CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- else -%}<|im_system|>{{ m['role'] }}<|im_middle|>{%- endif -%}"
    "{{ m['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hidden states of a served model train a drafter.",
    "Speculative decoding drafts tokens that the target model verifies in one forward pass.",
    "What is the capital of France? Paris is the capital of France. How many legs has a spider? Eight.",
    "def add(a, b):\n    return a + b\nprint(add(2, 3))",
    "user assistant system tool hello world thanks please explain why and how numbers 0 1 2 3 4 5 6 7 8 9",
]


def make_tokenizer(out: Path, vocab_size: int = 512) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    ft = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="<|im_end|>",
                                 unk_token="<unk>", additional_special_tokens=SPECIALS[3:])
    ft.chat_template = CHAT_TEMPLATE
    ft.save_pretrained(str(out))


def random_model(*, hidden: int = 64, layers: int = 4, vocab_size: int = 512, eos_token_id: int = 2):
    """A tiny random DeepseekV3ForCausalLM (MLA + MoE + YaRN rope), bf16, seeded, in memory."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=1, eos_token_id=eos_token_id,
        rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():  # non-trivial routing: the correction bias is zero by default
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
    return model


def make_tiny_model_dir(out: str | Path, *, hidden: int = 64, layers: int = 4, vocab_size: int = 512) -> Path:
    """Write the model directory (config, weights, tokenizer) and return its path."""
    from transformers import AutoTokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    make_tokenizer(out, vocab_size)
    eos = AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids("<|im_end|>")
    model = random_model(hidden=hidden, layers=layers, vocab_size=vocab_size, eos_token_id=eos)
    model.save_pretrained(str(out))
    cj = json.loads((out / "config.json").read_text())
    cj.update({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
    (out / "config.json").write_text(json.dumps(cj, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    print(make_tiny_model_dir(a.out, hidden=a.hidden, layers=a.layers))


if __name__ == "__main__":
    main()
