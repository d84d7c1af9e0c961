"""Which known release an unknown ``deepseek_v2.py`` is nearest, and what differs where the patch works.

Standard library only. A file no release has (a release published after this hs-patch, or a
hand-edited one) is refused; ``hs-patch status`` then names the known release whose patch
anchors and regions the file matches best, and shows, for each anchor that is not there, a
unified diff of the anchor against the closest lines of the file, so adding the release is a
reviewed step: read the diff, read SGLang's code, write its entry and slots in
hs_patch/engine/releases.py (a new family's edits in hs_patch/engine/families.py).
"""

from __future__ import annotations

import ast
import difflib
import hashlib
from dataclasses import dataclass

from hs_patch.engine.releases import REGIONS, RELEASES, Release

MAX_DIFF_LINES = 12  # per anchor


def region_sources(text: str) -> dict[str, str]:
    """The source of each of REGIONS in ``text`` ("Class.method" -> its lines; absent ones left out)."""
    lines = text.splitlines(keepends=True)
    out: dict[str, str] = {}
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):  # a truncated or damaged file: no region can be told apart
        return out
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and (node.name, fn.name) in REGIONS:
                    out[f"{node.name}.{fn.name}"] = "".join(lines[fn.lineno - 1: fn.end_lineno])
    return out


def region_digests(text: str) -> tuple[str, ...]:
    """sha256[:8] of each of REGIONS' source in ``text`` ("-" where it is absent): a Release's ``regions``."""
    src = region_sources(text)
    return tuple(hashlib.sha256(src[f"{c}.{m}"].encode()).hexdigest()[:8] if f"{c}.{m}" in src else "-"
                 for c, m in REGIONS)


@dataclass
class Nearest:
    release: Release
    anchors_found: int
    regions: dict[str, str]         # "Class.method" -> same | differs | absent
    missing: list[tuple[int, str]]  # (edit number, unified diff of the anchor against the closest lines)
    parse_error: str = ""           # why the file is not Python ("" if it parses): truncated, damaged

    def summary(self) -> dict:
        return {"release": self.release.version, "family": self.release.family.name,
                "anchors_found": self.anchors_found, "anchors": len(self.release.edits),
                "regions": self.regions, "anchor_diffs": [{"edit": n, "diff": d} for n, d in self.missing],
                "parse_error": self.parse_error or None}

    def lines(self) -> list[str]:
        r = self.release
        out = [f"nearest known release: SGLang {r.version} ({r.family.name} family): {self.anchors_found} of "
               f"{len(r.edits)} patch anchors found once"]
        if self.parse_error:
            out.insert(0, f"this file is not valid Python ({self.parse_error}): truncated or damaged? reinstall SGLang "
                          "(pip install --force-reinstall --no-deps sglang==<release>), then run hs-patch apply")
        changed = [k for k, v in self.regions.items() if v != "same"]
        out.append("regions the patch depends on that differ from it: " + (", ".join(
            f"{k} ({self.regions[k]})" for k in changed) or "none"))
        for n, diff in self.missing:
            out.append(f"edit {n}: anchor not found once; closest lines in this file:")
            out += ["  " + line for line in diff.splitlines()]
        out.append(("every anchor is there once, so the family's edits would apply" if not self.missing else
                    "the family's edits do not apply as they are") + ": adding this release is a reviewed step: read "
                   "SGLang's code in the regions that differ (docs/capture.md lists what each family relies on), then "
                   "write its entry and slots in hs_patch/engine/releases.py (a new family's edits in "
                   "hs_patch/engine/families.py) and run the tests on its wheel")
        return out


def _closest(text_lines: list[str], anchor: str) -> tuple[int, list[str]]:
    """The window of ``text_lines`` most like ``anchor`` (same line count), and where it starts (0-based)."""
    want = anchor.splitlines(keepends=True)
    n = max(1, len(want))
    best, best_at = -1.0, 0
    for i in range(0, max(1, len(text_lines) - n + 1)):
        m = difflib.SequenceMatcher(None, "".join(want), "".join(text_lines[i:i + n]), autojunk=False)
        if m.real_quick_ratio() <= best or m.quick_ratio() <= best:
            continue
        ratio = m.ratio()
        if ratio > best:
            best, best_at = ratio, i
    return best_at, text_lines[best_at:best_at + n]


def nearest(text: str) -> Nearest:
    """The known release whose anchors (then regions) ``text`` matches best; newest wins a tie."""
    digests = region_digests(text)
    scored = []
    for order, r in enumerate(RELEASES.values()):
        found = sum(text.count(e.anchor) == 1 for e in r.edits)
        same = sum(a == b for a, b in zip(digests, r.regions))
        scored.append((found / len(r.edits), same, order, r))
    _, _, _, best = max(scored, key=lambda s: s[:3])
    names = [f"{c}.{m}" for c, m in REGIONS]
    present = region_sources(text)
    regions = {k: ("same" if d == want else "absent" if k not in present else "differs")
               for k, d, want in zip(names, digests, best.regions)}
    lines = text.splitlines(keepends=True)
    missing = []
    for n, e in enumerate(best.edits, 1):
        if text.count(e.anchor) == 1:
            continue
        at, window = _closest(lines, e.anchor)
        diff = difflib.unified_diff(e.anchor.splitlines(keepends=True), window, f"{best.version} (edit {n})",
                                    f"this file (line {at + 1})", n=1)
        body = [d.rstrip("\n") for d in diff]
        if len(body) > MAX_DIFF_LINES:
            body = body[:MAX_DIFF_LINES] + [f"... {len(body) - MAX_DIFF_LINES} more diff lines"]
        missing.append((n, "\n".join(body)))
    found = sum(text.count(e.anchor) == 1 for e in best.edits)
    return Nearest(best, found, regions, missing, _parse_error(text))


def _parse_error(text: str) -> str:
    if "\ufffd" in text:
        return "bytes that are not UTF-8"
    try:
        ast.parse(text)
    except (SyntaxError, ValueError) as e:
        return f"line {getattr(e, 'lineno', '?')}: {getattr(e, 'msg', e)}"
    return ""
