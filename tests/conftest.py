"""Shared fixtures: real SGLang release sources (downloaded once, cached) and a tiny model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("HS_PATCH_TEST_CACHE", Path.home() / ".cache" / "hs-patch-tests"))
SUPPORTED = ("0.5.9", "0.5.16", "0.5.23")
UNSUPPORTED = "0.5.8"  # a real release the patch does not know

# What the tests need from a wheel: the patched module, its neighbours, the version.
_MEMBERS = ("sglang/__init__.py", "sglang/version.py", "sglang/srt/models/deepseek_v2.py",
            "sglang/srt/models/kimi_k25.py", "sglang/srt/layers/aux_hidden_states.py")


def sglang_wheel(version: str) -> Path:
    """The real ``sglang==version`` wheel, downloaded once into the test cache."""
    wheels = CACHE / "wheels"
    found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                        "-q", "-d", str(wheels), f"sglang=={version}"], check=True)
        found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    assert found, f"pip download gave no sglang {version} wheel"
    return found[0]


def extract_site(version: str, dest: Path) -> Path:
    """A minimal site-packages with the release's files (and dist-info for its version)."""
    with zipfile.ZipFile(sglang_wheel(version)) as z:
        for name in z.namelist():
            if name in _MEMBERS or ".dist-info/" in name:
                z.extract(name, dest)
    return dest


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
