"""Nothing sized by the pass is allocated on the forward path by the capture (issue #22).

The patched forward of every release runs in the CPU simulation (``lab.sglang_sim``) with and
without the hook, under a dispatch mode that counts the bytes of every new tensor storage an
operation returns on the forward's thread. What capture adds must not grow with the pass: the
hook copies each captured tensor into memory made at start (on the CPU into the staging slot, on
a GPU through the device buffers of :mod:`hs_patch.server.device_ring`, whose snapshots are views
of storage made at start). The one exception is SGLang 0.5.16's own EAGLE-3 capture path, which
clones a captured layer's residual itself when a collector is given (its code, not the hook's;
that copy is freed as soon as the hook has copied it into a device buffer): the test counts
exactly those bytes. What the GPU allocates is measured on the GPU (tests/gpu/proof.py, phase
``memory``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hs_patch.server import config, hook
from hs_patch.server.device_ring import DeviceRing
from conftest import REPRESENTATIVES
from hs_patch.engine.families import COMMUNICATOR
from hs_patch.engine.releases import RELEASES, TARGET, apply_edits
from lab.sglang_sim import Part, ReleaseCode, Sim, make_batch, reference

LAYERS = (0, 1, 3)


class NewStorages(TorchDispatchMode):
    """Counts the bytes of the storages operations return that none of their inputs holds."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held:
                n = t.untyped_storage().nbytes()
                self.bytes += n
                self.ops[str(func)] = self.ops.get(str(func), 0) + n
        return out


