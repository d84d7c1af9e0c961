"""The rows of the LM head's input a pass keeps for the fidelity check (HS_CAPTURE_FINAL=none, or fp8 planes):
how much room a staging slot makes for them, and how many each part of a pass keeps in it.

Standard library only (the hook imports it inside the server).
"""

from __future__ import annotations

from typing import Sequence


def check_room(capacity: int, check_rows: int) -> int:
    """Rows of the LM head's input a slot keeps for the fidelity check (0: none kept): a quarter of the pass, at
    least ``check_rows``, at most the pass. Every part of a pass keeps its last ``check_rows`` rows while they fit
    (a pass of 8,192 tokens: up to 128 parts of 16 rows); the bf16 check buffer then costs half an fp8 plane,
    not two (issue #35: the staging memory halved)."""
    return 0 if check_rows <= 0 else min(capacity, max(check_rows, capacity // 4))


def fit_check_counts(seq_lens: Sequence[int], check_rows: int, room: int) -> list[int]:
    """Each part's last rows kept for the check: ``min(check_rows, its length)``, or, where their sum exceeds
    ``room``, the largest per-part cap that fits (at least 1 a part: the check's last position; more parts than
    ``room`` rows get a buffer of the pass's own, :meth:`hs_patch.server.passes.Slot.check`). A sample records
    how many it kept."""
    counts = [min(check_rows, int(n)) for n in seq_lens]
    if sum(counts) <= room:
        return counts
    cap = max(1, room // max(1, len(counts)))
    while sum(min(c, cap + 1) for c in counts) <= room:
        cap += 1
    return [min(c, cap) for c in counts]
