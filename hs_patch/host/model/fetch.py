"""Download a model's files from its source into a directory, resumably, after checking there is room.

- ``hub``: huggingface_hub's ``snapshot_download`` into the directory (``local_dir``) at the pinned
  commit: Xet or HTTP as the hub and the installed huggingface_hub choose, a few files at once.
  Files already there and complete are kept (its own metadata, or their sha256 against the hub's);
  a connection cut mid-file is resumed from where it stopped, in the same run; a file cut by an
  interrupted run is fetched again, whole (huggingface_hub keeps no partial file across runs).
- ``http``: a mirror serving the directory (its ``hs-model-manifest.json`` first): each missing
  file into ``.hs-model-partial/`` with Range requests, so any interruption resumes where it stopped,
  then moved into place.
- ``rsync``: a mirror rsync reaches (``host:/dir``, ``rsync://host/module/dir`` or a local path),
  its manifest first, then ``rsync --partial-dir`` (an interrupted file resumes).

:func:`room` says before any download whether the filesystem has room for what is still missing.
"""

from __future__ import annotations

import http.client
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from hs_patch.host.model.listing import MANIFEST, Listing, ModelSourceError, manifest_listing
from hs_patch.samples.files import write_all

PARTIAL = ".hs-model-partial"
RSYNC_PARTIAL = ".hs-model-rsync-partial"
RESERVE = 1 << 30  # left free on the filesystem after the model: logs, the verified records
CHUNK = 8 << 20
HTTP_TIMEOUT_S = 60
HTTP_TRIES = 5


class RoomError(RuntimeError):
    """Not enough free space for the files still to come: nothing was downloaded."""


def missing_bytes(root: Path, listing: Listing) -> tuple[int, list[str]]:
    """(bytes, names) of the listing's files that are not there at their full size (a file at its size is
    kept until verification says otherwise)."""
    names = []
    for path, spec in listing.files.items():
        full = root / path
        if not (full.is_file() and full.stat().st_size == spec.size):
            names.append(path)
    return sum(listing.files[p].size for p in names), sorted(names)


def room(root: Path, listing: Listing) -> tuple[int, int]:
    """(bytes needed, bytes free) on ``root``'s filesystem; RoomError when the first exceeds the second."""
    need, names = missing_bytes(root, listing)
    if need == 0:
        return 0, 0
    vfs = os.statvfs(root)
    free = vfs.f_bavail * vfs.f_frsize
    if need + RESERVE > free:
        raise RoomError(f"{root} needs {need / 2**30:.1f} GiB for {len(names)} file(s) still to download (and "
                        f"{RESERVE >> 30} GiB to spare) and its filesystem has {free / 2**30:.1f} GiB free: free "
                        "space there or point hs_model_path at a larger filesystem. Nothing was downloaded.")
    return need, free


# --------------------------------------------------------------------------- hub


def hub_download(root: Path, repo: str, revision: str, *, endpoint: str, token: str | None, workers: int) -> None:
    """huggingface_hub's snapshot_download of ``repo`` at the commit ``revision`` into ``root``."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo, revision=revision, local_dir=str(root), endpoint=endpoint, token=token or False,
                          max_workers=workers)
    except Exception as e:  # noqa: BLE001 - the download's own error, said with the source
        raise ModelSourceError(f"downloading {repo}@{revision} from {endpoint} stopped: {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}. Run the play again: files already "
                               "complete are kept") from None


def forget_hub_file(root: Path, path: str) -> None:
    """Remove a file and huggingface_hub's note that it is complete, so the next download fetches it again."""
    (root / path).unlink(missing_ok=True)
    (root / ".cache" / "huggingface" / "download" / f"{path}.metadata").unlink(missing_ok=True)


# --------------------------------------------------------------------------- HTTP mirror


