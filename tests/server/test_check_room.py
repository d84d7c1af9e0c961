"""The bf16 rows of the LM head's input kept for the fidelity check (HS_CAPTURE_FINAL=none, or fp8 planes) live in
a quarter-pass buffer per staging slot (issue #35: fp8's staging memory halved, not 0.7 of bf16's): every part keeps
its last HS_CAPTURE_CHECK_ROWS rows while they fit; a pass of more parts keeps fewer rows a part, each sample
records how many, and the rows kept are exactly the engine's; more parts than the buffer has rows still keep one
each (a buffer of that pass's own)."""

from __future__ import annotations

import pytest
import torch

from hs_patch.host.model_files import rms_norm
from hs_patch.samples import reader, store
from hs_patch.server import config, hook
from hs_patch.server.check_rows import check_room, fit_check_counts
from lab.passes import Batch, play

H = 32  # 8 blocks of whole 32-bit words of one-byte values (fp8)


def test_the_room_is_a_quarter_of_the_pass_at_least_the_rows_asked_at_most_the_pass():
    assert check_room(8192, 16) == 2048
    assert check_room(32, 16) == 16
    assert check_room(8, 16) == 8
    assert check_room(8192, 0) == 0


@pytest.mark.parametrize("lens, rows, room, want", [
    ([100, 200, 300], 16, 2048, [16, 16, 16]),    # they fit: as asked
    ([3, 100], 16, 2048, [3, 16]),                # a short part keeps all its rows
    ([20] * 3, 16, 16, [5, 5, 5]),                # 48 rows asked of 16: the largest cap that fits
    ([2, 30, 30], 16, 16, [2, 7, 7]),             # what a short part leaves goes to the others
    ([3] * 20, 16, 16, [1] * 20),                 # more parts than rows: one each all the same
])
def test_counts_fit_the_room_and_keep_at_least_the_last_row(lens, rows, room, want):
    got = fit_check_counts(lens, rows, room)
    assert got == want
    assert sum(got) <= room or got == [1] * len(lens)


def test_fp8_staging_with_the_check_rows_is_about_half_of_bf16s(tmp_path):
    """The real hook's pinned-to-be staging at Kimi-K2.5's width: fp8 planes, their scales and the bf16 check
    rows against bf16 planes (the CPU work buffer, which is GPU memory on a GPU host, left out)."""
    sizes = {}
    for dtype in ("bf16", "fp8"):
        cfg = config.CaptureConfig(enabled=True, directory=str(tmp_path / dtype), layers=(1, 2, 3), final="both",
                                   slots=1, slot_tokens=256, dtype=dtype)
        h = hook.CaptureHook(cfg, hidden_size=7168, metadata={})
        try:
            sizes[dtype] = h.host_bytes - (h._work.numel() if dtype == "fp8" else 0)
        finally:
            h.close()
    assert 0.5 < sizes["fp8"] / sizes["bf16"] <= 0.56, sizes


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_a_pass_of_many_parts_keeps_fewer_rows_a_part_and_exactly_the_engines(dtype, tmp_path):
    cfg = config.CaptureConfig(enabled=True, directory=str(tmp_path), layers=(0,), final="none", slots=2,
                               slot_tokens=64, writers=1, dtype=dtype, check_rows=16)
    h = hook.CaptureHook(cfg, hidden_size=H, metadata={})
    assert h.check_rows == 16
    passes = {"wide": [20, 20, 20], "many": [3] * 20}  # 48 rows asked of 16; 20 parts for 16 rows
    posts = {}
    try:
        for seed, (name, lens) in enumerate(passes.items(), start=1):
            n = sum(lens)
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(n, H, generator=g).to(torch.bfloat16)
            pre = torch.randn(n, H, generator=g).to(torch.bfloat16)
            post = rms_norm(pre, torch.ones(H, dtype=torch.bfloat16), 1e-6)
            rids = [f"{name}-{k}" for k in range(len(lens))]
            play(h, Batch(lens, rids=rids), torch.arange(seed * 1000, seed * 1000 + n), {0: x}, pre, post)
            posts[name] = (lens, post)
    finally:
        h.close()
    samples = {s.metadata["rid"]: s for s in reader.iter_samples(tmp_path)}
    assert len(samples) == 23
    for name, (lens, post) in posts.items():
        kept = fit_check_counts(lens, 16, 16)
        end = 0
        for k, n in enumerate(lens):
            end += n
            s = samples[f"{name}-{k}"]
            assert int(s.metadata[store.CHECK_ROWS]) == kept[k]
            assert torch.equal(s.tensors[store.CHECK_TENSOR], post[end - kept[k]:end]), (name, k)
