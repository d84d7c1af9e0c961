"""A dead capture server's files, removed when the next one starts.

SGLang answers a failure in the hook by SIGKILLing its scheduler, so the writer's own
clean-up usually never runs. What such a server can leave in the capture directory:
partial files under ``.tmp/`` (a whole sample being written, a chunked prompt's open file:
up to ~590 MB per 8,192-token chunk at Kimi-K2.5's width), and sample files renamed into
place but never listed in ``manifest.jsonl`` (killed between the rename and the append).
On ``/dev/shm`` that is RAM, and the driver's back-pressure counts it: a run whose writer
stopped on a full disk would restart into a filesystem its own leftovers keep full.

:func:`clean` runs when a server takes the directory's writer lock, so no writer of ours is
alive: everything under ``.tmp/`` is removed, and every ``<key>.safetensors`` that the
manifest does not list (live) is removed (its sha256 was never recorded; the driver asks
for the sample again). Listed samples are the driver's to adopt and are kept. What was
removed is logged, recorded in ``errors.jsonl`` and reported in ``hook_status.json``
(``cleaned_at_start``). Standard library only.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from hs_patch.samples import store

log = logging.getLogger("hs_patch")


def _remove(path: Path) -> int:
    """Remove one file; its size (0 if it was already gone)."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size


def clean(directory: str | os.PathLike) -> dict[str, Any]:
    """Remove a dead server's partial and unlisted files from ``directory``; what was removed."""
    directory = Path(directory)
    partial = unlisted = freed = 0
    tmp = directory / store.TMPDIR
    if tmp.is_dir():
        for p in tmp.iterdir():
            if p.is_file() or p.is_symlink():
                freed += _remove(p)
                partial += 1
    samples = {p.name[: -len(store.SUFFIX)]: p for p in directory.glob(f"*{store.SUFFIX}")}
    keys: list[str] = []
    if samples:  # read the manifest only when there are files to judge (it grows over a run)
        try:
            live = store.read_manifest(directory)
        except store.SampleError as e:  # an unreadable manifest: judge nothing, remove nothing listed or not
            log.error("hs_patch: %s; files in %s are left as they are", e, directory)
            live = {k: {} for k in samples}
        for key, path in sorted(samples.items()):
            if key not in live:
                freed += _remove(path)
                unlisted += 1
                keys.append(key)
    done = {"partial_files": partial, "unlisted_samples": unlisted, "bytes": freed}
    if partial or unlisted:
        log.warning("hs_patch: removed what a stopped server left in %s: %d partial files, %d samples never "
                    "listed in its manifest (%d bytes); their requests are captured again when sent again",
                    directory, partial, unlisted, freed)
        store.log_error(directory, {"error": "leftovers_removed", **done, "keys": keys[:100],
                                    "why": "a server stopped (killed) while writing them; removed at the next start"})
    return done