def forward_bytes(release_sources: dict, version: str, tiny_model, tokens: int, tmp_path: Path,
                  capture: bool, dtype: str = "bf16") -> NewStorages:
    """New storage bytes of one prefill pass of one ``tokens``-token request through the patched forward."""
    ids = torch.randint(3, 250, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()
    refs = {"a": reference(tiny_model, ids)}
    h = None
    if capture:
        cfg = config.CaptureConfig(enabled=True, directory=str(tmp_path / f"dump-{version}-{tokens}-{dtype}"),
                                   layers=LAYERS, final="both", slots=2, slot_tokens=64, dtype=dtype)
        h = hook.CaptureHook(cfg, hidden_size=int(tiny_model.config.hidden_size), metadata={"sglang_release": version})
    source = apply_edits(RELEASES[version], (release_sources[version] / TARGET).read_text())
    sim = Sim(version, source, tiny_model, refs, hook=h, code=ReleaseCode.read(release_sources[version]))
    batch = make_batch(refs, [Part("a", 0, tokens)], rids=version != "0.5.9")
    try:
        with torch.no_grad(), NewStorages() as counted:
            sim.forward(batch)
    finally:
        if h is not None:
            h.close()
    return counted


@pytest.mark.parametrize("version", REPRESENTATIVES)  # one release per spelling of the edits
def test_capture_allocates_nothing_sized_by_the_pass(version, release_sources, tiny_model, tmp_path):
    hidden = int(tiny_model.config.hidden_size)
    added = {}
    for tokens in (16, 48):
        on = forward_bytes(release_sources, version, tiny_model, tokens, tmp_path, capture=True)
        off = forward_bytes(release_sources, version, tiny_model, tokens, tmp_path, capture=False)
        added[tokens] = on.bytes - off.bytes
    # the communicator family (0.5.14 .. 0.5.20) clones each captured layer's residual in its own EAGLE-3 path
    # (communicator.py, run as the release has it) once a collector is passed; nothing else may grow with the pass
    clones = RELEASES[version].family is COMMUNICATOR
    sglang_clones = {t: len(LAYERS) * t * hidden * 2 if clones else 0 for t in added}
    grown = (added[48] - sglang_clones[48]) - (added[16] - sglang_clones[16])
    assert grown == 0, f"capture on {version} allocates {grown} more bytes for 32 more tokens: {added}"
    assert added[16] - sglang_clones[16] < 16 * hidden * 2, f"capture allocates a plane's worth: {added}"


def test_fp8_capture_allocates_nothing_sized_by_the_pass(release_sources, tiny_model, tmp_path):
    """HS_CAPTURE_DTYPE=fp8: the quantization (scales, division, cast) runs in memory made at start too."""
    version = "0.5.23"  # the layer-boundary family: SGLang's own path clones nothing
    added = {tokens: forward_bytes(release_sources, version, tiny_model, tokens, tmp_path, True, "fp8").bytes
             - forward_bytes(release_sources, version, tiny_model, tokens, tmp_path, False).bytes
             for tokens in (16, 48)}
    assert added[48] == added[16], f"fp8 capture allocates {added[48] - added[16]} more bytes for 32 more tokens"
    assert added[16] < 16 * int(tiny_model.config.hidden_size), f"fp8 capture allocates a plane's worth: {added}"


def test_device_ring_quantizes_into_memory_made_at_start():
    """The GPU path's fp8 quantization, exercised on the CPU device: the fp8 rows and their scales land in the
    next device buffer (the rows first, the scales after rows x hidden bytes), through the work buffer, with
    nothing allocated; the same bytes as :func:`hs_patch.server.fp8.quantize` anywhere else."""
    from hs_patch.server import fp8

    ring = DeviceRing(2, rows=8, hidden=16, itemsize=2, device=torch.device("cpu"))
    starts = {b.data_ptr(): b for b in ring._raw}
    work = torch.empty(8 * 16, dtype=torch.bfloat16)
    x = [torch.randn(n, 16).to(torch.bfloat16) for n in (8, 5)]
    with NewStorages() as counted:
        got = [ring.quantized(t, work[: t.numel()].view(t.shape)) for t in x]
    assert counted.bytes == 0, counted.ops
    for (k, q, scale), t in zip(got, x):
        base = ring._raw[k]
        assert q.data_ptr() == base.data_ptr() in starts and scale.data_ptr() == base.data_ptr() + 8 * 16
        want_q, want_s = torch.empty(t.shape, dtype=torch.float8_e4m3fn), torch.empty(t.shape[0])
        fp8.quantize(t, torch.empty_like(t), want_q, want_s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_s)


def test_device_ring_snapshots_are_views_of_memory_made_at_start():
    """The GPU path's buffers, exercised on the CPU device: each snapshot is a copy in storage made at
    start (in turn), never a new allocation, and a captured state that does not fit is refused."""
    ring = DeviceRing(2, rows=8, hidden=16, itemsize=2, device=torch.device("cpu"))
    assert ring.nbytes == 2 * 8 * 16 * 2
    starts = {b.data_ptr() for b in ring._raw}
    x = [torch.randn(n, 16).to(torch.bfloat16) for n in (8, 5, 3)]
    with NewStorages() as counted:
        got = [ring.snapshot(t) for t in x]
    assert [k for k, _ in got] == [0, 1, 0], "the buffers are used in turn"
    assert counted.bytes == 0, counted.ops
    for (k, view), t in zip(got[1:], x[1:]):
        assert view.data_ptr() in starts and view.shape == t.shape and torch.equal(view, t)
    x[2][0, 0] = 99  # a snapshot is a copy: a later in-place update of the live tensor does not reach it
    assert not torch.equal(got[2][1], x[2])
    with pytest.raises(RuntimeError, match="does not fit the device buffers"):
        ring.snapshot(torch.zeros(9, 16, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="does not fit the device buffers"):
        ring.snapshot(torch.zeros(4, 16, dtype=torch.float32))


def test_the_capture_states_what_it_made_at_start(tmp_path):
    cfg = config.CaptureConfig(enabled=True, directory=str(tmp_path / "d"), layers=LAYERS, final="both", slots=3,
                               slot_tokens=128)
    h = hook.CaptureHook(cfg, hidden_size=64, metadata={"sglang_release": "t"})
    try:
        # 3 layers + both finals; the attention inputs, outputs and the residuals after them are fingerprinted only
        # (block sums and squares of the last two), and the final norm's inputs and squares (a release "t": no
        # family, so every stream); the planes and the embedded rows are checksummed too
        planes, streams, checksums = 5, 5 + 3 + 3 * 4 + 3, 5 + 1
        per_slot = 128 * (8 + 4) + planes * 128 * 64 * 2 + (streams + checksums) * 128 * 8 * 4
        assert h.host_bytes == 3 * per_slot
        assert h.device_bytes == 0, "no GPU here: no device buffers"
    finally:
        h.close()


def test_fp8_staging_holds_the_planes_in_half_the_bytes(tmp_path):
    """HS_CAPTURE_DTYPE=fp8: each staging buffer's planes take one byte a value (+ a scale a row), beside the room
    for the bf16 check rows (a quarter of the pass); the CPU work buffer is the one pass-sized buffer more, made at start."""
    sizes = {}
    for dtype in ("bf16", "fp8"):
        cfg = config.CaptureConfig(enabled=True, directory=str(tmp_path / dtype), layers=LAYERS, final="both",
                                   slots=3, slot_tokens=128, dtype=dtype)
        h = hook.CaptureHook(cfg, hidden_size=64, metadata={"sglang_release": "t"})
        try:
            sizes[dtype] = h.host_bytes
        finally:
            h.close()
    planes = 5
    bf16_planes, fp8_planes = planes * 128 * 64 * 2, planes * 128 * 64 + planes * 128 * 4
    check_room, work = 32 * 64 * 2, 128 * 64 * 2  # a quarter of the pass's rows (passes.check_room)
    assert sizes["fp8"] - sizes["bf16"] == 3 * (fp8_planes - bf16_planes + check_room) + work
