"""What the capture hook hands its writer (:class:`PassRecord`) and what the writer counts (:class:`WriterStats`).

Standard library only at import (torch is named for type checking): imported inside the SGLang server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

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
