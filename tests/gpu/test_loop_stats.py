"""The closed loop's statistics (tests/gpu/loop/stats.py) and table (loop/table.py), on the CPU.

Synthetic per-conversation counts with a known truth: the paired bootstrap finds a difference that
prompts' spread would hide unpaired, its intervals cover the truth about as often as they claim,
seeds are resampled jointly where arms share them; the verdicts fall on the right side of the
margin; the table is rebuilt from the packed rows alone."""

from __future__ import annotations

import json
import lzma
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loop import stats, table  # noqa: E402


def _arm(name, rng, prompts=200, seeds=3, rate=0.7, shift=0.0, seed_sd=0.0, chain=3, difficulty=None):
    """Counts of a drafter whose per-prompt acceptance is ``difficulty[p] + shift (+ a seed effect)``."""
    diff = difficulty if difficulty is not None else rng.uniform(-0.3, 0.2, prompts)
    comp, ver, corr = (np.zeros((seeds, prompts)) for _ in range(3))
    for s in range(seeds):
        p_acc = np.clip(rate + diff + shift + rng.normal(0, seed_sd), 0.01, 0.99)
        for p in range(prompts):
            passes = 60
            acc = 0
            for _ in range(passes):
                k = 0
                while k < chain and rng.random() < p_acc[p]:
                    k += 1
                acc += k
            ver[s, p], corr[s, p], comp[s, p] = passes, acc, passes + acc + 1
    return stats.Arm(name, list(range(seeds)), [f"p{i}" for i in range(prompts)], comp, ver, corr)


def test_identical_arms_differ_by_zero_with_a_zero_width_interval():
    rng = np.random.default_rng(1)
    a = _arm("ours", rng, prompts=50)
    b = stats.Arm("specforge", a.seeds, a.prompts, a.comp.copy(), a.ver.copy(), a.corr.copy())
    d = stats.paired_difference(a, b, replicates=500)
    assert d["point"] == d["low"] == d["high"] == 0.0 and d["seeds"]["paired_by_seed"]
    assert d["seeds"]["seed_variance"] == "paired" and d["seed_sd"] == 0.0
    assert stats.noninferiority(d) == "non-inferior"


def test_pairing_by_prompt_finds_a_small_difference_that_the_prompts_spread_would_hide():
    """Prompts differ a lot in how easy they are (most of the variance), the two arms little: paired, the
    interval excludes zero; the same numbers with prompts resampled independently for each arm do not."""
    rng = np.random.default_rng(2)
    hard = rng.uniform(-0.65, 0.25, 200)
    a = _arm("ours", rng, prompts=200, seeds=1, difficulty=hard)
    b = _arm("late", rng, prompts=200, seeds=1, difficulty=hard, shift=-0.02)
    d = stats.paired_difference(a, b, replicates=2000)
    assert d["high"] < 0 and stats.control_verdict(d) == "worse"
    # unpaired: each arm's prompts drawn on their own
    g = np.random.default_rng(0)
    reps = []
    for _ in range(2000):
        ia, ib = g.integers(0, 200, 200), g.integers(0, 200, 200)
        reps.append(b.comp[0, ib].sum() / b.ver[0, ib].sum() - a.comp[0, ia].sum() / a.ver[0, ia].sum())
    lo, hi = np.quantile(reps, [0.025, 0.975])
    assert lo < 0 < hi, "unpaired, the prompts' spread hides it: this is what pairing buys"
    assert d["high"] - d["low"] < (hi - lo) / 2


