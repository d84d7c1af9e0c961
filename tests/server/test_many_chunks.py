"""A long prompt cut into thousands of parts (a small --chunked-prefill-size) still fits its header:
the chunk list (metadata ``chunks``, one start a part) grows with the parts, and a header over the
room laid out with the first part failed the sample and stopped capture for the whole server."""

from __future__ import annotations

import time

import torch

from hs_patch.samples import intent, lazy_sample, store
from hs_patch.server import config, hook
from hs_patch.server.inplace import InPlaceSample, header_room
from lab.passes import Batch, play

H = 16


def test_the_room_covers_a_part_a_token():
    for tokens in (1, 23, 9999, 10000, 10001, 262144):
        worst = len(",".join(map(str, range(tokens))))
        assert header_room(tokens) - InPlaceSample.HEADER_ROOM >= worst - InPlaceSample.CHUNKS_IN_ROOM
        assert header_room(tokens) % 4096 == 0
    assert header_room(23) == InPlaceSample.HEADER_ROOM  # short prompts: the file as before


def test_a_prompt_in_thousands_of_parts_with_the_drivers_largest_intent_is_written(tmp_path):
    n = 12000  # one token a pass: the starts "0,1,...,11999" take 60,889 bytes of the header
    ids = torch.arange(n) % 250
    key = store.sample_key(ids.tolist())
    # the driver's provenance at its cap (hs_patch.samples.intent.MAX_METADATA_BYTES)
    intent.write(tmp_path, key, [1] * n, {"sample_id": "x" * (intent.MAX_METADATA_BYTES - 100)})
    h = hook.CaptureHook(config.CaptureConfig(enabled=True, directory=str(tmp_path), layers=(0,), final="both",
                                              slots=3, slot_tokens=1, writers=2), hidden_size=H, metadata={})
    x = (torch.arange(n * H, dtype=torch.float32).reshape(n, H) % 7 + 1).to(torch.bfloat16)
    try:
        for s in range(n):
            play(h, Batch([1], [s], [n], ["a"]), ids[s:s + 1], {0: x[s:s + 1]}, x[s:s + 1], x[s:s + 1])
        deadline = time.monotonic() + 30
        while key not in store.read_manifest(tmp_path) and h.writer.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.writer.error is None, h.writer.error
    finally:
        h.close()
    e = store.read_manifest(tmp_path)[key]
    with lazy_sample.open_sample(tmp_path / e["file"], entry=e) as got:
        assert got.metadata["parts"] == str(n) and got.metadata["chunks"].split(",")[-1] == str(n - 1)
        assert torch.equal(got.rows("layer.0", 0, n), x)
