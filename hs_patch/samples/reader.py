"""Reading and checking samples, every format in :data:`hs_patch.samples.store.FORMATS_READ` (1 to 5; see
:mod:`hs_patch.samples.store` for the format; 5: fp8 planes, read dequantized unless asked for raw).

``read_sample`` validates one file (format tag, planes and shapes, dtype, that the token
ids hash to the sample's key, and size + sha256 against its manifest entry);
``check_header`` is the quick check (size, and the safetensors header: its length, format
tag, key and tensor extents; the tensor data is not read, so a flipped byte there is
found only by the deep check); ``check_dir`` checks a whole directory against its
manifest, deep or quick, in parallel; ``hs-patch inspect`` is the command-line face.
Reading a large sample one tensor at a time, with the same checks: :mod:`hs_patch.samples.lazy_sample`.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

from hs_patch.samples.files import UNREADABLE, digests_apart, file_digest, json_lines, size_change
from hs_patch.samples.store import (CHECK_ROWS, CHECK_TENSOR, DTYPE_NAMES, FORMAT_FP8, FORMATS_READ, MANIFEST,
                                    SUFFIX, SampleError, sample_key)
from hs_patch.server import fingerprint, fp8

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class Sample:
    path: Path
    metadata: dict[str, str]
    tensors: dict[str, "torch.Tensor"] = field(repr=False)

    @property
    def key(self) -> str:
        return self.metadata["key"]

    @property
    def input_ids(self) -> "torch.Tensor":
        return self.tensors["input_ids"]

    @property
    def planes(self) -> list[str]:
        return self.metadata["planes"].split(",")

    @property
    def fp8(self) -> bool:
        """Its planes are fp8 with a scale a token (HS_CAPTURE_DTYPE=fp8: :mod:`hs_patch.server.fp8`)."""
        return fp8.is_fp8(self.metadata)

    def plane(self, name: str, *, raw: bool = False) -> "torch.Tensor":
        """Plane ``name`` [L, H]: as stored for bf16 samples; for fp8 samples dequantized to the dtype the engine
        computed (bf16), or with ``raw`` the stored float8_e4m3fn rows (their scales: :meth:`scale`)."""
        t = self.tensors[name]
        if raw or not self.fp8:
            return t
        return fp8.dequantize(t, self.scale(name), source_dtype(self.metadata))

    def scale(self, name: str) -> "torch.Tensor":
        """An fp8 plane's scales, F32 [L] (``q.float() * scale`` per row); SampleError for a bf16 sample."""
        if not self.fp8:
            raise SampleError(f"{self.path}: its planes are {self.metadata.get('dtype')}, not fp8: no scales")
        return self.tensors[fp8.scale_name(name)]


def source_dtype(metadata: Mapping[str, str]) -> "torch.dtype":
    """The dtype the engine computed the planes in: an fp8 sample's ``source_dtype`` (bfloat16), else its ``dtype``."""
    import torch

    name = fp8.source_name(metadata)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise SampleError(f"the sample's dtype {name!r} is not a torch dtype")
    return dtype


def check_entry(path: Path, entry: Mapping[str, Any]) -> None:
    """The file's size and sha256 against its manifest entry (one streaming read); SampleError if they differ."""
    size, digest = file_digest(path, entry["sha256"])
    if size != entry["bytes"]:
        raise SampleError(f"{path}: size {size} differs from the manifest's {entry['bytes']} "
                          f"({size_change(size, entry['bytes'])}): the file is damaged")
    if digest != entry["sha256"]:
        got, want = digests_apart(digest, entry["sha256"])
        raise SampleError(f"{path}: sha256 {got} differs from the manifest's {want}: the file is damaged")


