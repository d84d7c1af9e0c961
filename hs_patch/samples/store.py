"""Sample store: one safetensors file per sample plus an append-only manifest.

A sample is everything the capture hook saw for one request:

- ``layer.<i>``      [L, H]      residual stream entering decoder layer i
                                 (the output of layer i-1; ``layer.0`` is the embedding)
- ``final.pre_norm`` [L, H]      output of the last decoder layer, before the final norm
- ``final.post_norm`` [L, H]     the same after the final norm (what the LM head reads)
- ``input_ids``      int64 [L]   the tokens the server prefilled
- ``loss_mask``      uint8 [L]   from the driver's intent (see :mod:`hs_patch.samples.intent`), when
                                 the request came from the driver

Format 2 (``hs_patch.sample/2``) is written ONCE by the hook: the planes come first in the
file, so a prompt prefilled in several chunks is written in place, each chunk's rows at
their final offsets (the full length is known from the first chunk), and the small
tensors and the header follow at the end. Format 1 (the driver rewrote each sample to add
the loss mask) is still read. Nothing is padded: bytes per token = planes x hidden x dtype
size + 8 (+ 1 with a loss mask). Metadata (strings) is in the safetensors header.

A sample's key is :func:`sample_key` of its token ids, so the client that sent the
tokens can always find its sample, whatever the SGLang release (0.5.9 has no request
ids in the forward batch) and however the prefill was chunked. Files are written under
``.tmp/`` and renamed when complete; a reader never sees a partial file. Every
completed file is recorded in ``manifest.jsonl`` with its byte size and sha256, hashed
once, as it is written (or, for a chunked prompt, once when its last chunk is in). The
capture writer records a *ranged* sha256 (``sha256r64m:<hex>``, :data:`hs_patch.samples.files.RANGED`:
the sha256 of the sha256 digests of the file's 64 MiB ranges, hashed side by side, issue #22);
every reader verifies a file the way its digest says (:func:`hs_patch.samples.files.file_digest`), so
samples with a plain sha256 read as before.

Imported inside the SGLang server by the capture hook: standard library at import time
(torch only where used).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from hs_patch.samples.files import (PRIVATE, RANGE, JsonLog, append_line, digests_apart, file_digest, file_sha256,
                                    private_dirs, pwrite_all, ranged, read_jsonl as _read_jsonl, side_by_side,
                                    size_change, write_all, write_text_atomic)

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["file_sha256", "write_text_atomic"]  # re-exported: the shared helpers of hs_patch.samples.files

FORMAT = "hs_patch.sample/4"  # 4: + the checksum tensor and the additive relation's streams (issue #33)
FORMAT_FP8 = "hs_patch.sample/5"  # 5: fp8 planes with a scale a token (HS_CAPTURE_DTYPE=fp8, issue #35); bf16 stay 4
FORMATS_READ = ("hs_patch.sample/1", "hs_patch.sample/2", "hs_patch.sample/3", FORMAT, FORMAT_FP8)
SUFFIX = ".safetensors"
MANIFEST = "manifest.jsonl"
ERRORS = "errors.jsonl"
TMPDIR = ".tmp"
KEY_HEX = 32  # 128 bits of sha256: collisions are not a practical concern
# HS_CAPTURE_FINAL=none: the LM head's input at the prompt's last CHECK_ROWS positions, for the fidelity check only
CHECK_TENSOR = "check.post_norm"
CHECK_ROWS = "check_rows"

# safetensors dtype names for the dtypes we store
DTYPE_NAMES = {
    "torch.bfloat16": "BF16",
    "torch.float16": "F16",
    "torch.float32": "F32",
    "torch.int64": "I64",
    "torch.uint8": "U8",
    "torch.int32": "I32",
    "torch.float8_e4m3fn": "F8_E4M3",
}
DTYPE_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "U8": 1, "F8_E4M3": 1}


class SampleError(ValueError):
    """A sample file or manifest entry is missing, damaged or inconsistent."""


class AlreadyPublished(FileExistsError):
    """A sample of these tokens is already in place: the later write is not published (see :func:`publish`)."""


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
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def tensor_bytes(name: str, t: "torch.Tensor") -> TensorBytes:
    """Wrap a contiguous CPU tensor without copying it."""
    return TensorBytes(name, dtype_name(t), tuple(t.shape), [raw_bytes(name, t)])


def raw_bytes(name: str, t: "torch.Tensor") -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise SampleError(f"{name!r} must be a contiguous CPU tensor")
    import torch

    raw = t.view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)
    return memoryview(raw.numpy()).cast("B")


def encode_header(tensors: Sequence[TensorBytes], metadata: Mapping[str, str], *, size: int = 0) -> bytes:
    """The 8-byte length and the JSON header, padded with spaces so the data starts 8-byte
    aligned, or exactly at ``size`` bytes (a header written last into reserved room)."""
    header: dict[str, Any] = {"__metadata__": {str(k): str(v) for k, v in metadata.items()}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    if size:
        if 8 + len(body) > size:
            raise SampleError(f"the sample header needs {8 + len(body)} bytes, {size} were reserved")
        body += b" " * (size - 8 - len(body))
    else:
        body += b" " * (-(8 + len(body)) % 8)
    return len(body).to_bytes(8, "little") + body


def tensor_spec(name: str, dtype: str, shape: Sequence[int]) -> TensorBytes:
    """A tensor's place in a header without its bytes (for a file written in place)."""
    return TensorBytes(name, dtype, tuple(int(d) for d in shape), [])


