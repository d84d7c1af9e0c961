"""What a run does with fidelity results: counts for status/dashboard, and a stop with a diagnosis.

One mismatching sample is rejected (its sample is not kept) and the run goes on; K in a
row stop the run, because then the capture itself is wrong and every further sample would
be too. The stop message names what is likely wrong, from the pattern of the failures.

The run's own statistics of each plane (the mean log norm of the rows the check read, per
sample) are kept too: a sample far outside them is counted and shown as a warning, never
rejected for it (statistics learned from a run cannot say which layer is right: a capture
wrong from the start is learned; the row checks' relations decide).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from typing import Any, Mapping, Optional

from hs_patch.host.fidelity.check import DERIVED, Check

DEFAULT_MAX_CONSECUTIVE = 5
OUTLIER_STD = 6.0       # a plane's log norm this many standard deviations off the run's is a warning
OUTLIER_AFTER = 50      # samples of the run before warnings start


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
        self.stats: dict[str, list[float]] = {}   # plane -> [count, mean, M2] of per-sample mean log norms
        self.warnings = 0
        self.last_warning: Optional[str] = None
        self._lock = threading.Lock()

    def observe(self, check: Check, metadata: Mapping[str, str]) -> Optional[str]:
        """Count one result; the reason to stop the run when K mismatches came in a row."""
        with self._lock:
            self.checked += 1
            self.sampled += check.kind == "positions"
            self.positions += check.checked
            self.ties += check.ties
            self._statistics(check)
            if check.ok:
                self.passed += 1
                self.consecutive = 0
                self._passed_parts.add(check.parts)
                return None
            self.rejected += 1
            self.consecutive += 1
            self.last_mismatch = {"key": check.key, "kind": check.kind, "mismatches": check.mismatches,
                                  "checked": check.checked, "problems": check.problems[:3],
                                  "gap_mismatches": len(check.gap_mismatches)}
            self._recent.append((check, dict(metadata)))
            if self.consecutive != self.max_consecutive:  # the one that reaches K stops the run: samples checked
                return None                                # at once may pass it before that one asks to stop
            return (f"fidelity: {self.consecutive} samples in a row whose dumped states are not what the server "
                    f"computed ({self.rejected} of {self.checked} rejected; last: "
                    f"{'; '.join(check.problems[:2]) or 'other tokens than the server at the checked positions'}); "
                    "likely: "
                    + diagnose(list(self._recent), ever_passed=self.passed > 0, passed_parts=self._passed_parts))

    def _statistics(self, check: Check) -> None:
        """Welford's running mean and variance of each plane's log norm; a far-off sample is a warning."""
        for plane, value in check.rows.get("log_norms", {}).items():
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                continue  # a non-finite sample is rejected by the row checks; it must not poison the run's statistics
            n, mean, m2 = self.stats.setdefault(plane, [0, 0.0, 0.0])
            if n >= OUTLIER_AFTER and m2 > 0 and abs(value - mean) > OUTLIER_STD * math.sqrt(m2 / (n - 1)):
                self.warnings += 1
                self.last_warning = (f"sample {check.key[:12]}: {plane} rows have log norm {value:.3f}, the run's is "
                                     f"{mean:.3f} +- {math.sqrt(m2 / (n - 1)):.3f} (a warning, not a verdict)")
            n += 1
            delta = value - mean
            mean += delta / n
            self.stats[plane] = [n, mean, m2 + delta * (value - mean)]

    def status(self) -> dict[str, Any]:
        with self._lock:
            planes = {p: {"mean_log_norm": round(m, 4), "std": round(math.sqrt(m2 / (n - 1)), 4) if n > 1 else None}
                      for p, (n, m, m2) in self.stats.items()}
            return {"checked": self.checked, "passed": self.passed, "rejected": self.rejected,
                    "sampled": self.sampled, "positions": self.positions, "ties": self.ties,
                    "consecutive_mismatches": self.consecutive, "max_consecutive": self.max_consecutive,
                    "last_mismatch": self.last_mismatch, "planes": planes, "warnings": self.warnings,
                    "last_warning": self.last_warning}


def diagnose(recent: list[tuple[Check, dict[str, str]]], *, ever_passed: bool, passed_parts: set[int]) -> str:
    """The likeliest causes of a run of mismatches, most specific first."""
    causes = []
    problems = [p for c, _ in recent for p in c.problems]
    if any("no fingerprints" in p for p in problems):
        causes.append("the capture hook inside the server is older than this driver: run hs-patch apply and restart "
                      "the server")
    if any("differ from what the forward pass held" in p for p in problems):
        causes.append("rows changed between the GPU and the file (the staging copy or the writer): report it with "
                      "the server log and hook_status.json")
    if any("+attn:" in p for p in problems):
        causes.append("a stored layer.<i> plus its attention's output is not the residual after it: the plane is "
                      "scaled, a partial sum, another layer's or another prompt's state (run hs-patch verify; a "
                      "changed SGLang)")
    if any("are not the embedding of this sample's tokens" in p for p in problems) or \
            any(c.gap_mismatches for c, _ in recent):
        causes.append("the states are another request's or shifted against the tokens (the embedded rows or the "
                      "server's logit gaps disagree): where passes are sliced per request or chunks are joined")
    if any("all zeros" in p or "NaN or Inf" in p for p in problems):
        causes.append("the captured states are zeros or not finite: the capture point reads a buffer SGLang has "
                      "not filled (run hs-patch verify)")
    if any("input norm, are not what layer" in p for p in problems):
        causes.append("a stored layer.<i> is not the fully reduced input of layer i (another layer's state or a "
                      "capture point before the all-reduce): run hs-patch verify; a changed or re-installed SGLang")
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
