"""Join: turn the raw sample the hook wrote into the run's final sample.

The raw file is read and verified against its capture-manifest entry (size, sha256,
tensors, key), the driver's ``loss_mask`` (uint8 [L]) is added with the provenance
metadata (``sample_id``, ``source``, ``line``, ``run``, ...), and the result is written
atomically into the samples directory and recorded in its ``manifest.jsonl``. Only then
is the raw file removed (``op: remove`` in the capture manifest). A crash in between
leaves either the raw file (redone) or both (the raw one is swept), never a final
sample without its manifest line counted as done.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping

import torch

from hs_patch import reader, store
from hs_patch.host.capture_dir import CaptureWatcher


class FinalizeError(RuntimeError):
    pass


def finalize(watcher: CaptureWatcher, entry: Mapping[str, Any], samples_dir: str | Path,
             loss_mask: list[int], provenance: Mapping[str, str], *, fsync: bool = False) -> store.Written:
    """Write the final sample for the raw capture ``entry``; returns what was written."""
    raw_path = watcher.directory / entry["file"]
    try:
        raw = reader.read_sample(raw_path, entry=entry)
    except store.SampleError as e:
        raise FinalizeError(f"the raw sample the server wrote is unusable: {e}") from None
    n = int(raw.input_ids.shape[0])
    if len(loss_mask) != n:
        raise FinalizeError(f"{raw_path}: {n} tokens but the loss mask has {len(loss_mask)}")
    tensors = dict(raw.tensors)
    tensors["loss_mask"] = torch.tensor(loss_mask, dtype=torch.uint8)
    order = ["input_ids", *raw.planes, "loss_mask"]
    meta = dict(raw.metadata, **{k: str(v) for k, v in provenance.items()},
                finalized=f"{time.time():.3f}")
    written = store.write_tensors(samples_dir, raw.key, {k: tensors[k] for k in order}, meta, fsync=fsync)
    store.Manifest(samples_dir).add(written, tokens=n, loss_tokens=int(sum(loss_mask)),
                                    sample_id=provenance["sample_id"], run=provenance["run"])
    watcher.remove(raw.key, reason="finalized", run=provenance["run"], sample_id=provenance["sample_id"])
    return written
