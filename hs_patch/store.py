"""Sample store, format v1: one safetensors file per sample plus an append-only manifest.

A sample is everything the capture hook saw for one request:

- ``input_ids``      int64 [L]   the tokens the server prefilled
- ``layer.<i>``      [L, H]      residual stream entering decoder layer i
                                 (the output of layer i-1; ``layer.0`` is the embedding)
- ``final.pre_norm`` [L, H]      output of the last decoder layer, before the final norm
- ``final.post_norm`` [L, H]     the same after the final norm (what the LM head reads)
- ``loss_mask``      uint8 [L]   added by the driver when it finalizes a sample

Nothing is padded: bytes per token = planes x hidden x dtype size (+ 8 for the id).
Metadata (strings) is in the safetensors header under ``__metadata__``.

A sample's key is :func:`sample_key` of its token ids, so the client that sent the
tokens can always find its sample, whatever the SGLang release (0.5.9 has no request
ids in the forward batch) and however the prefill was chunked. Files are written under a
temporary name and renamed when complete; a reader never sees a partial file. Every
completed file is recorded in ``manifest.jsonl`` with its byte size and sha256.

This module is imported inside the SGLang server by the capture hook: it must stay
light (standard library at import time; torch and safetensors only where used).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch

FORMAT = "hs_patch.sample/1"
SUFFIX = ".safetensors"
MANIFEST = "manifest.jsonl"
ERRORS = "errors.jsonl"
TMPDIR = ".tmp"
KEY_HEX = 32  # 128 bits of sha256: collisions are not a practical concern

# safetensors dtype names for the dtypes we store
_DTYPE_NAMES = {
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float32": "F32",
    "torch.int64": "I64",
    "torch.uint8": "U8",
    "torch.float8_e4m3fn": "F8_E4M3",
}
_DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "U8": 1, "F8_E4M3": 1}


class SampleError(ValueError):
    """A sample file or manifest entry is missing, damaged or inconsistent."""


def layer_plane(layer_id: int) -> str:
    """Tensor name of the residual stream entering decoder layer ``layer_id``."""
    return f"layer.{layer_id}"


FINAL_PLANES = {"pre": ("final.pre_norm",), "post": ("final.post_norm",),
                "both": ("final.pre_norm", "final.post_norm"), "none": ()}


def plane_names(layers: Sequence[int], final: str) -> list[str]:
    """The state planes a sample holds, in file order."""
    return [layer_plane(i) for i in layers] + list(FINAL_PLANES[final])


def sample_key(token_ids: Any) -> str:
    """Content key of a token sequence: sha256 of the ids as little-endian int64.

    Accepts a list/tuple of ints, a numpy array, a torch tensor or raw int64 bytes.
    The hook computes the same digest incrementally over chunked prefill passes.
    """
    return key_hasher(token_ids).hexdigest()[:KEY_HEX]


def key_hasher(token_ids: Any = None) -> "hashlib._Hash":
    """A sha256 object fed with ``token_ids`` (see :func:`sample_key`), for incremental use."""
    h = hashlib.sha256()
    if token_ids is not None:
        h.update(ids_bytes(token_ids))
    return h


def ids_bytes(token_ids: Any) -> bytes | memoryview:
    """Token ids as little-endian int64 bytes."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        return token_ids
    if hasattr(token_ids, "detach"):  # torch.Tensor
        import torch

        t = token_ids.detach().to("cpu", torch.int64).contiguous()
        return memoryview(t.numpy()).cast("B")
    if hasattr(token_ids, "dtype") and hasattr(token_ids, "tobytes"):  # numpy
        import numpy as np

        return np.ascontiguousarray(token_ids, dtype="<i8").tobytes()
    import array
    import sys

    a = array.array("q", (int(t) for t in token_ids))
    if sys.byteorder != "little":  # pragma: no cover
        a.byteswap()
    return a.tobytes()


