"""The capture of one prefill pass: its staging slot, the collectors SGLang's layers call, the copies.

:class:`hs_patch.server.hook.CaptureHook` begins a :class:`Pass` per captured prefill pass.
Each captured tensor is fingerprinted on the live tensor (:mod:`hs_patch.server.fingerprint`)
and copied to the pass's pinned staging slot: on the GPU it is snapshotted into one of the
device buffers made at start (:mod:`hs_patch.server.device_ring`; its storage is updated in place
later) on the compute stream and copied from there to host memory on a side stream, so the
forward pass never waits for PCIe or disk and allocates nothing sized by the pass; on the CPU it
is copied into the slot at once. ``finish`` hands the pass to the writer once every plane and
every fingerprint stream is in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from hs_patch.server import fingerprint
from hs_patch.server.records import PassRecord

if TYPE_CHECKING:  # pragma: no cover
    from hs_patch.server.hook import CaptureHook


class Slot:
    """Host staging memory for one pass, allocated once at startup (pinned on a GPU host): int64 ids and
    int32 prompt lengths for ``capacity`` tokens, one [capacity, H] buffer per plane, and the fingerprints
    [streams, capacity, BLOCKS] fp32, with their device twin on ``device`` (the GPU's, made now too)."""

    def __init__(self, capacity: int, nplanes: int, nstreams: int, hidden: int, itemsize: int, pinned: bool,
                 device: Optional[torch.device] = None):
        self.capacity, self.hidden, self.itemsize = capacity, hidden, itemsize
        # device="cpu" always: SGLang builds the model inside `with torch.device("cuda")`
        self.ids = torch.empty(capacity, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self.lens = torch.empty(capacity, dtype=torch.int32, device="cpu", pin_memory=pinned)
        self._raw = [torch.empty(capacity * hidden * itemsize, dtype=torch.uint8, device="cpu", pin_memory=pinned)
                     for _ in range(nplanes)]
        self.fp = torch.empty(nstreams, capacity, fingerprint.BLOCKS, dtype=torch.float32, device="cpu",
                              pin_memory=pinned)
        self.fp_device = None if device is None else torch.empty(self.fp.shape, dtype=torch.float32, device=device)
        self.host_bytes = sum(t.numel() * t.element_size() for t in (self.ids, self.lens, self.fp, *self._raw))
        self.device_bytes = 0 if self.fp_device is None else self.fp_device.numel() * 4

    def plane(self, idx: int, like: torch.Tensor, tokens: int) -> torch.Tensor:
        """Plane ``idx``'s first ``tokens`` rows, viewed with ``like``'s dtype."""
        if like.element_size() > self.itemsize or like.shape[1] != self.hidden:
            raise RuntimeError(f"hs_patch: a captured state is {like.dtype} x {like.shape[1]}, the staging buffers "
                               f"were sized for {self.itemsize}-byte values x {self.hidden} (the model's dtype at "
                               "startup); please report this with the server's --dtype and quantization flags")
        return self._raw[idx][: tokens * self.hidden * self.itemsize].view(like.dtype).view(tokens, self.hidden)

    def fingerprints_on(self, device: torch.device) -> torch.Tensor:
        """Where a GPU pass computes its fingerprints: the slot's device buffer (made at start)."""
        if self.fp_device is None or self.fp_device.device != device:
            raise RuntimeError(f"hs_patch: a captured state is on {device}, the capture's device buffers were made "
                               f"on {None if self.fp_device is None else self.fp_device.device} at start (the current "
                               "CUDA device when the model was built); please report this with the server's flags")
        return self.fp_device


class Tee:
    """Stands in for SGLang's aux-state collector of one layer and copies what it gets to us."""

    __slots__ = ("_pass", "_idx", "_inner")

    def __init__(self, p: "Pass", idx: int, inner: Any):
        self._pass, self._idx, self._inner = p, idx, inner

    def append(self, t: torch.Tensor) -> None:
        """List style (the communicator family, 0.5.14 .. 0.5.20): SGLang's communicator hands over a clone
        of what it would overwrite later (we never say ``copies_on_append``, so from 0.5.17 it still does),
        or flashinfer's fresh residual, which nothing writes again."""
        if self._inner is not None:
            self._inner.append(t)
        self._pass.put(self._idx, t, owned=True)

    def capture(self, t: torch.Tensor, *, owned: bool = False) -> None:
        """Accumulator style (the layer-boundary family, and the layer-point patch): copy unless owned."""
        if self._inner is not None:
            self._inner.capture(t, owned=owned)
        self._pass.put(self._idx, t, owned=owned)

    def hs_attn_input(self, t: torch.Tensor) -> None:
        """What this layer's attention reads (the patch's line after ``prepare_attn``): fingerprinted only."""
        self._pass.fingerprint(self._pass.hook.attn_index[self._idx], t)

    def __len__(self) -> int:
        return len(self._inner) if self._inner is not None else 0


class Pass:
    """The capture of one prefill pass."""

    def __init__(self, hook: "CaptureHook", slot: Slot, tokens: int, seq_lens: list[int],
                 prefix_lens: list[int], rids: Optional[list[str]]):
        self.hook, self.slot, self.tokens = hook, slot, tokens
        self.seq_lens, self.prefix_lens = seq_lens, prefix_lens
        self.rids = list(rids) if rids is not None else None
        self.done = [False] * len(hook.planes)
        self.fingerprinted = [False] * len(hook.streams)
        self.like: list[Optional[torch.Tensor]] = [None] * len(hook.planes)
        self.cuda: Optional[torch.device] = None

    def copy_ids(self, ids: torch.Tensor, full: Any) -> None:
        """Copy the token ids and each request's whole prompt length (device tensors on a GPU)."""
        dst, lens = self.slot.ids[: self.tokens], self.slot.lens[: len(self.seq_lens)]
        if not isinstance(full, torch.Tensor):
            full = torch.tensor(list(full), dtype=torch.int32, device="cpu")
        if ids.is_cuda:
            self.cuda = ids.device
            stream = self.hook.stream(ids.device)
            stream.wait_stream(torch.cuda.current_stream(ids.device))
            with torch.cuda.stream(stream):
                dst.copy_(ids, non_blocking=True)
                lens.copy_(full, non_blocking=True)
            ids.record_stream(stream)
            if full.is_cuda:
                full.record_stream(stream)
        else:
            dst.copy_(ids)
            lens.copy_(full)

    def collector(self, layer_id: int, inner: Any) -> Any:
        idx = self.hook.layer_index.get(layer_id)
        return inner if idx is None else Tee(self, idx, inner)

    def _check_shape(self, name: str, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[0] != self.tokens:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise RuntimeError(f"hs_patch: {name} is {shape}, expected ({self.tokens}, hidden): a code path the "
                               "hook does not support")

    def fingerprint(self, stream: int, t: torch.Tensor) -> None:
        """Fingerprint stream ``stream`` from the live tensor, now (compute-stream order on a GPU)."""
        name = self.hook.streams[stream]
        if self.fingerprinted[stream]:
            raise RuntimeError(f"hs_patch: {name} captured twice in one pass")
        self._check_shape(name, t)
        if t.shape[1] != self.hook.hidden_size:
            raise RuntimeError(f"hs_patch: {name} has width {t.shape[1]}, the model's hidden size is "
                               f"{self.hook.hidden_size}: a code path the hook does not support")
        self.fingerprinted[stream] = True
        out = self.slot.fingerprints_on(t.device) if t.is_cuda else self.slot.fp
        fingerprint.block_sums(t, out[stream, : self.tokens])

    def put(self, idx: int, t: torch.Tensor, owned: bool) -> None:
        """Plane ``idx`` of this pass. ``owned`` (SGLang made this copy for us) changes nothing: every captured
        tensor is copied into memory made at start, so an owned one's memory is free again at once."""
        if self.done[idx]:
            raise RuntimeError(f"hs_patch: {self.hook.planes[idx]} captured twice in one pass")
        self._check_shape(self.hook.planes[idx], t)
        self.done[idx] = True
        self.like[idx] = t
        self.fingerprint(idx, t)  # a plane's stream index is its plane index
        dst = self.slot.plane(idx, t, self.tokens)
        if t.is_cuda:  # snapshot now (SGLang updates its residual in place later), into memory made at start
            ring = self.hook.ring(t.device)
            k, src = ring.snapshot(t)  # owned (SGLang's own clone) or not: its memory is free again at once
            stream = self.hook.stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            ring.read_by(k, stream)  # buffer k is written again only after this copy
        else:  # CPU (tests, the stand-in, benchmarks): the copy into the slot is the snapshot
            dst.copy_(t)

    def final_prenorm(self, t: torch.Tensor, owned: bool = False) -> None:
        hook = self.hook
        if hook.pre_index is not None:
            self.put(hook.pre_index, t, owned)
        else:  # not stored: its fingerprint still is (the final-norm relation)
            self.fingerprint(hook.streams.index("final.pre_norm"), t)

    def finish(self, post_norm: torch.Tensor) -> None:
        hook = self.hook
        hook._current = None
        try:
            if hook.post_index is not None:
                self.put(hook.post_index, post_norm, owned=False)
            else:
                self.fingerprint(hook.streams.index("final.post_norm"), post_norm)
            missing = [hook.streams[k] for k, d in enumerate(self.fingerprinted) if not d]
            if missing:
                raise RuntimeError(f"hs_patch: {missing} were not captured in this pass (a layer ran outside the "
                                   "patched loop, or the installed patch is older than this hs_patch: run hs-patch "
                                   "apply); refusing to write incomplete samples")
        except BaseException:
            hook._free.put(self.slot)
            raise
        n = self.tokens
        slot = self.slot
        wait = None
        if self.cuda is not None:
            stream = hook.stream(self.cuda)
            stream.wait_stream(torch.cuda.current_stream(self.cuda))
            with torch.cuda.stream(stream):  # one contiguous copy a stream: an asynchronous DMA each
                for k in range(len(hook.streams)):
                    slot.fp[k, :n].copy_(slot.fp_device[k, :n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            wait = event.synchronize
        hook.writer.submit(PassRecord(
            ids=slot.ids[:n], planes=[slot.plane(k, self.like[k], n) for k in range(len(hook.planes))],
            seq_lens=self.seq_lens, prefix_lens=self.prefix_lens, full_lens=slot.lens[: len(self.seq_lens)],
            rids=self.rids, wait=wait, release=lambda: hook._free.put(slot), fingerprints=slot.fp[:, :n]))
