"""A sample written in place while its prompt is prefilled in several chunks (format 2).

Used by the capture writer (:mod:`hs_patch.server.writer`) inside the SGLang server: the
first chunk of a prompt longer than one pass opens the file laid out for the whole prompt,
every chunk writes its rows at their final offsets (each byte once, never read back), and
the last one finishes it. The format itself is :mod:`hs_patch.samples.store`'s.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from hs_patch.samples import store
from hs_patch.samples.files import PRIVATE, file_ranged, pwrite_all

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("hs_patch")


class InPlaceSample:
    """A sample whose planes arrive in pieces (a prompt prefilled in several chunks).

    The full length is known from the first chunk, so the file is laid out at once:
    ``header room | plane 0 [L, H] | plane 1 | ... | input_ids | loss_mask``; each chunk's
    rows are written at their final offsets with ``pwrite`` (each byte once), and
    :meth:`finish` appends the small tensors, writes the header into its room and hashes
    the file (one read, its 64 MiB ranges side by side: a ranged digest). Nothing is visible
    until :func:`hs_patch.samples.store.publish`.
    """

    HEADER_ROOM = 64 << 10  # metadata is bounded (hs_patch.samples.intent caps the driver's part) but chunk lists
    CHUNKS_IN_ROOM = 32 << 10  # a chunk list (metadata "chunks") up to this long fits HEADER_ROOM

    def __init__(self, directory: str | os.PathLike, key_hint: str, planes: Sequence[str], tokens: int,
                 hidden: int, dtype: str):
        self.planes, self.tokens, self.hidden, self.dtype = list(planes), int(tokens), int(hidden), dtype
        self.row = hidden * store.DTYPE_SIZES[dtype]
        self.header_room = header_room(self.tokens)
        self.path = store.temp_path(directory, key_hint)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, PRIVATE)
        self.written = 0
        self._count = threading.Lock()  # chunks of one prompt may be written by several threads at once

    def plane_offset(self, idx: int) -> int:
        return self.header_room + idx * self.tokens * self.row

    def put(self, idx: int, start: int, data: Any) -> None:
        """Write rows ``start..`` of plane ``idx`` (a contiguous [n, H] buffer)."""
        n = len(memoryview(data).cast("B"))
        if n % self.row or start * self.row + n > self.tokens * self.row:
            raise store.SampleError(f"{self.planes[idx]}: {n} bytes at row {start} do not fit {self.tokens} rows")
        n = pwrite_all(self.fd, data, self.plane_offset(idx) + start * self.row)
        with self._count:
            self.written += n

    def finish(self, key: str, tail: Sequence[store.TensorBytes], metadata: Mapping[str, str], *,
               fsync: bool = False) -> store.Written:
        """Append the small tensors (ids, mask), write the header, hash; returns the temp sample."""
        try:
            expected = len(self.planes) * self.tokens * self.row
            if self.written != expected:
                raise store.SampleError(f"{self.written} plane bytes written, {expected} expected: a chunk is missing")
            offset = self.plane_offset(len(self.planes))
            for t in tail:
                for buf in t.buffers:
                    offset += pwrite_all(self.fd, buf, offset)
            specs = [store.tensor_spec(p, self.dtype, (self.tokens, self.hidden)) for p in self.planes] + list(tail)
            pwrite_all(self.fd, store.encode_header(specs, metadata, size=self.header_room), 0)
            if fsync:
                os.fsync(self.fd)
        except BaseException:
            self.abandon()
            raise
        os.close(self.fd)
        self.fd = -1
        size, digest = file_ranged(self.path, mapped=True)  # our own file: nobody truncates it
        if size != offset:
            self.path.unlink(missing_ok=True)
            raise store.SampleError(f"{self.path}: {size} bytes on disk, {offset} written")
        return store.Written(key, self.path, size, digest)

    def abandon(self) -> None:
        """Close and remove the partial file (a failed pass, a lost chunk)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


def header_room(tokens: int) -> int:
    """Bytes reserved for the header of a prompt of ``tokens`` written in place: HEADER_ROOM, plus what its
    chunk list can need beyond CHUNKS_IN_ROOM. Parts are laid out before their number is known, and a small
    --chunked-prefill-size cuts a long prompt into thousands (each start one more entry of "0,2,4,..."):
    the longest list is one part a token, "0,1,...,tokens-1"; its room costs nothing next to the planes."""
    longest, width, low = 0, 1, 0
    while low < tokens:  # the starts with `width` digits: low .. 10**width - 1
        high = min(tokens, 10 ** width)
        longest += (high - low) * (width + 1)
        low, width = high, width + 1
    extra = max(0, longest - InPlaceSample.CHUNKS_IN_ROOM)
    return InPlaceSample.HEADER_ROOM + -(-extra // 4096) * 4096


@dataclass
class OpenPrompt:
    """The writer's record of a prompt whose first parts are written and whose next part a later pass brings."""

    sample: InPlaceSample
    end: int
    hasher: Any
    rid: Optional[str]
    ids: list["torch.Tensor"]
    parts: int
    dtype: str
    starts: list[int] = field(default_factory=lambda: [0])  # where each part began
    fingerprints: list["torch.Tensor"] = field(default_factory=list)  # each part's rows [n, S, BLOCKS]
    checksums: list["torch.Tensor"] = field(default_factory=list)  # each part's rows [n, C, BLOCKS]
    scales: list["torch.Tensor"] = field(default_factory=list)  # fp8: each part's scales [planes, n]
    check: Optional["torch.Tensor"] = None  # HS_CAPTURE_FINAL=none: the LM head's input at its last rows
    writes: list[Any] = field(default_factory=list)  # the writer's jobs writing its earlier parts (futures)


def report_partial_prefill(directory: Any, rid: Optional[str], prefix: int, n: int, ids: "torch.Tensor",
                           opened: Optional[OpenPrompt]) -> None:
    """A request whose first ``prefix`` tokens were not computed in this pass and that continues no open
    prompt: never written; logged and recorded in ``errors.jsonl``."""
    why = ("its first tokens were not computed in this pass (radix-cache prefix hit?) and it "
           "continues no open chunked request; start the server with --disable-radix-cache")
    log.error("hs_patch: request rid=%s starts at token %d: %s. Not written.", rid, prefix, why)
    store.log_error(directory, {
        "error": "partial_prefill", "rid": rid, "prefix": int(prefix), "tokens": int(n),
        "part_key": store.sample_key(ids), "open": None if opened is None else
        {"end": opened.end, "tokens": opened.sample.tokens, "rid": opened.rid}, "why": why})


def report_lost(directory: Any, opened: OpenPrompt) -> None:
    """An open prompt whose next part did not come in the next pass: logged and recorded; its file goes."""
    why = "a chunked prompt's next part did not come in the next prefill pass; its partial file is removed"
    log.error("hs_patch: rid=%s after %d of %d tokens: %s", opened.rid, opened.end, opened.sample.tokens, why)
    store.log_error(directory, {"error": "chunk_lost", "rid": opened.rid, "end": opened.end,
                                "tokens": opened.sample.tokens, "why": why})