def read_sample(path: str | os.PathLike, *, entry: Mapping[str, Any] | None = None) -> Sample:
    """Load and validate one sample; raise :class:`SampleError` saying what is wrong.

    Checks the format tag, that every declared plane is present with shape [L, H] and the declared dtype,
    that the token ids hash to the sample's key, and, given its manifest ``entry``, size, sha256 and key.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if entry is not None:
        check_entry(path, entry)
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            metadata = dict(f.metadata() or {})
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise SampleError(f"{path}: not a readable safetensors file ({e})") from None
    check_sample(path, metadata, tensors)
    if entry is not None and metadata["key"] != entry["key"]:  # the entry's size and sha256 are another sample's
        raise SampleError(f"{path}: holds sample {metadata['key']}; the manifest lists it as {entry['key']}")
    return Sample(path, metadata, tensors)


def check_sample(path: Path, metadata: Mapping[str, str], tensors: Mapping[str, "torch.Tensor"]) -> None:
    if metadata.get("format") not in FORMATS_READ:
        raise SampleError(f"{path}: format {metadata.get('format')!r}, expected one of {', '.join(FORMATS_READ)}")
    ids = tensors.get("input_ids")
    if ids is None or ids.dim() != 1 or str(ids.dtype) != "torch.int64":
        raise SampleError(f"{path}: input_ids must be int64 [L]")
    n = ids.shape[0]
    try:  # the metadata a sample's readers rely on: missing or garbled is a damaged sample, not a crash
        num_tokens, hidden = int(metadata.get("num_tokens", -1)), int(metadata["hidden_size"])
        planes, dtype = metadata["planes"].split(","), metadata["dtype"]
    except (KeyError, ValueError) as e:
        raise SampleError(f"{path}: its metadata lacks or garbles {e}") from None
    if num_tokens != n:
        raise SampleError(f"{path}: num_tokens {metadata.get('num_tokens')} but {n} input ids")
    for name in planes:
        t = tensors.get(name)
        if t is None:
            raise SampleError(f"{path}: plane {name!r} is missing")
        if tuple(t.shape) != (n, hidden):
            raise SampleError(f"{path}: plane {name!r} has shape {tuple(t.shape)}, expected ({n}, {hidden})")
        if str(t.dtype) != "torch." + dtype:
            raise SampleError(f"{path}: plane {name!r} is {t.dtype}, expected {dtype}")
    if "loss_mask" in tensors and tuple(tensors["loss_mask"].shape) != (n,):
        raise SampleError(f"{path}: loss_mask must have shape ({n},)")
    records = record_shapes(path, metadata, n)
    scales = [fp8.scale_name(p) for p in planes] if is_fp8(path, metadata) else []
    for name in (fingerprint.TENSOR, fingerprint.CHECKSUM_TENSOR, CHECK_TENSOR, *scales):
        got, want = tensors.get(name), records.get(name)
        if (None if got is None else [list(got.shape), DTYPE_NAMES.get(str(got.dtype))]) != \
                (want and [want[1], want[0]]):
            raise SampleError(f"{path}: the {name} tensor does not match its metadata ({want})")
    if sample_key(ids) != metadata.get("key"):
        raise SampleError(f"{path}: token ids do not hash to the sample key {metadata.get('key')}")


def check_header(path: Path, entry: Mapping[str, Any]) -> None:
    """The quick check of one listed file: its size, and a safetensors header that parses, has the
    sample format and key, and tensors that end where the file does. Tensor bytes are not read."""
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise SampleError(f"{path}: size {size}, manifest says {entry['bytes']}")
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        if not 0 < n <= min(size - 8, 100 << 20):
            raise SampleError(f"{path}: not a safetensors file (header length {n})")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise SampleError(f"{path}: the safetensors header is damaged") from None
    meta = m if isinstance(header, dict) and isinstance(m := header.get("__metadata__"), dict) else {}  # or damaged
    if meta.get("format") not in FORMATS_READ or meta.get("key") != entry.get("key"):
        raise SampleError(f"{path}: header says format {meta.get('format')!r}, key {meta.get('key')!r}; the "
                          f"manifest lists key {entry.get('key')}")
    ends = [int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"]  # check_dir: bad if not
    if 8 + n + max(ends, default=0) != size:
        raise SampleError(f"{path}: its tensors end at byte {8 + n + max(ends, default=0)}, the file has {size}")


def record_shapes(path: Path, metadata: Mapping[str, str], n: int) -> dict[str, tuple[str, list[int]]]:
    """The sample's fingerprint and checksum tensors as its metadata says: name -> (safetensors dtype,
    [n, streams, blocks]), and its check rows' ([rows, hidden]); absent ones are left out."""
    out = {}
    for name, parse, dtype in ((fingerprint.TENSOR, fingerprint.parse, "F32"),
                               (fingerprint.CHECKSUM_TENSOR, fingerprint.parse_checksums, "I32")):
        try:
            doc = parse(dict(metadata))
        except ValueError as e:
            raise SampleError(f"{path}: {e}") from None
        if doc is not None:
            out[name] = (dtype, [n, len(doc["streams"]), int(doc["blocks"])])
    if CHECK_ROWS in metadata:  # HS_CAPTURE_FINAL=none: the LM head's input at the last positions
        try:
            rows, hidden = int(metadata[CHECK_ROWS]), int(metadata["hidden_size"])
        except (KeyError, ValueError):
            raise SampleError(f"{path}: check_rows={metadata.get(CHECK_ROWS)!r} is not a row count") from None
        if not 0 < rows <= n:
            raise SampleError(f"{path}: check_rows={rows} does not fit its {n} tokens")
        source = fp8.source_name(metadata)  # fp8: kept as the engine computed
        out[CHECK_TENSOR] = (DTYPE_NAMES.get("torch." + source, "?"), [rows, hidden])
    if is_fp8(path, metadata):  # one scale a token a plane
        out.update({fp8.scale_name(p): ("F32", [n]) for p in metadata.get("planes", "").split(",") if p})
    return out


