"""``hs-extract export --data``: only the samples of lines the dataset holds now.

Every sample records the sha256 of the dataset line it was made from (``line_sha256``, in its manifest
line at the source and at the destination). A line edited or removed after it was extracted leaves its
sample behind: the driver deletes nothing it made, lists it in its state dir's ``vanished.jsonl`` (which
stays on the GPU host) and extracts the edited line anew, so a shipped run holds both. Given the dataset
as it is now, the export leaves out every sample whose line is no longer in it (and, as for any sample
no longer in its source, deletes it from an earlier export). A sample recorded without a digest (a
driver before line digests) cannot be matched and is kept, counted as unchecked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hs_patch.host.driver import datafile, dataset
from hs_patch.host.driver.runstate import LINE_SHA256

LINE_LIMIT = 1 << 30   # characters: no driver extracts a longer line (its --max-line-chars), so none is missed


@dataclass
class Kept:
    """What ``--data`` did: the files it read (name, sha256), the samples it left out, those it could not check."""

    files: list[dict[str, str]] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)   # sample keys
    unchecked: int = 0


def digests(paths: list[str]) -> set[str]:
    """The sha256 of every line of the dataset files now (as the driver computes it: ``dataset.line_digest``)."""
    out: set[str] = set()
    for p in paths:
        for item in datafile.lines(p, LINE_LIMIT):
            if isinstance(item, datafile.Line) and item.text.strip():
                out.add(dataset.line_digest(item.text))
    return out


def of_dataset(entries: dict[str, dict[str, Any]], paths: list[str]) -> tuple[dict[str, dict[str, Any]], Kept]:
    """``entries`` without the samples whose line the dataset files no longer hold. ValueError when a file is
    missing or unreadable (``dataset.check_sources``' message)."""
    from hs_patch.samples.store import file_sha256

    dataset.check_sources(paths)
    now = digests(paths)
    kept = Kept(files=[{"name": dataset.source_name(p), "sha256": file_sha256(p)[1]} for p in paths])
    out: dict[str, dict[str, Any]] = {}
    for key, entry in entries.items():
        digest = entry.get(LINE_SHA256)
        if not digest:
            kept.unchecked += 1
        elif digest not in now:
            kept.left_out.append(key)
            continue
        out[key] = entry
    return out, kept