def test_intervals_cover_the_truth_about_as_often_as_they_claim():
    """100 repetitions of a small experiment with a known difference between arms (the same prompts, new
    drafters each time, three seeds an arm whose drafters vary): the 95% intervals cover the true
    difference in 88-100 of them. (A bootstrap over the three seeds covered 76 here.)"""
    rng = np.random.default_rng(3)
    truth_rng = np.random.default_rng(4)
    hard = truth_rng.uniform(-0.3, 0.2, 80)
    # the true arm values: the mean over many seeds' drafters of the expected accept length
    big_a = _arm("ours", np.random.default_rng(5), prompts=80, seeds=40, difficulty=hard, seed_sd=0.02)
    big_b = _arm("other", np.random.default_rng(6), prompts=80, seeds=40, difficulty=hard, shift=-0.03, seed_sd=0.02)
    truth = big_b.value() - big_a.value()
    covered = 0
    for k in range(100):
        a = _arm("ours", rng, prompts=80, seeds=3, difficulty=hard, seed_sd=0.02)
        b = _arm("other", rng, prompts=80, seeds=3, difficulty=hard, shift=-0.03, seed_sd=0.02)
        d = stats.paired_difference(a, b, replicates=400, seed=k)
        covered += d["low"] <= truth <= d["high"]
    assert 88 <= covered <= 100, covered


def test_seeds_are_resampled_jointly_only_where_both_arms_have_the_same_seeds():
    rng = np.random.default_rng(7)
    a = _arm("ours", rng, prompts=40, seeds=3, seed_sd=0.05)
    one = _arm("zeroed", rng, prompts=40, seeds=1, shift=-0.3)
    d3 = stats.paired_difference(a, _arm("specforge", rng, prompts=40, seeds=3), replicates=300)
    d1 = stats.paired_difference(a, one, replicates=300)
    assert d3["seeds"]["paired_by_seed"] and not d1["seeds"]["paired_by_seed"]
    assert d1["seeds"] == {"ours": [0, 1, 2], "zeroed": [0], "paired_by_seed": False, "seed_variance": "pooled"}
    ra = a.comp.sum(1) / a.ver.sum(1)
    assert d1["seed_sd"] == pytest.approx(np.sqrt(np.var(ra, ddof=1) * (1 / 3 + 1)), abs=1e-5), \
        "one seed: ours' seed variance stands for the control's"
    assert d1["df"] < 40 and d1["high"] - d1["low"] > d1["prompts_only"][1] - d1["prompts_only"][0]
    lone = stats.paired_difference(_arm("ours", rng, prompts=40, seeds=1), one, replicates=300)
    assert lone["seed_sd"] is None and lone["seeds"]["seed_variance"] is None, "no seed spread to estimate"
    gauge = stats.paired_difference(a, one, "gauge", replicates=300)
    assert gauge["point"] == pytest.approx(one.value("gauge") - a.value("gauge"), abs=1e-4)


@pytest.mark.parametrize("low, high, verdict", [(-0.04, 0.02, "non-inferior"), (-0.02, 0.06, "inconclusive"),
                                                (0.055, 0.12, "inferior"), (-0.2, -0.1, "non-inferior")])
def test_the_noninferiority_verdict_reads_the_interval_of_ours_minus_theirs(low, high, verdict):
    """``diff`` is specforge - ours; ours is non-inferior when ours - specforge > -0.05 over the whole interval."""
    assert stats.noninferiority({"point": (low + high) / 2, "low": low, "high": high}, 0.05) == verdict


def test_a_control_is_worse_only_when_its_whole_interval_is_below_zero():
    assert stats.control_verdict({"point": -0.2, "low": -0.3, "high": -0.01}) == "worse"
    assert stats.control_verdict({"point": -0.02, "low": -0.05, "high": 0.01}) == "NOT worse"
    assert stats.control_verdict({"point": None}) == "not measured"


def _rows(arm: stats.Arm, setting="3,1,4", temp=0.0, subset=lambda p: "heldout", at_cap=()):
    out = []
    for si, s in enumerate(arm.seeds):
        for pi, p in enumerate(arm.prompts):
            out.append({"arm": arm.name, "seed": s, "setting": setting, "temperature": temp, "sample_id": p,
                        "subset": subset(p), "completion_tokens": int(arm.comp[si, pi]),
                        "verify_ct": int(arm.ver[si, pi]), "correct_drafts": int(arm.corr[si, pi]),
                        "histogram": [1, 2, 3, 4], "finish": "length" if p in at_cap else "stop",
                        "output_sha256": f"{p}-{arm.name}"})
    return out


