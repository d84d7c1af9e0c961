"""The production row checks judge fp8 samples (HS_CAPTURE_DTYPE=fp8, issue #35) through the real capture path.

The same wrong captures as tests/server/test_fingerprints.py (``lab.sabotage`` in the real patched
forward, captured by the real hook, now quantizing to fp8 before the copy), checked by the row
checks with the tiny model's norm weights: the clean prompts of the same passes pass (the checksums
of the fp8 bytes and scales exact, the rows read within the fp8 envelope of the fingerprints taken
before quantization, the norm relations with the widened allowance), and each wrong capture the bf16
check rejects is rejected, for the same reason, in fp8 too.
"""

from __future__ import annotations

import pytest

from conftest import FAMILY_REPRESENTATIVES
from hs_patch.engine.releases import RELEASES
from lab import sabotage
from test_fingerprints import CONSISTENT, WHY, capture, checked, norms, refs  # noqa: F401 (fixtures)


@pytest.mark.parametrize("case", [c for c in sabotage.CASES if c not in CONSISTENT])
@pytest.mark.parametrize("version", FAMILY_REPRESENTATIVES)
def test_each_wrong_fp8_capture_is_rejected_and_right_ones_pass(version, case, release_sources, tiny_model, refs,
                                                                norms, tmp_path):
    undo = sabotage.install()
    try:
        d = capture(release_sources, tiny_model, refs, tmp_path, version, sabotage.rid(case), dtype="fp8")
    finally:
        undo()
    got = checked(d, norms)
    assert got[9] == [] and got[-1] == [], "the donor and the clean prompt batched with the sabotaged one pass"
    if case == "pre_scaled" and not RELEASES[version].family.final_add:
        assert got[30] == [], got[30]  # the layer-boundary family's floor, as in bf16
        return
    assert any(WHY[case] in p for p in got[30]), got[30]