def sample_path(directory: str | os.PathLike, key: str) -> Path:
    return Path(directory) / f"{key}{SUFFIX}"


# --------------------------------------------------------------------------- writing


@dataclass
class TensorBytes:
    """One tensor to write: its safetensors dtype name, shape and raw bytes (buffer views)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    buffers: list[Any]  # objects supporting the buffer protocol, concatenated in order

    @property
    def nbytes(self) -> int:
        n = _DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def tensor_bytes(name: str, t: "torch.Tensor") -> TensorBytes:
    """Wrap a contiguous CPU tensor without copying it."""
    dtype = _DTYPE_NAMES.get(str(t.dtype))
    if dtype is None:
        raise SampleError(f"dtype {t.dtype} of {name!r} is not storable; use bf16, fp16, fp32 or fp8")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise SampleError(f"{name!r} must be a contiguous CPU tensor")
    import torch

    raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return TensorBytes(name, dtype, tuple(t.shape), [memoryview(raw.numpy()).cast("B")])


def encode_header(tensors: Sequence[TensorBytes], metadata: Mapping[str, str]) -> bytes:
    """The 8-byte length and the JSON header, padded so the data starts 8-byte aligned."""
    header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return len(body).to_bytes(8, "little") + body


CHUNK = 1 << 20  # hash and write 1 MiB at a time: the bytes are read from memory once


def _write_hashed(fd: int, buffers: list[Any], digest: Any) -> None:
    """Write every buffer to ``fd`` and feed it to ``digest``, chunk by chunk, so each chunk
    is hashed while it is still in the CPU cache (about twice as fast as two passes)."""
    for buf in buffers:
        view = memoryview(buf).cast("B")
        for start in range(0, len(view), CHUNK):
            chunk = view[start:start + CHUNK]
            digest.update(chunk)
            while chunk:
                chunk = chunk[os.write(fd, chunk):]


@dataclass
class Written:
    key: str
    path: Path
    nbytes: int
    sha256: str


def write_sample(directory: str | os.PathLike, key: str, tensors: Sequence[TensorBytes],
                 metadata: Mapping[str, str], *, fsync: bool = False) -> Written:
    """Write one sample atomically (temp file + rename) and return its size and sha256.

    The safetensors format is written directly from the callers' buffers (the capture
    hook's pinned host memory), so no byte is copied in Python;
    :func:`read_sample` reads the files back with the ``safetensors`` library.
    """
    directory = Path(directory)
    tmp_dir = directory / TMPDIR
    tmp_dir.mkdir(parents=True, exist_ok=True)
    header = encode_header(tensors, metadata)
    buffers: list[Any] = [header]
    for t in tensors:
        got = sum(len(memoryview(b).cast("B")) for b in t.buffers)
        if got != t.nbytes:
            raise SampleError(f"{t.name!r}: {got} bytes given for shape {t.shape} {t.dtype}")
        buffers.extend(t.buffers)
    digest = hashlib.sha256()
    tmp = tmp_dir / f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_hashed(fd, buffers, digest)
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    final = sample_path(directory, key)
    os.replace(tmp, final)
    return Written(key, final, len(header) + sum(t.nbytes for t in tensors), digest.hexdigest())


def read_tensors(path: str | os.PathLike) -> dict[str, "torch.Tensor"]:
    """The tensors of a file this module wrote, read with torch alone (the capture hook
    reads its own files without safetensors; :mod:`hs_patch.reader` validates samples)."""
    import torch

    data = bytearray(Path(path).read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    dtypes = {v: getattr(torch, k.replace("torch.", "")) for k, v in _DTYPE_NAMES.items()}
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = torch.frombuffer(data, dtype=torch.uint8, count=end - start, offset=base + start)
        out[name] = raw.view(dtypes[info["dtype"]]).reshape(info["shape"])
    return out


def write_tensors(directory: str | os.PathLike, key: str, tensors: Mapping[str, "torch.Tensor"],
                  metadata: Mapping[str, str], *, fsync: bool = False) -> Written:
    """Write one sample from named CPU tensors (in the given order) with :func:`write_sample`."""
    return write_sample(directory, key, [tensor_bytes(n, t.contiguous()) for n, t in tensors.items()],
                        metadata, fsync=fsync)


def file_sha256(path: str | os.PathLike) -> tuple[int, str]:
    """(size, sha256) of a file, read in 8 MiB blocks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def verify_entry(directory: str | os.PathLike, entry: Mapping[str, Any]) -> str | None:
    """None if the entry's file exists with the manifest's size and sha256, else what is wrong."""
    path = Path(directory) / entry["file"]
    try:
        if path.stat().st_size != entry["bytes"]:
            return f"{path}: size {path.stat().st_size}, manifest says {entry['bytes']} (truncated?)"
        size, digest = file_sha256(path)
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if digest != entry["sha256"]:
        return f"{path}: sha256 {digest[:12]} differs from the manifest's {entry['sha256'][:12]}"
    return None


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Replace a small file (status, progress) so a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- manifest


