"""The capture of one prefill pass: its staging slot, the collectors SGLang's layers call, the copies.

:class:`hs_patch.server.hook.CaptureHook` begins a :class:`Pass` per captured prefill pass.
Each captured tensor is fingerprinted on the live tensor (:mod:`hs_patch.server.fingerprint`:
block sums, and for a stored plane the exact word sums of its bytes) and copied to the pass's
pinned staging slot: on the GPU it is snapshotted into one of the device buffers made at start
(:mod:`hs_patch.server.device_ring`; its storage is updated in place later) on the compute
stream and copied from there to host memory on a side stream, so the forward pass never waits
for PCIe or disk and allocates nothing sized by the pass; on the CPU it is copied into the slot
at once. ``finish`` hands the pass to the writer once every plane and every fingerprint stream
is in.

What a pass needs of its hook is :class:`Owner` (the hook implements it; this module never
imports the hook).
"""

from __future__ import annotations

from contextlib import nullcontext as _nothing
from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from hs_patch.server import fingerprint, fp8
from hs_patch.server.check_rows import fit_check_counts
from hs_patch.server.records import PassRecord


class Owner(Protocol):
    """What a :class:`Pass` uses of the hook that began it."""

    planes: list[str]
    streams: list[str]
    checksums: list[str]
    hidden_size: int
    layer_index: dict[int, int]
    attn_index: list[int]
    additive_index: list[tuple[int, int, int, int]]
    pre_index: Optional[int]
    post_index: Optional[int]
    check_rows: int
    fp8: bool
    all_reduce: Optional[Callable[[torch.Tensor], None]]

    def ring(self, device: torch.device) -> Any: ...

    def work(self, like: torch.Tensor) -> torch.Tensor: ...

    def stream(self, device: torch.device) -> Any: ...

    def ended(self, p: "Pass") -> None: ...

    def give_back(self, slot: "Slot") -> None: ...

    def submit(self, record: PassRecord) -> None: ...


