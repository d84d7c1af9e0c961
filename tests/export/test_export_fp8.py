"""hs-extract export of fp8 samples (HS_CAPTURE_DTYPE=fp8, format 5): the trainers' own readers load the
planes dequantized to bf16, bit for bit what :mod:`hs_patch.samples.reader` returns by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hs_patch.host.export import layout
from hs_patch.host.export.run import export
from hs_patch.host.export.spec import ExportSpec
from lab.sample_files import write_run
from test_export import LAYERS, same_bits, sources, specforge_samples, speculators_rows, stacked


@pytest.fixture
def src(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    write_run(d, 5, shipped=True, fp8=True)
    return d


def test_fp8_samples_read_as_fp8_and_dequantize_to_bf16(src):
    for s in sources(src).values():
        assert s.fp8 and s.plane("layer.2", raw=True).dtype == torch.float8_e4m3fn
        deq = s.plane("layer.2")
        want = (s.plane("layer.2", raw=True).float() * s.scale("layer.2")[:, None]).bfloat16()
        assert same_bits(deq, want)


def test_specforge_reads_fp8_samples_dequantized_bit_for_bit(src, tmp_path):
    dst = tmp_path / "sf"
    assert export(src, dst, ExportSpec("specforge"), workers=2).state == "complete"
    info = layout.read_info(dst)   # what the files hold, and what was captured
    assert (info["dtype"], info["capture_dtype"]) == ("bfloat16", "float8_e4m3fn"), info
    want = sources(src)
    got = specforge_samples(dst)
    assert len(got) == 5
    for g in got:
        raw, sample = g["raw"], want[Path(g["path"]).name[: -len(".ckpt")]]
        n = sample.input_ids.shape[0]
        assert same_bits(raw["hidden_state"], sample.plane("final.post_norm").reshape(1, n, -1))
        aux = torch.cat([sample.plane(f"layer.{i}") for i in LAYERS], dim=-1).reshape(1, n, -1)
        assert same_bits(raw["aux_hidden_state"], aux) and aux.dtype == torch.bfloat16
        assert same_bits(raw["input_ids"], sample.input_ids)


def test_speculators_reads_fp8_samples_dequantized_bit_for_bit(src, tmp_path):
    """speculators' default (bf16 files): the dequantized planes. Its own fp8 layout (--fp8) re-quantizes
    those with hs_connectors' scheme (one scale a token for all layers), tested in test_export.py."""
    dst = tmp_path / "sp"
    assert export(src, dst, ExportSpec("speculators"), workers=2).state == "complete"
    by_ids = {tuple(s.input_ids.tolist()): s for s in sources(src).values()}
    rows = speculators_rows(dst)
    assert len(rows) == 5
    for r in rows:
        st = stacked(by_ids[tuple(r["input_ids"].tolist())])
        assert st.dtype == torch.bfloat16
        assert same_bits(r["hidden_states"], st[:, :-1].flatten(1))
        assert same_bits(r["verifier_last_hidden_states"], st[:, -1])


def test_speculators_fp8_layout_of_fp8_samples_quantizes_the_dequantized_planes(src, tmp_path):
    """--fp8 (speculators' FP8Transfer layout: one scale a token shared by the stacked layers) from fp8 samples:
    hs_connectors' own quantizer of the dequantized planes, bit for bit, and its loader reads it."""
    from lab.trainers import need

    need("hs_connectors")
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8
    from safetensors.torch import load_file

    dst = tmp_path / "sp8"
    assert export(src, dst, ExportSpec("speculators", fp8=True)).state == "complete"
    assert layout.read_info(dst)["dtype"] == "float8_e4m3fn"
    want = sources(src)
    for key, e in layout.live_entries(dst).items():
        raw = load_file(str(dst / e["file"]))
        q, scale = quantize_tensor_to_fp8(stacked(want[key]))
        assert same_bits(raw["hidden_states"], q) and same_bits(raw["hidden_states_scales"], scale)
    by_ids = {tuple(s.input_ids.tolist()): s for s in want.values()}
    for r in speculators_rows(dst, fp8=True):
        deq = dequantize_fp8_tensor(*quantize_tensor_to_fp8(stacked(by_ids[tuple(r["input_ids"].tolist())])))
        assert same_bits(r["hidden_states"], deq[:, :-1].flatten(1))
