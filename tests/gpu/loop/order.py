"""The same sample order for every arm.

SpecForge's offline trainer lists every ``*.ckpt`` under its directory sorted by path and shuffles that
list with ``torch.randperm(n, generator seeded with seed + epoch)`` (specforge 0.2.0:
runtime/data_plane/offline_reader.py list_feature_files, launch.py _distributed_sampler_indices). Two
arms see their samples in the same order only if their sorted file lists hold the same samples at the
same places. Our export names files by our sample keys, SpecForge's capture ``rows_*/data_<i>.ckpt``
by its own row numbers, so each arm trains on a directory of hard links named by one canonical rank:
the position of the sample's token ids' sha256 among ours' (``000123.ckpt``). Every arm whose samples
are ours' (the controls by construction, SpecForge's capture when it holds the same chats) then sees
the same order for the same seed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from loop import features


def ranks(ours: Path) -> dict[str, dict]:
    """ids key -> {rank, rel} for every file of our export (its relative path names the controls' files too)."""
    keyed = sorted((features.ids_key(features.load(f)["input_ids"]), f.relative_to(ours).as_posix())
                   for f in features.ckpts(ours))
    return {k: {"rank": i, "rel": rel} for i, (k, rel) in enumerate(keyed)}


def link(src: Path, dst: Path, rank: dict[str, dict], by_name: bool) -> dict:
    """``dst/<rank>.ckpt`` hard links to ``src``'s files: by ours' relative names (``by_name``: ours and the
    controls) or by each file's token ids (SpecForge's capture). Returns what was linked and what differs
    from ours' set (then the order is NOT the same: said, never hidden)."""
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    width = max(6, len(str(len(rank))))
    have: dict[int, Path] = {}
    extra = 0
    if by_name:
        for r in rank.values():
            f = src / r["rel"]
            if f.exists():
                have[r["rank"]] = f
    else:
        for f in features.ckpts(src):
            r = rank.get(features.ids_key(features.load(f)["input_ids"]))
            if r is None or r["rank"] in have:
                extra += 1
            else:
                have[r["rank"]] = f
    for i, f in sorted(have.items()):
        os.link(f, dst / f"{i:0{width}d}.ckpt")
    missing = len(rank) - len(have)
    return {"linked": len(have), "missing": missing, "extra": extra, "same_order": missing == 0 and extra == 0}
