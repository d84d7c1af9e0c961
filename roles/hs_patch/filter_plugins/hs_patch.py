"""Filter for the hs_patch role: the human message out of an hs-patch --json result."""

from __future__ import annotations

import json


def hs_patch_error(result):
    """Return hs-patch's own error message from a registered command result.

    With --json, hs-patch prints one JSON object even on failure, carrying
    "error" (and "message"); anything else (a traceback, a missing binary)
    falls back to the tail of stderr/stdout so the play still says what broke.
    """
    if not isinstance(result, dict):
        return str(result)
    stdout = (result.get("stdout") or "").strip()
    try:
        data = json.loads(stdout)
    except ValueError:
        data = None
    if isinstance(data, dict):
        msg = data.get("error") or data.get("message")
        if msg:
            return str(msg)
    text = (result.get("stderr") or "").strip() or stdout or str(result.get("msg") or "")
    return "\n".join(text.splitlines()[-5:]) or "no output"


class FilterModule:
    def filters(self):
        return {"hs_patch_error": hs_patch_error}
