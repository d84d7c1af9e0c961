"""The stall error names the limit that was set (HS_CAPTURE_STALL_SECONDS=0.2 read "behind for 0s")."""

from __future__ import annotations

import pytest

from hs_patch.server import config, hook


def test_a_sub_second_stall_limit_is_named_as_set(tmp_path):
    h = hook.CaptureHook(config.CaptureConfig(enabled=True, directory=str(tmp_path), layers=(0,), final="both",
                                              slots=1, slot_tokens=4, stall_seconds=0.2), hidden_size=16, metadata={})
    slot = h._acquire()  # the only staging buffer, held by a pass the writer has not finished
    try:
        with pytest.raises(RuntimeError, match=r"behind for 0\.2s \(HS_CAPTURE_STALL_SECONDS\)"):
            h._acquire()
    finally:
        h._free.put(slot)
        h.close()
