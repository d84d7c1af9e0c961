"""Every row of every stored plane, and the embedded rows, against the exact checksums the hook took.

The capture hook computed, on the GPU and from the live tensors, each row's bytes as
little-endian 32-bit words summed modulo 2^32 over 8 blocks (:func:`hs_patch.server.fingerprint.word_sums`):

- for every stored plane, so the file's bytes are compared here with what the forward pass held,
  every row of every plane, with no tolerance: a row misplaced, replaced, stale, shifted, NaN'd or
  garbled anywhere between the GPU and the file fails (issue #33: the row checks read 8 rows a
  chunk). numpy's wrapping uint32 reduction reads the memory-mapped file at the speed of memory (on
  the 2-core dev VM 4-5 GB/s from tmpfs, mapping included: about 0.2 CPU s per GB of states;
  bench/fidelity_check.py measures it where it runs);
- for ``embed``, the rows the model's residual stream began from (its embedding of the pass's
  ids, in the order the model holds its rows): recomputed here from the embedding weight and
  the sample's ``input_ids``, so every row of the sample is tied to the token the engine ran
  there (a table of the checksums of every vocabulary row, made once from the weight).

Standard library, numpy and torch (through the model file readers).
"""

from __future__ import annotations

import json
import mmap
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from hs_patch.samples import store
from hs_patch.server import fingerprint, fp8

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

EMBED_NAMES = ("model.embed_tokens.weight", "language_model.model.embed_tokens.weight",
               "model.language_model.embed_tokens.weight")


def host_word_sums(data: Any, rows: int) -> "np.ndarray":
    """:func:`hs_patch.server.fingerprint.word_sums` of ``rows`` rows held in a bytes-like object (a memory
    map's slice), as int32 [rows, BLOCKS]."""
    import numpy as np

    words = np.frombuffer(data, dtype="<u4")
    return np.add.reduce(words.reshape(rows, fingerprint.BLOCKS, -1), axis=-1, dtype=np.uint32).view(np.int32)


def tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's (first byte, end) in a safetensors file, from its header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return {k: (8 + n + int(v["data_offsets"][0]), 8 + n + int(v["data_offsets"][1]))
            for k, v in header.items() if k != "__metadata__"}


def mismatched_rows(path: Path, checksums: "torch.Tensor", names: Sequence[str], planes: Sequence[str],
                    rows: int, *, scaled: bool = False) -> dict[str, list[int]]:
    """Plane -> the rows whose bytes in the file differ from their checksum (every row of every stored
    plane); ``checksums`` I32 [L, C, BLOCKS] with ``names`` its streams. ``scaled`` (an fp8 sample): each
    row's scale word, from ``<plane>.scale``, is in its last block's sum (:func:`fp8.add_scale_word`)."""
    import numpy as np

    spans = tensor_spans(path)
    out: dict[str, list[int]] = {}
    want = checksums.numpy()

    def bad_rows(m: mmap.mmap, plane: str) -> list[int]:  # the map's views end with this call
        a, b = spans[plane]
        with memoryview(m) as whole, whole[a:b] as view:
            got = host_word_sums(view, rows)
            if scaled:
                sa, sb = spans[fp8.scale_name(plane)]
                with whole[sa:sb] as words:
                    last = got[:, -1].view(np.uint32) + np.frombuffer(words, dtype="<u4")  # wraps modulo 2^32
                    got[:, -1] = last.view(np.int32)
            bad = np.nonzero((got != want[:, names.index(plane)]).any(-1))[0].tolist()
            del got
        return bad

    # MAP_POPULATE: the pages mapped up front, not faulted in one at a time (1.5x faster on tmpfs, dev VM)
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ) as m:
        for plane in planes:
            if plane in names and (bad := bad_rows(m, plane)):
                out[plane] = bad
    return out


class Embeddings:
    """The checksum of every row of the served model's embedding weight, made once when first needed."""

    def __init__(self, directory: Optional[str | Path] = None, weight: Optional["torch.Tensor"] = None):
        self.directory, self._weight = directory, weight
        self._tables: dict[str, "np.ndarray"] = {}
        self._lock = threading.Lock()

    def table(self, dtype: "torch.dtype") -> "np.ndarray":
        """int32 [V, BLOCKS]: each vocabulary row as the model holds it in ``dtype`` (the samples' dtype)."""
        key = str(dtype)
        with self._lock:
            if key not in self._tables:
                w = self._weight
                if w is None:
                    from hs_patch.host.model_files import find_name, read_tensor

                    if self.directory is None:
                        raise store.SampleError("no embedding weight was given to check the embedded rows with")
                    w = read_tensor(self.directory, find_name(self.directory, EMBED_NAMES, "embedding weight"))
                w = w.to(dtype).contiguous()
                raw = memoryview(w.view(-1).view(__import__("torch").uint8).numpy())
                self._tables[key] = host_word_sums(raw, w.shape[0])
            return self._tables[key]

    def mismatched(self, ids: "torch.Tensor", rows: "torch.Tensor", dtype: "torch.dtype") -> list[int]:
        """The rows whose embedded checksum is not the embedding of the token there (an id outside the
        vocabulary fails its row)."""
        import numpy as np

        table = self.table(dtype)
        idx = ids.numpy()
        inside = (idx >= 0) & (idx < table.shape[0])
        expect = np.zeros((len(idx), fingerprint.BLOCKS), dtype=np.int32)
        expect[inside] = table[idx[inside]]
        bad = ~inside | (expect != rows.numpy()).any(-1)
        return np.nonzero(bad)[0].tolist()
