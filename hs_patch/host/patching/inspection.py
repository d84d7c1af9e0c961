"""``hs-patch inspect``: check a sample file, or a samples directory or shipped run against its
manifest (the checks themselves: :mod:`hs_patch.samples.reader`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

HELP = """\
Validate a sample file, or a directory against its manifest.jsonl: the driver's samples
directory, the capture dir, or a shipped run at the destination (DEST, with samples/ and
manifest.jsonl). Every listed file must exist and match its entry; files the manifest
does not list and manifest lines without key/file/bytes/sha256 are reported (file:line).
A fleet run at the destination (RUN/HOST/ parts, each with its manifest; docs/fleet.md) is
checked as one merged run: a sample id in two parts is reported (extracted twice).

--deep (the default) reads every file: size + sha256 against the manifest, then the
tensors (format, planes, shapes, dtypes, the ids hash to the key); --workers files at a
time, with a progress bar. --quick reads only each file's size and safetensors header
(format, key, where the tensors end): a flipped byte inside the tensor data is NOT found
by --quick, only by --deep.
"""


class NotFound(Exception):
    """The path does not exist (exit 4)."""


class Nothing(Exception):
    """A directory without a manifest: nothing to check against (exit 5)."""


def _progress_bar(total_bytes: int, files: int) -> Any:
    """A rich progress bar on stderr (a plain line every few percent without rich or a terminal)."""
    try:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
        from rich.console import Console
    except ImportError:  # the host extra does not require rich
        return None
    return Progress(TextColumn(f"checking {files} samples"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                    console=Console(stderr=True), transient=True)


def _listed(p: Path) -> dict[str, Any] | None:
    """The manifest entry that lists sample file ``p``: in its own directory (the capture dir, the driver's
    samples) or the one above (a shipped run's samples/). Unusable manifest lines are passed over here
    (inspecting the directory reports them); None if no manifest lists ``p``."""
    from hs_patch.samples import reader, store

    for d in (p.parent, p.parent.parent):
        if (d / store.MANIFEST).is_file():
            entries, _ = reader.manifest_entries(d)
            for e in (entries or {}).values():
                if os.path.normpath(d / e["file"]) == os.path.normpath(p):
                    return e
    return None


def inspect(path: str, deep: bool, workers: int = 1, show_progress: bool = False) -> dict[str, Any]:
    try:
        from hs_patch.samples import reader, store
    except ImportError as e:  # pragma: no cover - store imports only the standard library
        raise SystemExit(f"hs-patch inspect needs the host extra: pip install 'hs-patch[host]' ({e})")
    p = Path(path)
    if not p.exists():
        raise NotFound(f"{p} does not exist")
    if p.is_dir():
        entries, _ = reader.manifest_entries(p)
        if entries is None:
            raise Nothing(f"{p} has no {store.MANIFEST}: nothing to check against (not a samples directory, "
                           "or nothing was written there yet)")
        bar = _progress_bar(sum(e["bytes"] for e in entries.values()), len(entries)) if show_progress else None
        if bar is not None:
            with bar:
                task = bar.add_task("check", total=sum(e["bytes"] for e in entries.values()))
                rep = reader.check_dir(p, deep=deep, workers=workers, progress=lambda n: bar.advance(task, n))
        else:
            rep = reader.check_dir(p, deep=deep, workers=workers)
        return {"action": "inspect", "directory": str(p), "mode": "deep" if deep else "quick", "ok": len(rep.ok),
                "bad": rep.bad, "missing": rep.missing, "unlisted": rep.unlisted, "manifest_problems": rep.problems,
                "tokens": rep.tokens, "bytes": rep.nbytes, "clean": rep.clean,
                "message": f"{len(rep.ok)} ok, {len(rep.bad)} bad, {len(rep.missing)} missing, "
                           f"{len(rep.unlisted)} not in the manifest, {len(rep.problems)} unusable manifest lines "
                           f"({'sha256 + tensors' if deep else 'sizes + headers only'})"}
    entry = _listed(p)
    s = reader.read_sample(p, entry=entry)
    shapes = {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in s.tensors.items()}
    return {"action": "inspect", "file": str(p), "key": s.key, "metadata": s.metadata, "tensors": shapes,
            "manifest_checked": entry is not None, "clean": True,
            "message": f"{s.key}: {s.metadata['num_tokens']} tokens, planes {s.metadata['planes']}"
                       + (f" as fp8 ({s.metadata['dtype']}, a scale a token: format {s.metadata['format']})"
                          if s.fp8 else "")
                       + ("" if entry is not None else " (no manifest beside it lists it: its size and sha256 "
                          "were not checked, so a flipped byte in the tensor data is not found)")}
