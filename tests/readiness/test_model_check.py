"""The model directory check (hs_patch/host/readiness/model_check.py) on real safetensors files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from hs_patch.host.readiness import model_check as mc


def _model(d: Path, arch: str = "KimiK25ForConditionalGeneration") -> Path:
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
    save_file({"a.weight": torch.zeros(64, 64), "b.weight": torch.ones(8)}, str(d / "model-00001-of-00002.safetensors"))
    save_file({"c.weight": torch.ones(128, 16)}, str(d / "model-00002-of-00002.safetensors"))
    (d / mc.INDEX).write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00001-of-00002.safetensors",
        "c.weight": "model-00002-of-00002.safetensors"}}))
    return d


def _by_name(checks):
    return {c.name: c for c in checks}


def test_a_complete_model_passes(tmp_path):
    checks = _by_name(mc.check_model(_model(tmp_path / "m"), "KimiK25ForConditionalGeneration"))
    assert all(c.ok for c in checks.values()), checks
    assert checks["index"].detail == "3 tensors in 2 shard(s)"


def test_a_truncated_shard_a_missing_one_and_a_short_index_are_named(tmp_path):
    m = _model(tmp_path / "m")
    shard = m / "model-00002-of-00002.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    checks = _by_name(mc.check_model(m, "KimiK25ForConditionalGeneration"))
    assert not checks["shards"].ok and "truncated or still copying" in checks["shards"].detail
    shard.unlink()
    index = json.loads((m / mc.INDEX).read_text())
    index["weight_map"]["d.weight"] = "model-00001-of-00002.safetensors"
    (m / mc.INDEX).write_text(json.dumps(index))
    detail = _by_name(mc.check_model(m, "KimiK25ForConditionalGeneration"))["shards"].detail
    assert "model-00002-of-00002.safetensors: No such file or directory" in detail
    assert "lacks 1 tensor(s) the index maps to it, e.g. d.weight" in detail


def test_an_unknown_architecture_and_a_missing_config_fail(tmp_path):
    checks = _by_name(mc.check_model(_model(tmp_path / "m", "LlamaForCausalLM"), "LlamaForCausalLM"))
    assert not checks["architecture"].ok and "deepseek_v2.py" in checks["architecture"].fix
    (c,) = mc.check_model(tmp_path / "none", "KimiK25ForConditionalGeneration")
    assert c.name == "config" and not c.ok


def test_the_cli_exit_code(tmp_path, capsys):
    m = _model(tmp_path / "m")
    assert mc.main([str(m), "--json"]) == 0
    assert all(json.loads(x)["ok"] for x in capsys.readouterr().out.splitlines())
    (m / "model-00001-of-00002.safetensors").write_bytes(b"\x00" * 4)
    assert mc.main([str(m)]) == 1
