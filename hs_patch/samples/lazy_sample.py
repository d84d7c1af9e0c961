"""Reading one sample lazily, for readers that stream large samples (the exporters, the fidelity check).

``open_sample`` opens a sample as a memory map and makes the checks of
:func:`hs_patch.samples.reader.read_sample` on its header (format tag, every declared plane's dtype
and shape, the fingerprint and checksum tensors', that the token ids hash to the key; given its manifest
entry, size and sha256 first); :class:`LazySample` then reads one tensor, or a few rows of a
plane, at a time, so memory holds what was asked for, not the file. An fp8 sample's planes are read
dequantized to the dtype the engine computed (bf16) unless asked for raw (``raw=True``, scales by
:meth:`LazySample.scale`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from hs_patch.samples.reader import check_entry, is_fp8, record_shapes, source_dtype
from hs_patch.samples.store import FORMATS_READ, SampleError, sample_key
from hs_patch.server import fp8

if TYPE_CHECKING:  # pragma: no cover
    import torch


class LazySample:
    """One sample opened as a memory map: header checked, tensors read one at a time.

    For readers that stream large samples (the exporters): memory holds the tensor asked
    for, not the file. Use as a context manager, or call :meth:`close`.
    """

    def __init__(self, path: Path, handle: Any, metadata: dict[str, str], names: set[str]):
        self.path, self._f, self.metadata, self._names = path, handle, metadata, names
        self._fp8 = is_fp8(path, metadata)
        self._planes = set(metadata.get("planes", "").split(","))
        self._source = source_dtype(metadata) if self._fp8 else None

    @property
    def key(self) -> str:
        return self.metadata["key"]

    @property
    def planes(self) -> list[str]:
        return self.metadata["planes"].split(",")

    @property
    def num_tokens(self) -> int:
        return int(self.metadata["num_tokens"])

    @property
    def fp8(self) -> bool:
        """Its planes are fp8 with a scale a token (checked at open: :func:`hs_patch.samples.reader.is_fp8`)."""
        return self._fp8

    def has(self, name: str) -> bool:
        return name in self._names

    def tensor(self, name: str, *, raw: bool = False) -> "torch.Tensor":
        """A copy of one tensor (``input_ids``, a plane, ``loss_mask``); an fp8 sample's plane dequantized to the
        dtype the engine computed (bf16), or as stored with ``raw`` (its scales: :meth:`scale`)."""
        if name not in self._names:
            raise SampleError(f"{self.path}: no tensor {name!r} (it has {sorted(self._names)})")
        t = self._f.get_tensor(name)
        return t if raw or not self._dequantize(name) else fp8.dequantize(t, self.scale(name), self._source)

    def rows(self, name: str, start: int, stop: int, *, raw: bool = False) -> "torch.Tensor":
        """Rows [start, stop) of a plane, reading only those bytes (fp8: dequantized unless ``raw``)."""
        if name not in self._names:
            raise SampleError(f"{self.path}: no tensor {name!r} (it has {sorted(self._names)})")
        t = self._f.get_slice(name)[start:stop]
        if raw or not self._dequantize(name):
            return t
        return fp8.dequantize(t, self._f.get_slice(fp8.scale_name(name))[start:stop], self._source)

    def scale(self, name: str) -> "torch.Tensor":
        """An fp8 plane's scales, F32 [L]; SampleError for a bf16 sample."""
        if not self._fp8:
            raise SampleError(f"{self.path}: its planes are {self.metadata.get('dtype')}, not fp8: no scales")
        return self._f.get_tensor(fp8.scale_name(name))

    def _dequantize(self, name: str) -> bool:
        return self._fp8 and name in self._planes

    def close(self) -> None:
        self._f.__exit__(None, None, None)

    def __enter__(self) -> "LazySample":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def open_sample(path: str | os.PathLike, *, entry: Mapping[str, Any] | None = None) -> LazySample:
    """Open one sample lazily, with the checks of :func:`read_sample` made on the header.

    Given its manifest ``entry``, the file's size and sha256 are checked first (one
    streaming read); then every declared plane's dtype and shape, and that the token ids
    hash to the key. Raise :class:`SampleError` saying what is wrong.
    """
    from safetensors import SafetensorError, safe_open

    from hs_patch.samples.store import DTYPE_NAMES

    path = Path(path)
    if entry is not None:
        check_entry(path, entry)
    try:
        f = safe_open(str(path), "pt")
        f.__enter__()
    except (SafetensorError, OSError, ValueError) as e:
        raise SampleError(f"{path}: not a readable safetensors file ({e})") from None
    try:
        sample = LazySample(path, f, dict(f.metadata() or {}), set(f.keys()))
    except BaseException:
        f.__exit__(None, None, None)
        raise
    try:
        meta = sample.metadata
        if meta.get("format") not in FORMATS_READ:
            raise SampleError(f"{path}: format {meta.get('format')!r}, expected one of {', '.join(FORMATS_READ)}")
        n, hidden = int(meta.get("num_tokens", -1)), int(meta.get("hidden_size", -1))
        want = {"input_ids": ("I64", [n])}
        want.update({p: (DTYPE_NAMES.get("torch." + meta.get("dtype", ""), "?"), [n, hidden]) for p in sample.planes})
        if sample.has("loss_mask"):
            want["loss_mask"] = ("U8", [n])
        want.update(record_shapes(path, meta, n))
        for name, (dtype, shape) in want.items():
            if not sample.has(name):
                raise SampleError(f"{path}: {name!r} is missing")
            sl = f.get_slice(name)
            if sl.get_dtype() != dtype or list(sl.get_shape()) != shape:
                raise SampleError(f"{path}: {name!r} is {sl.get_dtype()} {sl.get_shape()}, expected {dtype} {shape}")
        if sample_key(sample.tensor("input_ids")) != meta.get("key"):
            raise SampleError(f"{path}: token ids do not hash to the sample key {meta.get('key')}")
    except BaseException:
        sample.close()
        raise
    return sample