def dtype_name(t: "torch.Tensor") -> str:
    """The safetensors name of ``t``'s dtype (SampleError if we cannot store it)."""
    name = DTYPE_NAMES.get(str(t.dtype))
    if name is None:
        raise SampleError(f"dtype {t.dtype} is not storable; use bf16, fp16, fp32 or fp8")
    return name


# Hash and write this much per call. Each call releases the GIL and must take it back after, and
# inside SGLang the writer's threads share the GIL with the scheduler thread: taking it back costs
# up to the interpreter's switch interval (5 ms) while the scheduler runs Python, so 1 MiB steps
# held the writer to a fraction of its speed there (bench/writer_ceiling.py, bench/RESULTS.md section 11).
# Per byte the CPU cost is the same at 1 MiB and at 64 MiB (sha256 dominates; reading a buffer
# twice costs nothing measurable), so the steps are large: a 117 MB plane is two calls of each.
STEP = 64 << 20


def _write_hashed(fd: int, buffers: list[Any], digest: Any) -> None:
    """Write every buffer to ``fd`` and feed it to ``digest``, ``STEP`` bytes per call."""
    for buf in buffers:
        view = memoryview(buf).cast("B")
        for start in range(0, len(view), STEP):
            chunk = view[start:start + STEP]
            digest.update(chunk)
            write_all(fd, chunk)


@dataclass
class Written:
    key: str
    path: Path
    nbytes: int
    sha256: str


def _write_ranged(fd: int, buffers: list[Any]) -> str:
    """Write the buffers to ``fd`` as one file and return its ranged digest: each RANGE of the file written
    and hashed by its own task, side by side (:func:`hs_patch.samples.files.side_by_side`)."""
    pieces, total = [], 0
    for buf in buffers:
        view = memoryview(buf).cast("B")
        pieces.append((total, view))
        total += len(view)

    def one_range(start: int) -> bytes:
        h, end = hashlib.sha256(), min(start + RANGE, total)
        for at, view in pieces:
            a, b = max(at, start), min(at + len(view), end)
            if a < b:
                h.update(view[a - at:b - at])
                pwrite_all(fd, view[a - at:b - at], a)
        return h.digest()

    return ranged(side_by_side(one_range, range(0, total, RANGE)))


def write_temp(directory: str | os.PathLike, key: str, tensors: Sequence[TensorBytes],
               metadata: Mapping[str, str], *, fsync: bool = False, ranges: bool = False) -> Written:
    """Write one complete sample under ``.tmp/`` (not yet visible), hashing it as it goes.

    The safetensors format is written directly from the callers' buffers (the capture
    hook's pinned host memory), so no byte is copied in Python; :func:`publish` renames
    it into place. On any error the temporary file is removed. ``ranges``: its 64 MiB ranges
    written and hashed side by side, a ranged digest recorded (the capture writer's).
    """
    header = encode_header(tensors, metadata)
    buffers: list[Any] = [header]
    for t in tensors:
        got = sum(len(memoryview(b).cast("B")) for b in t.buffers)
        if got != t.nbytes:
            raise SampleError(f"{t.name!r}: {got} bytes given for shape {t.shape} {t.dtype}")
        buffers.extend(t.buffers)
    digest = hashlib.sha256()
    tmp = temp_path(directory, key)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE)
    try:
        if ranges:
            hexdigest = _write_ranged(fd, buffers)
        else:
            _write_hashed(fd, buffers, digest)
            hexdigest = digest.hexdigest()
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    return Written(key, tmp, len(header) + sum(t.nbytes for t in tensors), hexdigest)


