"""scripts/release_record.py drafts a release's entry from its wheel: it must reproduce the recorded ones."""

from __future__ import annotations

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import REPRESENTATIVES
from hs_patch.engine.releases import RELEASES, TARGET

ROOT = Path(__file__).resolve().parents[2]


def script():
    spec = importlib.util.spec_from_file_location("release_record", ROOT / "scripts" / "release_record.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
@pytest.mark.parametrize("version", REPRESENTATIVES)
def test_the_drafted_entry_is_the_recorded_one(version, release_sources):
    """One release per family and spelling: the family, spelling, sha256s, anchor lines and regions the script
    finds in the wheel's file are those releases.py records (its stack extras are the guide's to add)."""
    rr = script()
    text = (release_sources[version] / TARGET).read_text()
    found, like = rr.fit(version, text)
    want = replace(RELEASES[version], pip_overrides=(), cudnn_min=0, replaces=())
    assert replace(found, torch=want.torch, cuda=want.cuda) == want
    assert like.family is want.family and dict(like.own) == dict(want.own)
    line = rr.entry(replace(found, torch=want.torch, cuda=want.cuda), like)
    assert f'_r("{version}", ' in line and want.pristine_sha256 in line and want.patched_sha256 in line
    assert ("own=_" in line) == bool(want.own)


@pytest.mark.slow
def test_a_file_no_known_spelling_fits_is_said_so(release_sources, tmp_path, capsys):
    """An anchor gone (a refactor): no entry, exit 1, and hs-patch status's account of what differs."""
    import zipfile

    rr = script()
    text = (release_sources["0.5.23"] / TARGET).read_text()
    changed = text.replace("        self.layers_to_capture = []\n", "        self.layers_to_capture: list = []\n")
    assert rr.fit("0.5.99", changed) is None
    wheel = tmp_path / "sglang-0.5.99-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(TARGET, changed)
    assert rr.main(["0.5.99", "--wheel", str(wheel), "--cuda", "13.0"]) == 1
    err = capsys.readouterr().err
    assert "no known family and spelling has every anchor of 0.5.99's" in err and "nearest known release" in err