def is_fp8(path: Path, metadata: Mapping[str, str]) -> bool:
    """Whether the sample's planes are fp8 (:func:`hs_patch.server.fp8.is_fp8`); SampleError for a scheme or
    format this hs_patch cannot read."""
    try:
        quantized = fp8.is_fp8(metadata)
    except ValueError as e:
        raise SampleError(f"{path}: {e}") from None
    if quantized != (metadata.get("format") == FORMAT_FP8):
        raise SampleError(f"{path}: format {metadata.get('format')!r} with planes of {metadata.get('dtype')!r}: fp8 "
                          f"planes are format {FORMAT_FP8} and only they are")
    return quantized


ADD_FIELDS = {"key": str, "file": str, "bytes": int, "sha256": str}


def manifest_entries(directory: Path) -> tuple[Optional[dict[str, dict[str, Any]]], list[str]]:
    """Live entries of ``directory``'s manifest (None if there is none), and each unusable line as ``manifest.jsonl:N:
    why`` (a torn last line, from a crash mid-append, is not a problem; a file outside ``directory`` is). A fleet
    run's directory (no manifest of its own, one subdirectory with its manifest a host) gives the merged view of its
    parts: :func:`run_entries`."""
    path = directory / MANIFEST
    if not path.is_file():
        return run_entries(directory)
    entries: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    for n, rec in json_lines(path):
        if rec is UNREADABLE:
            problems.append(f"{MANIFEST}:{n}: not JSON")
            continue
        op = rec.get("op") if isinstance(rec, dict) else None
        if op == "add":
            bad = [k for k, t in ADD_FIELDS.items() if not isinstance(rec.get(k), t) or isinstance(rec.get(k), bool)
                   or k == "file" and (os.path.isabs(rec[k]) or ".." in Path(rec[k]).parts)]  # outside: not valid
            if bad:
                problems.append(f"{MANIFEST}:{n}: an add line without a valid {', '.join(repr(b) for b in bad)}")
                continue
            entries[rec["key"]] = rec
        elif op == "remove":
            if not isinstance(rec.get("key"), str):
                problems.append(f"{MANIFEST}:{n}: a remove line without a valid 'key'")
                continue
            entries.pop(rec["key"], None)
        elif not isinstance(rec, dict):
            problems.append(f"{MANIFEST}:{n}: not a JSON object")
    return entries, problems


def run_entries(directory: Path) -> tuple[Optional[dict[str, dict[str, Any]]], list[str]]:
    """The merged view of a fleet run at storage, ``RUN/HOST/{manifest.jsonl,samples/}``: every part's entries
    (``file`` relative to RUN), None if no subdirectory has a manifest. A sample id in two parts (extracted twice) is
    a problem; the same tokens under two ids are one sample (the first part's), as the driver keeps one of them."""
    parts = sorted(d for d in directory.iterdir() if (d / MANIFEST).is_file()) if directory.is_dir() else []
    if not parts:
        return None, []
    entries: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    where: dict[str, str] = {}  # sample id -> part
    for d in sorted(directory.iterdir()):  # a part's manifest is written last (fetch, the shippers)
        if d.is_dir() and not (d / MANIFEST).is_file() and (d / "samples").is_dir() and any((d / "samples").iterdir()):
            problems.append(f"{d.name}/ holds samples but no {MANIFEST}: a part whose fetch or shipping never "
                            "finished; fetch or ship it again (its samples would be left out)")
    for part in parts:
        got, bad = manifest_entries(part)
        problems += [f"{part.name}/{b}" for b in bad]
        for key, e in sorted((got or {}).items()):
            sid = e.get("sample_id")
            if isinstance(sid, str) and where.get(sid, part.name) != part.name:
                problems.append(f"{part.name}/{MANIFEST}: sample {sid} is also in {where[sid]}/ (extracted twice)")
                continue
            if isinstance(sid, str):
                where[sid] = part.name
            entries.setdefault(key, dict(e, file=f"{part.name}/{e['file']}"))
    return entries, problems


