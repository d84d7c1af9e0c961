"""Adopt: move a sample the hook wrote, loss mask and provenance included, into the run's samples dir.

The hook's writer already wrote the final sample (it read the driver's intent: see
:mod:`hs_patch.samples.intent`), hashed once as it was written. Adopting it costs the driver a
header read, a rename and two manifest lines, whatever its size: the header is checked
(format, key, length, the loss mask and the sample id the driver asked for), the file is
renamed into the samples directory (same filesystem: checked when the run starts), the
samples manifest gets its ``op: add`` line with the writer's size and sha256, and the
capture manifest its ``op: remove``. A crash in between leaves either the file in the
capture dir (redone, then swept) or a file in the samples dir without a manifest line
(removed on resume), never a sample counted as done without its file. The writer never
moves a sample over another (a retried request keeps its first capture:
:func:`hs_patch.samples.store.publish`), so the file at the entry's name is the one the entry's
sha256 describes, and the one the fidelity check read.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any, Mapping, Optional

from hs_patch.host.driver.capture_dir import CaptureWatcher
from hs_patch.samples import intent, reader, store


# copied from its metadata into the manifest line: where the sample was extracted, and the sha256 of its
# dataset line (a resume over a changed dataset keeps the samples of the lines still there: reconcile.py)
WHERE = ("host", "shard", "line_sha256")


class AdoptError(RuntimeError):
    pass


def same_filesystem(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    return os.stat(a).st_dev == os.stat(b).st_dev


def adopt(watcher: CaptureWatcher, entry: Mapping[str, Any], samples_dir: str | Path, *, sample_id: str,
          run: str, fidelity: Optional[Mapping[str, Any]] = None) -> store.Written:
    """Move the capture ``entry``'s file into ``samples_dir`` and record it (with the fidelity check's
    result, when one ran); returns what was adopted."""
    key = entry["key"]
    raw_path = watcher.directory / entry["file"]
    if entry.get("sample_id") != sample_id:
        raise AdoptError(
            f"the server wrote sample {key} without the driver's intent (its manifest line names sample "
            f"{entry.get('sample_id')!r}, not {sample_id!r}); see {watcher.directory}/{store.ERRORS} for why "
            f"(an intent the server could not read: permissions on {watcher.directory}/{intent.DIR}?)")
    try:
        head = reader.read_header(raw_path)
        head.check(raw_path)
    except store.SampleError as e:
        raise AdoptError(f"the sample the server wrote is unusable: {e}") from None
    meta = head.metadata
    if head.size != entry["bytes"] or meta.get("key") != key or "loss_mask" not in head.tensors \
            or meta.get("sample_id") != sample_id:
        raise AdoptError(f"{raw_path}: size {head.size} / key {meta.get('key')} / loss mask "
                         f"{'loss_mask' in head.tensors} / sample {meta.get('sample_id')!r} differ from the capture "
                         f"manifest's {entry['bytes']} / {key} / True / {sample_id!r}")
    final = store.sample_path(samples_dir, key)
    try:
        os.rename(raw_path, final)
    except OSError as e:
        if e.errno == errno.EXDEV:
            raise AdoptError(f"{watcher.directory} and {samples_dir} are on different filesystems: put the "
                             "samples dir on the capture dir's filesystem (--samples-dir)") from None
        raise
    written = store.Written(key, final, int(entry["bytes"]), entry["sha256"])
    extra = {} if fidelity is None else {"fidelity": dict(fidelity)}
    store.Manifest(samples_dir).add(written, tokens=int(meta["num_tokens"]), loss_tokens=int(entry["loss_tokens"]),
                                    sample_id=sample_id, run=run, parts=entry.get("parts", 1), **extra,
                                    **{k: meta[k] for k in WHERE if k in meta})
    watcher.forget(key, reason="adopted", run=run, sample_id=sample_id)
    intent.remove(watcher.directory, key)
    return written