class Slot:
    """Host staging memory for one pass, allocated once at startup (pinned on a GPU host): int64 ids and
    int32 prompt lengths for ``capacity`` tokens, one [capacity, H] buffer per plane, the fingerprints
    [streams, capacity, BLOCKS] fp32 and the checksums [checksums, capacity, BLOCKS] int32, with their
    device twins on ``device`` (the GPU's, made now too)."""

    def __init__(self, capacity: int, nplanes: int, nstreams: int, hidden: int, itemsize: int, pinned: bool,
                 device: Optional[torch.device] = None, nchecksums: int = 0, check: int = 0,
                 fp8: bool = False):
        self.capacity, self.hidden, self.itemsize = capacity, hidden, itemsize
        self.plane_itemsize = 1 if fp8 else itemsize  # HS_CAPTURE_DTYPE=fp8: one byte a value, + a scale a row
        # device="cpu" always: SGLang builds the model inside `with torch.device("cuda")`
        self.ids = torch.empty(capacity, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self.lens = torch.empty(capacity, dtype=torch.int32, device="cpu", pin_memory=pinned)
        self._raw = [torch.empty(capacity * hidden * self.plane_itemsize, dtype=torch.uint8, device="cpu",
                                 pin_memory=pinned) for _ in range(nplanes)]
        self.sc = torch.empty(nplanes if fp8 else 0, capacity, dtype=torch.float32, device="cpu", pin_memory=pinned)
        self.fp = torch.empty(nstreams, capacity, fingerprint.BLOCKS, dtype=torch.float32, device="cpu",
                              pin_memory=pinned)
        self.cs = torch.empty(nchecksums, capacity, fingerprint.BLOCKS, dtype=torch.int32, device="cpu",
                              pin_memory=pinned)
        # HS_CAPTURE_FINAL=none or fp8: the LM head's input at each part's last rows, ``check`` rows of room
        # (:mod:`hs_patch.server.check_rows`: a pass needing more keeps fewer rows a part)
        self.check_room = check
        self._check = torch.empty(check * hidden * itemsize, dtype=torch.uint8, device="cpu", pin_memory=pinned)
        self.fp_device = None if device is None else torch.empty(self.fp.shape, dtype=torch.float32, device=device)
        self.cs_device = None if device is None else torch.empty(self.cs.shape, dtype=torch.int32, device=device)
        self.host_bytes = sum(t.numel() * t.element_size()
                              for t in (self.ids, self.lens, self.fp, self.cs, self.sc, self._check, *self._raw))
        self.device_bytes = 0 if device is None else (self.fp.numel() + self.cs.numel()) * 4

    def plane(self, idx: int, like: torch.Tensor, tokens: int) -> torch.Tensor:
        """Plane ``idx``'s first ``tokens`` rows, viewed with ``like``'s dtype."""
        if like.element_size() > self.plane_itemsize or like.shape[1] != self.hidden:
            raise RuntimeError(f"hs_patch: a captured state is {like.dtype} x {like.shape[1]}, the staging buffers "
                               f"were sized for {self.plane_itemsize}-byte values x {self.hidden} (the model's dtype "
                               "at startup, or fp8); please report this with the server's --dtype and quantization "
                               "flags")
        size = tokens * self.hidden * like.element_size()
        return self._raw[idx][:size].view(like.dtype).view(tokens, self.hidden)

    def fp8_plane(self, idx: int, tokens: int) -> torch.Tensor:
        """HS_CAPTURE_DTYPE=fp8: plane ``idx``'s first ``tokens`` rows as float8_e4m3fn (their scales: ``sc``)."""
        return self._raw[idx][: tokens * self.hidden].view(torch.float8_e4m3fn).view(tokens, self.hidden)

    def check(self, like: torch.Tensor, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of the check buffer, viewed with ``like``'s dtype; past its room (a pass of
        more parts than it has rows: :func:`hs_patch.server.check_rows.fit_check_counts`) a buffer of this pass's
        own, in pageable memory."""
        if rows > self.check_room:
            return torch.empty(rows, self.hidden, dtype=like.dtype, device="cpu")
        return self._check[: rows * self.hidden * like.element_size()].view(like.dtype).view(rows, self.hidden)

    def on(self, t: torch.Tensor, host: torch.Tensor, dev: Optional[torch.Tensor]) -> torch.Tensor:
        """Where a pass computes a record of ``t``: the host buffer (CPU), or its device twin made at start."""
        if not t.is_cuda:
            return host
        if dev is None or dev.device != t.device:
            raise RuntimeError(f"hs_patch: a captured state is on {t.device}, the capture's device buffers were made "
                               f"on {None if dev is None else dev.device} at start (the current CUDA device when the "
                               "model was built); please report this with the server's flags")
        return dev


def attention_output(fp: torch.Tensor, k_sum: int, k_sq: int, t: torch.Tensor, tokens: int,
                     all_reduce: Optional[Callable[[torch.Tensor], None]]) -> None:
    """Block sums and squares of one rank's share of a layer's attention output into ``fp[k_sum]``,
    ``fp[k_sq]``, then summed over the tensor-parallel ranks (every rank calls this at the same point
    of the same pass: the writing one from its :class:`Tee`, the others from
    :class:`hs_patch.server.ranks.RankTee`)."""
    fingerprint.block_sums(t, fp[k_sum, :tokens])
    fingerprint.block_squares(t, fp[k_sq, :tokens])
    if all_reduce is not None:
        all_reduce(fp[k_sum, :tokens])
        all_reduce(fp[k_sq, :tokens])


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

    def hs_attn_output(self, t: torch.Tensor) -> None:
        """This rank's share of the layer's attention output (the patch's line before ``prepare_mlp``)."""
        self._pass.attention_output(self._idx, t)

    def hs_mid(self, t: torch.Tensor) -> None:
        """The residual after the attention output was added (the patch's line after ``prepare_mlp``)."""
        self._pass.mid(self._idx, t)

    def __len__(self) -> int:
        return len(self._inner) if self._inner is not None else 0


class Pass:
    """The capture of one prefill pass."""

    def __init__(self, hook: Owner, slot: Slot, tokens: int, seq_lens: list[int],
                 prefix_lens: list[int], rids: Optional[list[str]]):
        self.hook, self.slot, self.tokens = hook, slot, tokens
        self.seq_lens, self.prefix_lens = seq_lens, prefix_lens
        self.rids = list(rids) if rids is not None else None
        self.done = [False] * len(hook.planes)
        self.fingerprinted = [False] * len(hook.streams)
        self.checksummed = [False] * len(hook.checksums)
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
        if t.shape[1] != self.hook.hidden_size:
            raise RuntimeError(f"hs_patch: {name} has width {t.shape[1]}, the model's hidden size is "
                               f"{self.hook.hidden_size}: a code path the hook does not support")

    def _mark(self, done: list[bool], k: int, names: Sequence[str], t: torch.Tensor) -> None:
        if done[k]:
            raise RuntimeError(f"hs_patch: {names[k]} captured twice in one pass")
        self._check_shape(names[k], t)
        done[k] = True

    def fingerprint(self, stream: int, t: torch.Tensor) -> None:
        """Fingerprint stream ``stream`` from the live tensor, now (compute-stream order on a GPU)."""
        self._mark(self.fingerprinted, stream, self.hook.streams, t)
        out = self.slot.on(t, self.slot.fp, self.slot.fp_device)
        fingerprint.block_sums(t, out[stream, : self.tokens])

    def checksum(self, k: int, t: torch.Tensor, scale: Optional[torch.Tensor] = None) -> None:
        """Checksum stream ``k`` (the exact word sums of each row's bytes) from the tensor stored, now: the live
        one, or its fp8 rows with their ``scale`` (folded into the last block: :func:`fp8.add_scale_word`)."""
        self._mark(self.checksummed, k, self.hook.checksums, t)
        out = self.slot.on(t, self.slot.cs, self.slot.cs_device)
        fingerprint.word_sums(t, out[k, : self.tokens])
        if scale is not None:
            fp8.add_scale_word(out[k, : self.tokens], scale)

    def embedded(self, t: Optional[torch.Tensor]) -> None:
        """The rows the residual stream begins from (the model's embedding of the pass's ids)."""
        if t is not None:
            self.checksum(len(self.hook.planes), t)

    def attention_output(self, idx: int, t: torch.Tensor) -> None:
        k_sum, k_sq, _, _ = self.hook.additive_index[idx]
        for k in (k_sum, k_sq):
            self._mark(self.fingerprinted, k, self.hook.streams, t)
        attention_output(self.slot.on(t, self.slot.fp, self.slot.fp_device), k_sum, k_sq, t, self.tokens,
                         self.hook.all_reduce)

    def mid(self, idx: int, t: torch.Tensor) -> None:
        _, _, k_sum, k_sq = self.hook.additive_index[idx]
        for k in (k_sum, k_sq):
            self._mark(self.fingerprinted, k, self.hook.streams, t)
        out = self.slot.on(t, self.slot.fp, self.slot.fp_device)
        fingerprint.block_sums(t, out[k_sum, : self.tokens])
        fingerprint.block_squares(t, out[k_sq, : self.tokens])

    def put(self, idx: int, t: torch.Tensor, owned: bool) -> None:
        """Plane ``idx`` of this pass. ``owned`` (SGLang made this copy for us) changes nothing: every captured
        tensor is copied into memory made at start, so an owned one's memory is free again at once."""
        if self.done[idx]:
            raise RuntimeError(f"hs_patch: {self.hook.planes[idx]} captured twice in one pass")
        self._check_shape(self.hook.planes[idx], t)
        self.done[idx] = True
        self.fingerprint(idx, t)  # a plane's stream index is its plane index, in both records; before any quantization
        if self.hook.fp8:
            self.put_fp8(idx, t)
            return
        self.like[idx] = t
        self.checksum(idx, t)
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

    def put_fp8(self, idx: int, t: torch.Tensor) -> None:
        """HS_CAPTURE_DTYPE=fp8: plane ``idx`` quantized where it is (:func:`hs_patch.server.fp8.quantize`) into
        memory made at start, checksummed as stored (fp8 bytes and scales), then copied to the host slot: on a GPU
        into the next device buffer on the compute stream, then half the bytes over PCIe on the side stream."""
        q_host, sc_host = self.slot.fp8_plane(idx, self.tokens), self.slot.sc[idx, : self.tokens]
        self.like[idx] = q_host
        work = self.hook.work(t)
        if not t.is_cuda:  # CPU (tests, the stand-in, benchmarks): quantized straight into the slot
            fp8.quantize(t, work, q_host, sc_host)
            self.checksum(idx, q_host, sc_host)
            return
        ring = self.hook.ring(t.device)
        k, q, sc = ring.quantized(t, work)
        self.checksum(idx, q, sc)
        stream = self.hook.stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            q_host.copy_(q, non_blocking=True)
            sc_host.copy_(sc, non_blocking=True)
        ring.read_by(k, stream)  # buffer k is written again only after these copies

    def final_inputs(self, update: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
        """The final norm's two inputs, before its fused addition overwrites ``residual`` (None: no addition)."""
        streams = self.hook.streams
        if fingerprint.FINAL_ADD[0] not in streams:
            return
        k_res, k_upd = streams.index(fingerprint.FINAL_ADD[0]), streams.index(fingerprint.FINAL_ADD[1])
        self._mark(self.fingerprinted, k_upd, streams, update)
        self._mark(self.fingerprinted, k_res, streams, update if residual is None else residual)
        out = self.slot.on(update, self.slot.fp, self.slot.fp_device)
        fingerprint.block_sums(update, out[k_upd, : self.tokens])
        if residual is None:
            out[k_res, : self.tokens].zero_()
        else:
            fingerprint.block_sums(residual, out[k_res, : self.tokens])

    def final_prenorm(self, t: torch.Tensor, owned: bool = False) -> None:
        hook = self.hook
        if hook.pre_index is not None:
            self.put(hook.pre_index, t, owned)
        else:  # not stored: its fingerprint still is (the final-norm relation)
            self.fingerprint(hook.streams.index("final.pre_norm"), t)
        if fingerprint.FINAL_ADD[2] in hook.streams:  # the squares: the final addition's rounding
            k = hook.streams.index(fingerprint.FINAL_ADD[2])
            self._mark(self.fingerprinted, k, hook.streams, t)
            fingerprint.block_squares(t, self.slot.on(t, self.slot.fp, self.slot.fp_device)[k, : self.tokens])

    def finish(self, post_norm: torch.Tensor) -> None:
        hook = self.hook
        hook.ended(self)
        try:
            if hook.post_index is not None:
                self.put(hook.post_index, post_norm, owned=False)
            else:
                self.fingerprint(hook.streams.index("final.post_norm"), post_norm)
            missing = [n for n, d in zip(hook.streams, self.fingerprinted) if not d] + \
                [n for n, d in zip(hook.checksums, self.checksummed) if not d]
            if missing:
                raise RuntimeError(f"hs_patch: {missing} were not captured in this pass (a layer ran outside the "
                                   "patched loop, or the installed patch is older than this hs_patch: run hs-patch "
                                   "apply); refusing to write incomplete samples")
        except BaseException:
            hook.give_back(self.slot)
            raise
        n = self.tokens
        slot = self.slot
        counts = fit_check_counts(self.seq_lens, hook.check_rows, slot.check_room) if hook.check_rows else None
        check = None if counts is None else self.keep_check_rows(post_norm, counts)
        wait = None
        if self.cuda is not None:
            stream = hook.stream(self.cuda)
            stream.wait_stream(torch.cuda.current_stream(self.cuda))
            with torch.cuda.stream(stream):  # one contiguous copy a stream: an asynchronous DMA each
                for k in range(len(hook.streams)):
                    slot.fp[k, :n].copy_(slot.fp_device[k, :n], non_blocking=True)
                for k in range(len(hook.checksums)):
                    slot.cs[k, :n].copy_(slot.cs_device[k, :n], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            wait = event.synchronize
        hook.submit(PassRecord(
            ids=slot.ids[:n], planes=[slot.plane(k, self.like[k], n) for k in range(len(hook.planes))],
            seq_lens=self.seq_lens, prefix_lens=self.prefix_lens, full_lens=slot.lens[: len(self.seq_lens)],
            rids=self.rids, wait=wait, release=lambda: hook.give_back(slot), fingerprints=slot.fp[:, :n],
            checksums=slot.cs[:, :n], check_rows=check, check_counts=counts,
            scales=slot.sc[:, :n] if hook.fp8 else None))

    def keep_check_rows(self, post_norm: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """HS_CAPTURE_FINAL=none or fp8 planes: each part's last ``counts[j]`` rows of the LM head's input (as the
        engine computed it), one after another,
        into the slot's check buffer (on a GPU snapshotted into a device buffer made at start, then only those
        rows copied to the host on the side stream)."""
        self._check_shape("the LM head's input", post_norm)
        dst = self.slot.check(post_norm, sum(counts))
        ends = [sum(self.seq_lens[: j + 1]) for j in range(len(counts))]
        src, stream, k = post_norm, None, None
        if post_norm.is_cuda:
            ring = self.hook.ring(post_norm.device)
            k, src = ring.snapshot(post_norm)
            stream = self.hook.stream(post_norm.device)
            stream.wait_stream(torch.cuda.current_stream(post_norm.device))
        at = 0
        with torch.cuda.stream(stream) if stream is not None else _nothing():
            for m, end in zip(counts, ends):
                dst[at:at + m].copy_(src[end - m:end], non_blocking=stream is not None)
                at += m
        if stream is not None:
            ring.read_by(k, stream)
        return dst