@dataclass
class Header:
    """A sample's metadata and tensor table, read without its data (a few KB)."""

    metadata: dict[str, str]
    tensors: dict[str, dict[str, Any]]   # name -> {"dtype", "shape", "data_offsets"}
    data_start: int
    size: int

    def check(self, path: Path) -> None:
        """The format's promises that the header alone can show (shapes, sizes, the file's length)."""
        m = self.metadata
        if m.get("format") not in FORMATS_READ:
            raise SampleError(f"{path}: format {m.get('format')!r}, expected one of {', '.join(FORMATS_READ)}")
        try:
            n, hidden = int(m["num_tokens"]), int(m["hidden_size"])
            planes = m["planes"].split(",")
        except (KeyError, ValueError) as e:
            raise SampleError(f"{path}: metadata lacks {e}") from None
        want = {"input_ids": [n], **{p: [n, hidden] for p in planes}}
        if "loss_mask" in self.tensors:
            want["loss_mask"] = [n]
        want.update({name: shape for name, (_, shape) in record_shapes(path, m, n).items()})
        got = {k: v.get("shape") for k, v in self.tensors.items()}
        if got != want:
            raise SampleError(f"{path}: tensors {got} do not match the metadata ({want})")
        end = max((v["data_offsets"][1] for v in self.tensors.values()), default=0)
        if self.data_start + end != self.size:
            raise SampleError(f"{path}: {self.size} bytes, the header describes {self.data_start + end}: "
                              f"{size_change(self.size, self.data_start + end)}")


def read_header(path: str | os.PathLike) -> Header:
    """Read a sample's header only (cheap: the driver checks each sample it adopts this way)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= min(size - 8, 100 << 20):
                raise SampleError(f"{path}: not a safetensors file (header length {n}, file {size} bytes)")
            doc = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise SampleError(f"{path}: unreadable header ({e})") from None
    meta = doc.pop("__metadata__", None) or {}
    return Header(dict(meta), doc, 8 + n, size)


@dataclass
class DirReport:
    ok: list[str] = field(default_factory=list)
    bad: dict[str, str] = field(default_factory=dict)       # key -> reason
    missing: list[str] = field(default_factory=list)        # in manifest, no file
    unlisted: list[str] = field(default_factory=list)       # file, no manifest entry
    problems: list[str] = field(default_factory=list)       # unusable manifest lines, as file:line: why
    no_manifest: bool = False                               # nothing to check against
    tokens: int = 0
    nbytes: int = 0

    @property
    def clean(self) -> bool:
        return not (self.bad or self.missing or self.unlisted or self.problems or self.no_manifest)


def check_dir(directory: str | os.PathLike, *, deep: bool = True, workers: int = 1,
              progress: Optional[Callable[[int], None]] = None) -> DirReport:
    """Check every sample of a directory against its manifest, ``workers`` files at a time.

    An entry's ``file`` is relative to the manifest's directory (never outside it): a bare name where the capture
    writes, ``samples/<key>.safetensors`` at a shipping destination. ``deep`` re-reads each file (sha256 and
    tensor checks, the sample's key the entry's); otherwise :func:`check_header`. ``progress`` is called with
    each checked file's byte size. A directory without a manifest is not clean (``no_manifest``).
    """
    directory = Path(directory)
    rep = DirReport()
    entries, rep.problems = manifest_entries(directory)
    if entries is None:
        rep.no_manifest = True
        entries = {}
    sample_dirs = {directory} | {(directory / e["file"]).parent for e in entries.values()}
    files = {p.name[: -len(SUFFIX)] for d in sample_dirs for p in d.glob(f"*{SUFFIX}")}
    rep.unlisted = sorted(files - entries.keys())

    def one(item: tuple[str, dict[str, Any]]) -> tuple[str, str, int]:
        key, entry = item
        path = directory / entry["file"]
        try:
            if not path.is_file():
                return key, "missing", 0
            if deep:
                return key, "ok", int(read_sample(path, entry=entry).metadata["num_tokens"])
            check_header(path, entry)
            return key, "ok", 0
        except (SampleError, OSError, ValueError, KeyError, TypeError, IndexError) as e:
            return key, f"bad:{e}", 0
        finally:
            if progress is not None:
                progress(int(entry.get("bytes") or 0))

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for key, result, tokens in pool.map(one, sorted(entries.items())):
            if result == "missing":
                rep.missing.append(key)
            elif result.startswith("bad:"):
                rep.bad[key] = result[4:]
            else:
                rep.ok.append(key)
                rep.tokens += tokens
                rep.nbytes += entries[key]["bytes"]
    return rep


def iter_samples(directory: str | os.PathLike) -> Iterator[Sample]:
    """Every sample listed in the directory's manifest, validated against it."""
    directory = Path(directory)
    entries, _ = manifest_entries(directory)
    for key, entry in sorted((entries or {}).items()):
        yield read_sample(directory / entry["file"], entry=entry)
