"""What a run does with fidelity results: counts for status/dashboard, and a stop with a diagnosis.

One mismatching sample is rejected (its sample is not kept) and the run goes on; K in a
row stop the run, because then the capture itself is wrong and every further sample would
be too. The stop message names what is likely wrong, from the pattern of the failures.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Mapping, Optional

from hs_patch.host.fidelity.check import DERIVED, Check

DEFAULT_MAX_CONSECUTIVE = 5


class FidelityMonitor:
    def __init__(self, max_consecutive: int = DEFAULT_MAX_CONSECUTIVE):
        if max_consecutive < 1:
            raise ValueError("max_consecutive must be >= 1")
        self.max_consecutive = max_consecutive
        self.checked = self.passed = self.rejected = self.sampled = 0
        self.positions = self.ties = 0
        self.consecutive = 0
        self.last_mismatch: Optional[dict[str, Any]] = None
        self._recent: deque[tuple[Check, dict[str, str]]] = deque(maxlen=max_consecutive)
        self._passed_parts: set[int] = set()
        self._lock = threading.Lock()

    def observe(self, check: Check, metadata: Mapping[str, str]) -> Optional[str]:
        """Count one result; the reason to stop the run when K mismatches came in a row."""
        with self._lock:
            self.checked += 1
            self.sampled += check.kind == "positions"
            self.positions += check.checked
            self.ties += check.ties
            if check.ok:
                self.passed += 1
                self.consecutive = 0
                self._passed_parts.add(check.parts)
                return None
            self.rejected += 1
            self.consecutive += 1
            self.last_mismatch = {"key": check.key, "kind": check.kind, "mismatches": check.mismatches,
                                  "checked": check.checked}
            self._recent.append((check, dict(metadata)))
            if self.consecutive < self.max_consecutive:
                return None
            return (f"fidelity: {self.consecutive} samples in a row whose dumped final state does not give the "
                    f"server's own tokens ({self.rejected} of {self.checked} rejected); likely: "
                    + diagnose(list(self._recent), ever_passed=self.passed > 0, passed_parts=self._passed_parts))

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"checked": self.checked, "passed": self.passed, "rejected": self.rejected,
                    "sampled": self.sampled, "positions": self.positions, "ties": self.ties,
                    "consecutive_mismatches": self.consecutive, "max_consecutive": self.max_consecutive,
                    "last_mismatch": self.last_mismatch}


def diagnose(recent: list[tuple[Check, dict[str, str]]], *, ever_passed: bool, passed_parts: set[int]) -> str:
    """The likeliest causes of a run of mismatches, most specific first."""
    causes = []
    shifts = [max(c.hints.values()) for c, _ in recent if c.hints]
    if shifts and min(shifts) >= 0.5:
        causes.append("the states are shifted by one position against the tokens (an offset error where passes "
                      "are sliced per request or chunks are joined)")
    if all(c.parts > 1 for c, _ in recent) and passed_parts == {1}:
        causes.append("only prompts prefilled in several chunks fail: the reassembly of chunked prefill")
    metas = [m for _, m in recent]
    if any(m.get("sglang_release", "").startswith("0.5.9") and int(m.get("tp_size", "1") or 1) > 1 for m in metas):
        causes.append("SGLang 0.5.9 at TP>1 on SM90/SM100 defers the MoE all-reduce into the next layer "
                      "(flashinfer fusion): the captured residual is a per-rank partial sum (docs/capture.md)")
    if any(c.plane == DERIVED for c, _ in recent):
        causes.append("the post-norm state was derived from final.pre_norm: the norm weight or rms_norm_eps of the "
                      "model directory given to the check is not the served model's")
    if not ever_passed:
        causes.append("no sample has passed since the start: the model directory given to the check is not the "
                      "served model (another lm_head), or HS_CAPTURE_RANK names a rank without the full state")
    causes.append("the dumped states are not the ones the server computed: run hs-patch verify (a changed or "
                  "re-installed SGLang), check the server log for capture errors")
    return "; or ".join(causes)
