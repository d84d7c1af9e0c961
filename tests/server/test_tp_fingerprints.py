"""Tensor parallelism and the additive relation (issue #33): each rank's share of the attention output is
fingerprinted by its own hook and the fingerprints summed over the ranks, so the writing rank's sample
passes; without the sum (one rank's share alone) it fails. Two ranks, each the REAL patched forward of a
release (``lab.sglang_sim`` with ``tp_rank``: the attention returns that rank's share, ``prepare_mlp`` adds
both shares' bf16 sum as NCCL would), run side by side in two threads with an all-reduce that meets in
the middle; rank 0 holds a :class:`CaptureHook`, rank 1 a :class:`RankHook`, as ``hook.attach`` makes
them. What this does not show: NCCL itself, and SGLang's own all-reduce inside the hook (the GPU proof
runs TP=1; the real target runs TP=8)."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import FAMILY_REPRESENTATIVES
from hs_patch.engine.releases import RELEASES, TARGET, apply_edits
from hs_patch.host.fidelity.rows import Norms, check_rows
from hs_patch.samples import lazy_sample, store
from hs_patch.server import config, hook
from hs_patch.server.ranks import RankHook
from lab.sglang_sim import Part, ReleaseCode, Sim, make_batch, reference

LAYERS = (1, 2, 3)


class TwoRanks:
    """An in-place sum of a tensor over two threads (each rank's call meets the other's)."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=30)
        self.slots: list = [None, None]
        self.calls = 0

    def for_rank(self, r: int):
        def reduce(t: torch.Tensor) -> None:
            self.slots[r] = t.clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            t.copy_(total)
            self.calls += r == 0
        return reduce


@pytest.fixture(scope="module")
def norms(tiny_model) -> Norms:
    m = tiny_model.model
    return Norms.of({i: m.layers[i].input_layernorm.weight.detach() for i in range(len(m.layers))},
                    m.norm.weight.detach(), tiny_model.config.rms_norm_eps)


def run_two_ranks(version, release_sources, tiny_model, tmp_path, reduce_on_rank0: bool):
    g = torch.Generator().manual_seed(8)
    refs = {"a": reference(tiny_model, torch.randint(3, 250, (40,), generator=g).tolist())}
    site = release_sources[version]
    source = apply_edits(RELEASES[version], (site / TARGET).read_text())
    net = TwoRanks()
    cfg = config.CaptureConfig(enabled=True, directory=str(tmp_path / "d"), layers=LAYERS, final="both", slots=2,
                               slot_tokens=32)
    writer = hook.CaptureHook(cfg, hidden_size=tiny_model.config.hidden_size, metadata={"tp_size": "2"},
                              release=version, all_reduce=net.for_rank(0) if reduce_on_rank0 else None)
    other = RankHook(LAYERS, 32, cfg.skip_rid_prefix, None, net.for_rank(1))
    sims = [Sim(version, source, tiny_model, refs, hook=h, code=ReleaseCode.read(site), tp_rank=r)
            for r, h in enumerate((writer, other))]
    errors: list = []

    def play(r: int) -> None:
        try:
            for start in (0, 24):  # a prompt of 40 tokens in two passes
                sims[r].forward(make_batch(refs, [Part("a", start, min(24, 40 - start))]))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)
            net.barrier.abort()

    threads = [threading.Thread(target=play, args=(r,)) for r in (0, 1)] if reduce_on_rank0 else []
    if reduce_on_rank0:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    else:  # rank 0 alone: its share only (what a hook without the sum would record)
        play(0)
    writer.close()
    assert not errors, errors
    (e,) = store.read_manifest(tmp_path / "d").values()
    return net, lazy_sample.open_sample(tmp_path / "d" / e["file"], entry=e)


@pytest.mark.parametrize("version", FAMILY_REPRESENTATIVES)
def test_each_ranks_share_summed_passes_and_one_ranks_share_fails(version, release_sources, tiny_model, norms,
                                                                  tmp_path):
    net, s = run_two_ranks(version, release_sources, tiny_model, tmp_path / "tp2", reduce_on_rank0=True)
    with s:
        good = check_rows(s, norms)
    assert good.problems == [], good.problems
    assert net.calls == 2 * len(LAYERS) * 2, "two fingerprint streams a captured layer, two passes, summed"
    assert max(v["ratio"] for k, v in good.relations.items() if k.endswith("+attn")) < 0.5
    _, s = run_two_ranks(version, release_sources, tiny_model, tmp_path / "alone", reduce_on_rank0=False)
    with s:
        alone = check_rows(s, norms)
    assert any(p.startswith("layer.1+attn:") for p in alone.problems), alone.problems
