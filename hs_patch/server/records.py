"""What the capture hook hands its writer (:class:`PassRecord`) and what the writer counts (:class:`WriterStats`).

Standard library only at import (torch is named for type checking): imported inside the SGLang server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class PassRecord:
    """One prefill pass on host memory, as the hook hands it over."""

    ids: "torch.Tensor"                 # int64 [T], CPU
    planes: Sequence["torch.Tensor"]    # [T, H] each, CPU, in plane order
    seq_lens: Sequence[int]
    prefix_lens: Sequence[int]
    full_lens: Sequence[int]            # each request's whole prompt length (SGLang's orig_seq_lens)
    rids: Optional[Sequence[str]] = None
    wait: Optional[Callable[[], None]] = None     # blocks until the copies have landed
    release: Optional[Callable[[], None]] = None  # gives the staging buffer back
    fingerprints: Optional["torch.Tensor"] = None  # F32 [streams, T, BLOCKS] (hs_patch.server.fingerprint)
    checksums: Optional["torch.Tensor"] = None     # I32 [checksums, T, BLOCKS] (the same module)
    check_rows: Optional["torch.Tensor"] = None    # HS_CAPTURE_FINAL=none: [sum of check_counts, H], part by part
    check_counts: Optional[Sequence[int]] = None   # each part's last rows of the LM head's input kept
    scales: Optional["torch.Tensor"] = None        # HS_CAPTURE_DTYPE=fp8: F32 [planes, T], one scale a row
    queued: float = field(default_factory=time.time)  # when the hook handed it over (its forward launched)


@dataclass
class WriterStats:
    """The writer's counts since start, shown in ``hook_status.json``."""

    passes: int = 0
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    merged: int = 0
    skipped: int = 0
    errors: int = 0
    with_intent: int = 0
    duplicates: int = 0
    started: float = field(default_factory=time.time)


def pass_timeline(queued: float, landed: float, written: float, tokens: int, samples: int) -> dict[str, Any]:
    """Where a settled pass's time went, for the newest one in ``hook_status.json``: when the hook handed it
    over (``queued``, wall time, its forward launched), then seconds until its copies had landed, until its
    last write (and hash) ended, until its samples were published (now). The last pass of a burst is what a
    client waits for after its last response (issue #22's tail)."""
    return {"queued": round(queued, 3), "tokens": tokens, "samples": samples, "landed_s": round(landed - queued, 3),
            "written_s": round(written - landed, 3), "published_s": round(time.time() - written, 3)}
