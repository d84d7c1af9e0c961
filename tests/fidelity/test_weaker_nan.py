"""A resume cannot weaken the fidelity check through a value that compares false both ways (nan)."""

from __future__ import annotations

import json

import pytest

from hs_patch.host import extract_cli
from hs_patch.host.driver import cli as drive_cli
from hs_patch.host.driver import runstate
from hs_patch.host.fidelity.check import wants_positions
from hs_patch.host.fidelity.settings import settings, weaker

RUN = dict(rows=8, fraction=0.01, positions=32, tie_tolerance=0.02)


@pytest.mark.parametrize("name", ["fraction", "tie_tolerance"])
def test_a_nan_setting_is_weaker_than_any_number(name):
    assert weaker(settings(True, **dict(RUN, **{name: float("nan")})), settings(True, **RUN))


def test_a_resume_with_fraction_nan_is_refused(tmp_path):
    """--fidelity-fraction nan samples no key at all (wants_positions is never true) and, before the fix,
    was not found weaker than 0.01 (nan < 0.01 is false): the resume went through unrecorded."""
    assert not any(wants_positions(f"{i:08x}" + "0" * 24, float("nan")) for i in range(0, 1 << 32, 1 << 24))
    (tmp_path / runstate.RUN_JSON).write_text(json.dumps({"params": {"run": "r"}}))
    runstate.check_fidelity(tmp_path, settings(True, **RUN), accept_weaker=False)
    with pytest.raises(runstate.RunError, match="--fidelity-fraction nan"):
        runstate.check_fidelity(tmp_path, settings(True, **dict(RUN, fraction=float("nan"))), accept_weaker=False)


@pytest.mark.parametrize("flag,value", [("--fidelity-fraction", "nan"), ("--fidelity-fraction", "-0.5"),
                                        ("--fidelity-fraction", "1.5"), ("--fidelity-tie-tolerance", "nan"),
                                        ("--fidelity-tie-tolerance", "-1"), ("--fidelity-positions", "0")])
def test_the_command_line_refuses_fidelity_values_that_mean_nothing(flag, value):
    a = extract_cli.build_parser().parse_args(["drive", "--run", "r", "--data", "a.jsonl", "--model", "/m",
                                               f"{flag}={value}"])
    with pytest.raises(SystemExit, match=flag):
        drive_cli.drive_config(a)
