"""HS_CAPTURE_SLOT_TOKENS=1 (a chunked-prefill size of 1): every part of a prompt is one token, and each
keeps its own fingerprint rows, not a view of the staging buffer the next pass reuses (with a one-row
buffer the part's rows are contiguous already, so ``.contiguous()`` copied nothing)."""

from __future__ import annotations

import time

import torch

from hs_patch.host.fidelity.rows import Norms, check_rows
from hs_patch.host.model_files import rms_norm
from hs_patch.samples import lazy_sample, store
from hs_patch.server import config, hook
from lab.passes import Batch, play

H = 16


def _norms() -> Norms:
    return Norms.of({0: torch.ones(H, dtype=torch.bfloat16)}, torch.ones(H, dtype=torch.bfloat16), 1e-6)


def _play(h: hook.CaptureHook, lens, prefix, full, rids, seed: int) -> None:
    n = sum(lens)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    pre = torch.randn(n, H, generator=g).to(torch.bfloat16)
    post = rms_norm(pre, torch.ones(H, dtype=torch.bfloat16), 1e-6)
    play(h, Batch(lens, prefix, full, rids), torch.arange(seed * 100, seed * 100 + n), {0: x}, pre, post)


def _wait_samples(h: hook.CaptureHook, d, n: int) -> dict:
    deadline = time.monotonic() + 10
    while len(store.read_manifest(d)) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.read_manifest(d)


def test_one_token_parts_keep_their_fingerprints_when_the_next_pass_reuses_the_slot(tmp_path):
    h = hook.CaptureHook(config.CaptureConfig(enabled=True, directory=str(tmp_path), layers=(0,), final="both",
                                              slots=2, slot_tokens=1, writers=1), hidden_size=H, metadata={})
    try:
        for k in range(4):  # one prompt of 4 tokens, one pass each: the two slots are reused in turn
            _play(h, [1], [k], [4], ["a"], k + 1)
        _play(h, [1], [0], [1], ["b"], 9)  # a prompt of one token
        entries = _wait_samples(h, tmp_path, 2)
    finally:
        h.close()
    assert len(entries) == 2
    for e in entries.values():
        with lazy_sample.open_sample(tmp_path / e["file"], entry=e) as s:
            assert check_rows(s, _norms()).problems == [], s.metadata.get("rid")
