"""Check a model directory against its listing, and keep what was verified.

Every file is hashed (sha256; the git blob id too where that is what the source gives),
several at once (hashlib releases the GIL, :func:`hs_patch.samples.files.side_by_side`), and its size
and checksum compared with the listing. The outcome is kept in two files in the directory:

- ``hs-model-manifest.json`` (:data:`listing.MANIFEST`): the source's identity and every
  file's size and sha256 (the directory then serves as a mirror);
- ``.hs-model-verified.json`` (:data:`RECORD`): the same identity and each file's size and
  modification time when it was verified, so a later run knows in a second that nothing
  changed since (:func:`unchanged`) without reading 600 GB again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from hs_patch.host.model.listing import MANIFEST, FileSpec, Listing, manifest_text
from hs_patch.samples.files import file_sha256, side_by_side, write_text_atomic

RECORD = ".hs-model-verified.json"
PUBLIC = 0o644


def git_blob_sha1(path: Path) -> str:
    """The git blob id of a file: sha1 of ``b"blob <size>\\0"`` and its bytes (what the hub gives for non-LFS files)."""
    h = hashlib.sha1(usedforsecurity=False)
    with open(path, "rb") as f:
        h.update(b"blob %d\0" % os.fstat(f.fileno()).st_size)
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Finding:
    """One file checked: ``problem`` is "" when it is what the listing says."""

    path: str
    problem: str
    sha256: str = ""


def check_file(root: Path, path: str, spec: FileSpec) -> Finding:
    full = root / path
    try:
        size = full.stat().st_size
    except FileNotFoundError:
        return Finding(path, "missing")
    except OSError as e:
        return Finding(path, f"unreadable: {e.strerror or e}")
    if size != spec.size:
        return Finding(path, f"{size} bytes, the source says {spec.size}")
    try:
        _, sha256 = file_sha256(full)
        if spec.sha256 and sha256 != spec.sha256:
            return Finding(path, f"sha256 {sha256[:16]}..., the source says {spec.sha256[:16]}... (damaged)")
        if spec.git_sha1 and (got := git_blob_sha1(full)) != spec.git_sha1:
            return Finding(path, f"git blob {got[:16]}..., the source says {spec.git_sha1[:16]}... (damaged)")
    except OSError as e:
        return Finding(path, f"unreadable: {e.strerror or e}")
    return Finding(path, "", sha256)


def check_dir(root: Path, listing: Listing, only: list[str] | None = None) -> list[Finding]:
    """Each file of the listing (or of ``only``) checked, several at once, in name order."""
    names = sorted(listing.files if only is None else only)
    return side_by_side(lambda p: check_file(root, p, listing.files[p]), names)


def _stat(root: Path, path: str) -> list[int]:
    st = (root / path).stat()
    return [st.st_size, st.st_mtime_ns]


def write_records(root: Path, source: str, listing: Listing, findings: list[Finding]) -> None:
    """Both records, after every file of ``listing`` was found as it says (``findings`` with their sha256);
    ``source`` names where the files came from (the hub at a commit, a mirror's URL), as asked."""
    sha = {f.path: f.sha256 for f in findings}
    full = Listing(listing.identity, {p: FileSpec(s.size, sha256=sha.get(p) or s.sha256, git_sha1=s.git_sha1)
                                      for p, s in listing.files.items()})
    write_text_atomic(root / MANIFEST, manifest_text(full), mode=PUBLIC, fsync=True)
    record = {"source": source, "identity": listing.identity, "verified_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "files": {p: _stat(root, p) for p in sorted(listing.files)}}
    write_text_atomic(root / RECORD, json.dumps(record, indent=1) + "\n", mode=PUBLIC, fsync=True)


def read_record(root: Path) -> dict:
    try:
        return json.loads((root / RECORD).read_text())
    except (OSError, ValueError):
        return {}


def unchanged(root: Path, source: str) -> tuple[bool, str]:
    """(True, when) if every file verified from ``source`` has the size and modification time it had then."""
    record = read_record(root)
    if record.get("source") != source or not record.get("files"):
        return False, ""
    for path, seen in record["files"].items():
        try:
            if _stat(root, path) != seen:
                return False, ""
        except OSError:
            return False, ""
    return True, str(record.get("verified_at", ""))


def forget(root: Path) -> None:
    """Drop the verified record (before anything in the directory changes)."""
    (root / RECORD).unlink(missing_ok=True)


def readable_by_all(root: Path, listing: Listing) -> None:
    """The server runs as an unprivileged user: every file of the model readable, every directory searchable."""
    for path in listing.files:
        full = root / path
        full.chmod(full.stat().st_mode | 0o444)
        for parent in [*full.relative_to(root).parents][:-1]:
            d = root / parent
            d.chmod(d.stat().st_mode | 0o555)
