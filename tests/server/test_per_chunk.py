"""Relations judged chunk by chunk (issue #33): a wrong state in one chunk of a 128-chunk prompt is rejected
as surely as in a one-chunk prompt, and the right chunks around it pass with room.

Through the real patched forward (``lab.sglang_sim``, SGLang 0.5.16), the real hook and writer, and the
driver's row checks; the tiny model's own norm weights. Before #33 one chi-square was pooled over the
prompt: the same half-update partial sum in one chunk was diluted below the bound from 16 chunks up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hs_patch.engine.releases import RELEASES, TARGET, apply_edits
from hs_patch.host.fidelity.rows import Norms, check_rows
from hs_patch.samples import lazy_sample, store
from hs_patch.server import config, hook
from lab import sabotage
from lab.sglang_sim import Part, ReleaseCode, Sim, make_batch, reference

CHUNK, CHUNKS = 8, 128


@pytest.fixture(scope="module")
def norms(tiny_model) -> Norms:
    m = tiny_model.model
    return Norms.of({i: m.layers[i].input_layernorm.weight.detach() for i in range(len(m.layers))},
                    m.norm.weight.detach(), tiny_model.config.rms_norm_eps)


def capture_long(release_sources, tiny_model, tmp_path: Path, request: str) -> lazy_sample.LazySample:
    g = torch.Generator().manual_seed(128)
    refs = {request: reference(tiny_model, torch.randint(3, 250, (CHUNK * CHUNKS,), generator=g).tolist())}
    cfg = config.CaptureConfig(enabled=True, directory=str(tmp_path / "d"), layers=(1, 2, 3), final="both", slots=4,
                               slot_tokens=CHUNK)
    h = hook.CaptureHook(cfg, hidden_size=tiny_model.config.hidden_size, metadata={"sglang_release": "0.5.16"})
    site = release_sources["0.5.16"]
    sim = Sim("0.5.16", apply_edits(RELEASES["0.5.16"], (site / TARGET).read_text()), tiny_model, refs, hook=h,
              code=ReleaseCode.read(site))
    try:
        for k in range(CHUNKS):
            sim.forward(make_batch(refs, [Part(request, k * CHUNK, CHUNK)]))
    finally:
        h.close()
    (e,) = store.read_manifest(tmp_path / "d").values()
    return lazy_sample.open_sample(tmp_path / "d" / e["file"], entry=e)


def test_a_partial_sum_in_one_chunk_of_128_is_rejected_and_the_same_prompt_right_passes(
        release_sources, tiny_model, norms, tmp_path, monkeypatch):
    monkeypatch.setattr(sabotage, "AT_PREFIX", 64 * CHUNK)  # the 65th chunk only
    undo = sabotage.install()
    try:
        with capture_long(release_sources, tiny_model, tmp_path / "bad", sabotage.rid("chunk_partial")) as s:
            bad = check_rows(s, norms)
    finally:
        undo()
    assert bad.chunks == CHUNKS
    assert any(p.startswith("layer.2+attn:") and f"in 1 of {CHUNKS} chunks (e.g. chunk 64, rows 512..519)" in p
               for p in bad.problems), bad.problems
    assert any(p.startswith("layer.2: the stored rows, normalised") and f"in 1 of {CHUNKS} chunks" in p
               for p in bad.problems), "the norm relation, on the rows it reads, judges it per chunk too"
    with capture_long(release_sources, tiny_model, tmp_path / "good", "clean") as s:
        good = check_rows(s, norms)
    assert good.problems == [] and good.chunks == CHUNKS
    worst = max(r.get("ratio", 0) for r in good.relations.values())
    assert worst < 0.5, f"a right sample's worst chunk is at {worst:.2f} of its bound: the room is measured, >= 2x"