def _open(url: str, token: str | None, start: int = 0):
    req = urllib.request.Request(url, headers={"Accept-Encoding": "identity"})
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    if start:
        req.add_header("Range", f"bytes={start}-")
    return urllib.request.urlopen(req, timeout=HTTP_TIMEOUT_S)  # noqa: S310 - the operator's mirror URL


def http_manifest(url: str, token: str | None) -> Listing:
    where = f"{url.rstrip('/')}/{MANIFEST}"
    try:
        with _open(where, token) as r:
            return manifest_listing(r.read().decode(), where)
    except (urllib.error.URLError, OSError) as e:
        raise ModelSourceError(f"{where}: {getattr(e, 'reason', e)} (the mirror's address, and that it serves the "
                               f"model directory with its {MANIFEST})") from None


def http_file(url: str, dest: Path, partial: Path, size: int, token: str | None,
              progress: Callable[[int], None] = lambda n: None) -> None:
    """``url`` into ``dest`` by way of ``partial``, resuming what ``partial`` already holds, a few times over
    a cut connection; the finished file is moved into place only at its full size."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, HTTP_TRIES + 1):
        have = partial.stat().st_size if partial.exists() else 0
        if have > size:
            partial.unlink()
            have = 0
        if have < size:
            try:
                with _open(url, token, have) as r:
                    if have and not (r.status == 206 and r.headers.get("Content-Range", "").startswith(f"bytes {have}-")):
                        have = 0  # the mirror ignored the range: start over
                    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | (os.O_APPEND if have else os.O_TRUNC), 0o644)
                    try:
                        while block := r.read(CHUNK):
                            progress(write_all(fd, block))
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
                if isinstance(e, urllib.error.HTTPError) and e.code in (401, 403, 404):
                    raise ModelSourceError(f"{url}: HTTP {e.code} {e.reason}") from None
                if attempt == HTTP_TRIES:
                    raise ModelSourceError(f"{url}: {getattr(e, 'reason', e)} after {HTTP_TRIES} tries; run the play "
                                           f"again: {partial.stat().st_size if partial.exists() else 0} of {size} "
                                           "bytes are kept and the download resumes there") from None
                continue
        if partial.stat().st_size == size:
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(partial, dest)
            return
    raise ModelSourceError(f"{url}: the mirror sent {partial.stat().st_size} of {size} bytes in {HTTP_TRIES} tries; run "
                           "the play again: they are kept and the download resumes there")


def http_download(root: Path, url: str, listing: Listing, names: list[str], token: str | None) -> None:
    for path in names:
        http_file(f"{url.rstrip('/')}/{path}", root / path, root / PARTIAL / path, listing.files[path].size, token)
    shutil.rmtree(root / PARTIAL, ignore_errors=True)


# --------------------------------------------------------------------------- rsync mirror


def _rsync(args: list[str], what: str) -> None:
    try:
        p = subprocess.run(["rsync", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise ModelSourceError("rsync is not installed on this host (apt install rsync)") from None
    if p.returncode != 0:
        raise ModelSourceError(f"rsync {what} failed (exit {p.returncode}): {p.stderr.strip()[-600:]}; run the play "
                               "again: an interrupted file resumes where it stopped")


def rsync_manifest(source: str) -> Listing:
    with tempfile.TemporaryDirectory(prefix="hs-model-") as tmp:
        _rsync([f"{source.rstrip('/')}/{MANIFEST}", tmp + "/"], f"of {source}/{MANIFEST}")
        return manifest_listing((Path(tmp) / MANIFEST).read_text(), f"{source}/{MANIFEST}")


def rsync_download(root: Path, source: str, names: list[str]) -> None:
    with tempfile.NamedTemporaryFile("w", prefix="hs-model-files-") as files:
        files.write("".join(f"{n}\n" for n in names))
        files.flush()
        _rsync(["--recursive", "--times", "--partial", f"--partial-dir={RSYNC_PARTIAL}", f"--files-from={files.name}",
                "--chmod=D755,F644", f"{source.rstrip('/')}/", f"{root}/"], f"from {source}")
