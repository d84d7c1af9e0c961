"""The capture's GPU memory: a few device buffers, allocated once at start, that snapshots go through.

A captured tensor must be copied on the compute stream before SGLang's next layer updates its
residual in place, and its copy to host memory (PCIe) must not hold the forward pass up. A device
clone per captured tensor did both, but allocated memory sized by the pass on the forward path:
5 planes x T x H x 2 bytes, about 1.2 GB a pass at 16,384 tokens and hidden 7168, from the
headroom SGLang leaves for activations (issue #22). Instead, the hook copies each captured tensor
into the next of ``HS_CAPTURE_DEVICE_BUFFERS`` buffers of ``HS_CAPTURE_SLOT_TOKENS`` rows, allocated
when the model is built (so SGLang sizes its KV cache around them), and copies that buffer to the
pass's pinned host slot on the side stream. Before a buffer is written again the compute stream
waits, on the GPU, for the copy that last read it: with captures layers apart that copy (about
2 ms for 117 MB at 55 GB/s) has long ended; captured tensors back to back (the final norm's input
and output, consecutive layers) wait for it only when more of them than there are buffers come
within that time. Nothing sized by the pass is allocated on the forward path: the capture's GPU
memory is :meth:`DeviceRing.nbytes` (+ the fingerprints' buffers), stated in the log at start.

On the CPU (tests, the stand-in, benchmarks) there is no ring: a captured tensor is copied straight
into the host slot, synchronously, which is already a snapshot.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from hs_patch.server import fp8


class DeviceRing:
    """``count`` device buffers of ``rows`` x ``hidden`` values of ``itemsize`` bytes, used in turn."""

    def __init__(self, count: int, rows: int, hidden: int, itemsize: int, device: torch.device):
        if count < 1:
            raise ValueError("HS_CAPTURE_DEVICE_BUFFERS must be >= 1")
        self.rows, self.hidden, self.itemsize, self.device = rows, hidden, itemsize, device
        self._raw = [torch.empty(rows * hidden * itemsize, dtype=torch.uint8, device=device) for _ in range(count)]
        self._read: list[Optional[Any]] = [None] * count  # the event after the copy that last read each buffer
        self._recorded = [False] * count
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self._raw)

    def snapshot(self, t: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Copy ``t`` [T, H] into the next buffer, in the current (compute) stream's order, once the copy
        that last read that buffer has ended (a wait on the GPU); returns (buffer index, the copy)."""
        k = self._take(t)
        view = self._raw[k][: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        return k, view

    def quantized(self, t: torch.Tensor, work: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        """HS_CAPTURE_DTYPE=fp8: ``t`` [T, H] quantized (:func:`hs_patch.server.fp8.quantize`, through ``work``)
        into the next buffer, its fp8 rows first and their fp32 scales after ``rows`` x ``hidden`` bytes (a
        buffer of 2-byte values holds both); returns (buffer index, the fp8 rows, the scales)."""
        k = self._take(t)
        n, h = t.shape
        if self.itemsize < 2 or self.hidden % 4:
            raise RuntimeError("hs_patch: the device buffers cannot hold fp8 rows and their scales (internal error)")
        raw = self._raw[k]
        q = raw[: n * h].view(torch.float8_e4m3fn).view(n, h)
        at = self.rows * h  # a multiple of 4: hidden is (fingerprint.check_hidden)
        scale = raw[at: at + 4 * n].view(torch.float32)
        fp8.quantize(t, work, q, scale)
        return k, q, scale

    def _take(self, t: torch.Tensor) -> int:
        """The next buffer, once the copy that last read it has ended (the compute stream waits, on the GPU)."""
        if t.shape[0] > self.rows or t.shape[1] != self.hidden or t.element_size() > self.itemsize:
            raise RuntimeError(f"hs_patch: a captured state of {tuple(t.shape)} {t.dtype} does not fit the device "
                               f"buffers of {self.rows} x {self.hidden} x {self.itemsize} bytes made at start; please "
                               "report this with the server's flags")
        k = self._next
        self._next = (k + 1) % len(self._raw)
        if self._recorded[k]:
            torch.cuda.current_stream(t.device).wait_event(self._read[k])
        return k

    def read_by(self, k: int, stream: Any) -> None:
        """Buffer ``k`` is read by work queued on ``stream`` until now: it is written again only after that."""
        if self._read[k] is None:
            self._read[k] = torch.cuda.Event()  # made once a buffer, recorded again at each use
        self._read[k].record(stream)
        self._recorded[k] = True
