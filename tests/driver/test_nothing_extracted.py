"""A run that extracted nothing says where each line's reason is: rejects.jsonl for the input's own
faults, missing.jsonl for lines that failed (the server, the capture, the fidelity check)."""

from __future__ import annotations

from hs_patch.host.driver.runstatus import nothing_extracted


def _doc(rejected: int, failed: int) -> dict:
    return {"samples": {"done": 0, "total": rejected + failed, "blank": 0, "rejected": rejected, "failed": failed,
                        "duplicates": 0}}


def test_failed_lines_are_pointed_to_missing_jsonl_not_to_the_inputs_format():
    msg = nothing_extracted(_doc(0, 4), {})
    assert "missing.jsonl" in msg and "rejects.jsonl" not in msg and "JSON lines" not in msg


def test_rejected_lines_still_point_to_rejects_jsonl():
    msg = nothing_extracted(_doc(3, 0), {"unknown_format": 3})
    assert "rejects.jsonl" in msg and "3 unknown_format" in msg and "missing.jsonl" not in msg
    both = nothing_extracted(_doc(1, 1), {"empty": 1})
    assert "rejects.jsonl" in both and "missing.jsonl" in both
