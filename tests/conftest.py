"""Shared fixtures: real SGLang release sources (downloaded once, cached) and a tiny model."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import sglang_wheels

ROOT = Path(__file__).resolve().parent.parent
SUPPORTED = ("0.5.9", "0.5.16", "0.5.23")
UNSUPPORTED = "0.5.8"  # a real release the patch does not know


def extract_site(version: str, dest: Path) -> Path:
    return sglang_wheels.extract_site(sglang_wheels.sglang_wheel(version), dest)


@pytest.fixture(scope="session")
def release_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """version -> a pristine extracted site (read-only use; copy before changing)."""
    base = tmp_path_factory.mktemp("sglang-sources")
    return {v: extract_site(v, base / v) for v in (*SUPPORTED, UNSUPPORTED)}


@pytest.fixture
def site(release_sources: dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A writable copy of one release's site; parametrize indirectly with the version."""
    dest = tmp_path / "site"
    shutil.copytree(release_sources[request.param], dest)
    return dest


@pytest.fixture(scope="session")
def tiny_model():
    """A tiny random DeepseekV3 (MLA + MoE + yarn rope), bf16, seeded."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1,
        kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        max_position_embeddings=4096, rope_theta=10000.0,
        rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A served-model directory (config, bf16 weights, tokenizer with a chat template), built once."""
    from tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))