def temp_path(directory: str | os.PathLike, key: str) -> Path:
    """A fresh name under ``directory/.tmp/`` for a sample being written."""
    tmp_dir = private_dirs(Path(directory) / TMPDIR)
    return tmp_dir / f"{key}.{os.getpid()}.{threading.get_ident()}.{next(_TEMP_IDS)}.tmp"


def publish(written: Written, directory: str | os.PathLike, *, replace: bool = False) -> Written:
    """Move a sample written by :func:`write_temp` (or :class:`hs_patch.server.inplace.InPlaceSample`) into place.

    Never over another file unless ``replace``: a sample of the same tokens already there (a
    request retried while the server still held it, two clients sending the same tokens) stays,
    and this one is removed and :class:`AlreadyPublished` raised. So the capture's file at a key's
    path is always the one its manifest line describes, sha256 included (``os.link`` then unlink:
    no rename replaces it). ``replace``: a file rewritten on purpose (an export redoing a damaged one).
    """
    if os.path.getsize(written.path) != written.nbytes:
        raise SampleError(f"{written.path}: {os.path.getsize(written.path)} bytes on disk, {written.nbytes} written")
    final = sample_path(directory, written.key)
    if replace:
        os.replace(written.path, final)
        return Written(written.key, final, written.nbytes, written.sha256)
    try:
        os.link(written.path, final)
    except FileExistsError:
        written.path.unlink(missing_ok=True)
        raise AlreadyPublished(f"{final} is already there (the same tokens captured twice); the later write is "
                               "not kept") from None
    written.path.unlink()
    return Written(written.key, final, written.nbytes, written.sha256)


def write_sample(directory: str | os.PathLike, key: str, tensors: Sequence[TensorBytes],
                 metadata: Mapping[str, str], *, fsync: bool = False) -> Written:
    """Write one sample atomically (temp file + rename, over any file of that name) and return its size and sha256."""
    return publish(write_temp(directory, key, tensors, metadata, fsync=fsync), directory, replace=True)


_TEMP_IDS = __import__("itertools").count()


def write_tensors(directory: str | os.PathLike, key: str, tensors: Mapping[str, "torch.Tensor"],
                  metadata: Mapping[str, str], *, fsync: bool = False) -> Written:
    """Write one sample from named CPU tensors (in the given order) with :func:`write_sample`."""
    return write_sample(directory, key, [tensor_bytes(n, t.contiguous()) for n, t in tensors.items()],
                        metadata, fsync=fsync)


def verify_entry(directory: str | os.PathLike, entry: Mapping[str, Any]) -> str | None:
    """None if the entry's file exists with the manifest's size and sha256, else what is wrong."""
    path = Path(directory) / entry["file"]
    try:
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{path}: size {size}, manifest says {entry['bytes']}: {size_change(size, entry['bytes'])}"
        size, digest = file_digest(path, entry["sha256"])
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if digest != entry["sha256"]:
        got, want = digests_apart(digest, entry["sha256"])
        return f"{path}: sha256 {got} differs from the manifest's {want}"
    return None


# --------------------------------------------------------------------------- manifest


class Manifest(JsonLog):
    """Append-only JSON-lines log of completed samples (``op: add``) and removals.

    One whole line per record, appended under ``flock`` (:class:`hs_patch.samples.files.JsonLog`),
    so several processes (the hook's writer, the driver) can append to the same file; a
    full disk leaves no torn line. ``name`` picks another log of the same kind (the
    shipper's ``shipped.jsonl``).
    """

    def __init__(self, directory: str | os.PathLike, name: str = MANIFEST):
        super().__init__(Path(directory) / name)

    def add(self, written: Written, **extra: Any) -> None:
        self.append({"op": "add", "key": written.key, "file": written.path.name,
                     "bytes": written.nbytes, "sha256": written.sha256, "t": round(time.time(), 3), **extra})

    def remove(self, key: str, **extra: Any) -> None:
        self.append({"op": "remove", "key": key, "t": round(time.time(), 3), **extra})


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a manifest-like log; a bad line (not a torn last one) is a SampleError."""
    try:
        return _read_jsonl(path)
    except ValueError as e:
        raise SampleError(f"{e} (unreadable manifest line)") from None


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


def log_error(directory: str | os.PathLike, record: Mapping[str, Any]) -> None:
    """Append one JSON line to ``errors.jsonl`` (samples that could not be produced)."""
    line = json.dumps({"t": round(time.time(), 3), **record}, sort_keys=True, default=str) + "\n"
    append_line(Path(directory) / ERRORS, line.encode())