def test_the_table_is_rebuilt_from_the_packed_rows_with_every_verdict(tmp_path, capsys):
    rng = np.random.default_rng(8)
    hard = rng.uniform(-0.3, 0.2, 60)
    ours = _arm("ours", rng, prompts=60, difficulty=hard)
    sf = _arm("specforge", rng, prompts=60, difficulty=hard, shift=-0.005)
    late = _arm("late", rng, prompts=60, seeds=1, difficulty=hard, shift=-0.2)
    half = ["p%d" % i for i in range(30)]
    sub = lambda p: "humaneval" if p in half else "heldout"  # noqa: E731
    rows = _rows(ours, at_cap={"p1", "p2"}, subset=sub) + _rows(sf, subset=sub) + _rows(late, subset=sub)
    rows += [{"arm": "plain", "seed": 0, "setting": "3,1,4", "temperature": 0.0, "sample_id": p,
              "output_sha256": f"{p}-ours" if p != "p0" else "other"} for p in ours.prompts]
    rows += _rows(_arm("ours", rng, prompts=60, seeds=1, difficulty=hard), temp=1.0, subset=sub)
    rows.append({**rows[0], "seed": 1, "sample_id": "only-in-one", "verify_ct": 3})   # measured by one arm only
    packed = tmp_path / "conversations.jsonl.xz"
    with lzma.open(packed, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    text, data = table.render(table.read_rows(packed), replicates=500)
    main = data["3,1,4 T=0"]
    assert main["prompts"] == 60, "only prompts every arm measured"
    assert main["arms"]["specforge"]["verdict"] == "ours non-inferior (margin 0.05)"
    assert main["arms"]["late"]["verdict"] == "worse"
    assert main["arms"]["ours"]["at_cap"] == round(6 / 180, 4) and main["arms"]["ours"]["identical_to_plain"] == (177, 180)
    assert main["arms"]["ours"]["accepted_at"] == [0.9, 0.7, 0.4]
    assert "| humaneval | 30 |" in text and "| heldout | 30 |" in text
    assert "3,1,4 T=1" in data and "(3,1,4), temperature 1:" in text
    assert data["3,1,4 T=1"]["arms"]["ours"]["identical_to_plain"] is None, "sampled: no greedy identity"
    assert table.main([str(packed), "--replicates", "200", "--json", str(tmp_path / "t.json")]) == 0
    assert "| specforge | 3 |" in capsys.readouterr().out and json.loads((tmp_path / "t.json").read_text())


def test_a_prompt_missing_from_one_seed_is_named():
    rows = {0: [{"sample_id": "a", "completion_tokens": 4, "verify_ct": 2, "correct_drafts": 1}],
            1: [{"sample_id": "b", "completion_tokens": 4, "verify_ct": 2, "correct_drafts": 1}]}
    arm = stats.arm_from_reports("ours", rows)
    assert arm.prompts == []
    with pytest.raises(ValueError, match="seed 1: 1"):
        stats.arm_from_reports("ours", rows, prompts=["a"])


def test_another_checks_rows_of_the_same_drafter_are_not_the_arms(tmp_path):
    """The greedy check serves ours-s0 again beside a plain server: its rows (tagged) do not replace serve_main's
    own measurement of ours-s0, nor add to ours' `= plain` count; in a file packed before the tag, the first row
    of an arm, seed and prompt is the arm's (serve_main's, which pack writes first)."""
    rng = np.random.default_rng(3)
    ours = _arm("ours", rng, prompts=40)
    rows = _rows(ours)
    greedy = [{**r, "verify_ct": r["verify_ct"] * 3} for r in rows if r["seed"] == 0]   # a different measurement
    plain = [{"arm": "plain", "seed": 0, "setting": "3,1,4", "temperature": 0.0, "sample_id": p,
              "output_sha256": f"{p}-ours"} for p in ours.prompts]
    want = table.render(rows + plain, replicates=200)[1]["3,1,4 T=0"]["arms"]["ours"]
    assert want["identical_to_plain"] == (120, 120)
    for extra in ([{**r, "tag": "plain"} for r in greedy], greedy):   # tagged, and untagged after serve_main's
        got = table.render(rows + extra + plain, replicates=200)[1]["3,1,4 T=0"]["arms"]["ours"]
        assert got["per_seed"] == want["per_seed"] and got["identical_to_plain"] == (120, 120)
