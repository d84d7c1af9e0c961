"""Files an earlier hs-patch patched: recognised, so ``apply`` upgrades them and ``revert`` undoes them.

- hs-patch 0.1.0 kept the hook at ``hs_patch.hook``: its patched file differs from today's
  only in the lines of ``_EARLIER_LAYOUT``.
- hs-patch before issue #25 did not hand the hook what each layer's attention reads: its
  patched file is today's without those lines (``earlier_edits``). ``verify`` fails on both
  (the hook would refuse every pass), ``apply`` upgrades them: undo the earlier edits, check
  the pristine sha256, apply today's.
"""

from __future__ import annotations

import hashlib

from hs_patch.engine.families import ATTN_INPUT, ATTN_INPUT_LINE, Edit
from hs_patch.engine.releases import RELEASES, Release, apply_edits

_EARLIER_LAYOUT = (("(see hs_patch.hook)", "(see hs_patch.server.hook)"),
                   ("from hs_patch.hook import attach", "from hs_patch.server.hook import attach"))


def from_earlier_layout(text: str) -> str:
    """``text`` with the lines an earlier hs-patch layout wrote replaced by today's."""
    for old, new in _EARLIER_LAYOUT:
        text = text.replace(old, new)
    return text


def earlier_edits(release: Release) -> tuple[Edit, ...]:
    """The edits hs-patch made to ``release`` before the attention input was handed to the hook."""
    out = []
    for e in release.edits:
        replacement = e.replacement
        for line in (ATTN_INPUT, ATTN_INPUT_LINE):
            replacement = replacement.replace(line, "")
        if replacement != e.anchor:
            out.append(Edit(e.anchor, replacement))
    return tuple(out)


def from_earlier_patch(text: str) -> tuple[Release, str] | None:
    """(release, today's patched text) if ``text`` is a release's file as an earlier hs-patch patched it."""
    for release in RELEASES.values():
        original = text
        for edit in reversed(earlier_edits(release)):
            if original.count(edit.replacement) != 1:
                break
            original = original.replace(edit.replacement, edit.anchor)
        else:
            if hashlib.sha256(original.encode("utf-8")).hexdigest() == release.pristine_sha256:
                return release, apply_edits(release, original)
    return None