class Manifest:
    """Append-only JSON-lines log of completed samples (``op: add``) and removals.

    One line per ``os.write`` on an ``O_APPEND`` descriptor under ``flock``, so several
    processes (the hook's writer, the driver) can append to the same file safely.
    ``name`` picks another log of the same kind (the shipper's ``shipped.jsonl``).
    """

    def __init__(self, directory: str | os.PathLike, name: str = MANIFEST):
        self.path = Path(directory) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def append(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":"), sort_keys=True) + "\n").encode()
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                os.write(fd, line)
            finally:
                os.close(fd)

    def add(self, written: Written, **extra: Any) -> None:
        self.append({"op": "add", "key": written.key, "file": written.path.name,
                     "bytes": written.nbytes, "sha256": written.sha256, "t": round(time.time(), 3), **extra})

    def remove(self, key: str, **extra: Any) -> None:
        self.append({"op": "remove", "key": key, "t": round(time.time(), 3), **extra})


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of an append-only JSON-lines log ([] if it does not exist).

    A torn last line (a crash mid-append) is ignored; a bad line elsewhere is an error.
    """
    path = Path(path)
    if not path.exists():
        return []
    records = []
    lines = path.read_bytes().split(b"\n")
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            records.append(json.loads(raw))
        except ValueError:
            if n >= len(lines) - 1:
                break
            raise SampleError(f"{path}:{n}: unreadable manifest line; it was not written by hs_patch") from None
    return records


def manifest_records(directory: str | os.PathLike, name: str = MANIFEST) -> list[dict[str, Any]]:
    """Every record of a directory's manifest in order (``add`` and ``remove``)."""
    return read_jsonl(Path(directory) / name)


def read_manifest(directory: str | os.PathLike, name: str = MANIFEST) -> dict[str, dict[str, Any]]:
    """The live entries by key (the last ``add`` of a key not removed after it); ``name``
    reads another log of the same kind (an export's ``export.jsonl``)."""
    entries: dict[str, dict[str, Any]] = {}
    for rec in manifest_records(directory, name):
        if rec.get("op") == "add":
            entries[rec["key"]] = rec
        elif rec.get("op") == "remove":
            entries.pop(rec["key"], None)
    return entries


def superseded(directory: str | os.PathLike) -> set[str]:
    """Live samples the hook recorded as the first part of a longer (chunked) prompt."""
    live = read_manifest(directory)
    return {r["key"] for r in manifest_records(directory) if r.get("op") == "superseded" and r["key"] in live}


def log_error(directory: str | os.PathLike, record: Mapping[str, Any]) -> None:
    """Append one JSON line to ``errors.jsonl`` (samples that could not be produced)."""
    line = json.dumps({"t": round(time.time(), 3), **record}, sort_keys=True) + "\n"
    with open(Path(directory) / ERRORS, "a", encoding="utf-8") as f:
        f.write(line)
