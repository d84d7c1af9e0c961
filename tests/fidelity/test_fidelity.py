"""Production fidelity check: dumped final state vs the server's own tokens of the same pass."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hs_patch.host.fidelity import check as fidelity
from hs_patch.host.driver.client import SGLangClient, generated_token, server_top1
from hs_patch.host.fidelity.check import Check, FidelityChecker, LMHead, compare, request_fields, wants_positions
from hs_patch.host.fidelity.policy import FidelityMonitor
from hs_patch.samples import reader, store
from lab.standin_server import Engine, StandinServer

PARAMS = {"max_new_tokens": 1, "temperature": 0.0}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    """The stand-in (0.5.16's patched forward) capturing layers 1,2,3 and both final planes."""
    capture = tmp_path_factory.mktemp("capture")
    mp = pytest.MonkeyPatch()
    mp.setenv("HS_CAPTURE_LAYERS", "1,2,3")
    mp.setenv("HS_CAPTURE_FINAL", "both")
    try:
        srv = StandinServer(Engine(str(tiny_model_dir), str(capture), release="0.5.16", chunked_prefill_size=48,
                                   batch_window_ms=3)).start()
    finally:
        mp.undo()
    yield srv, capture
    srv.close()


def wait_sample(capture: Path, key: str, timeout: float = 30) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        e = store.read_manifest(capture).get(key)
        if e:
            return capture / e["file"]
        time.sleep(0.02)
    raise AssertionError(f"no sample {key} in {capture}")


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 40, 61, 100, 17, 130][:n]   # 61, 100, 130 > chunk 48: prefilled in parts
    return [torch.randint(3, 500, (k,), generator=g).tolist() for k in lengths]


def test_every_sample_and_the_sampled_positions_match_the_server(served, tiny_model_dir, tmp_path):
    srv, capture = served
    client = SGLangClient(srv.url)
    head = LMHead.from_model_dir(tiny_model_dir)
    checker = FidelityChecker(head, tmp_path, positions=32)
    results = []
    try:
        for i, ids in enumerate(prompts(6)):
            key = store.sample_key(ids)
            extra = request_fields(key, len(ids), fraction=1.0 if i % 2 else 0.0, positions=32)
            out = client.generate(ids, PARAMS, f"fid-{i}", **extra)
            results.append(checker.check(key, wait_sample(capture, key), out, sample_id=f"s{i}"))
    finally:
        checker.close()
    # the 5-token prompt: every sample is asked for its last 16 positions, which cover it whole
    assert [r.kind for r in results] == ["positions", "positions", "last", "positions", "last", "positions"]
    assert all(r.ok for r in results), [r.details for r in results]
    assert [r.checked for r in results] == [5, 32, 1, 32, 1, 32]
    assert [r.gaps for r in results] == [5, 32, 16, 32, 16, 32] and not any(r.gap_mismatches for r in results)
    assert any(r.parts > 1 for r in results)          # chunked prompts are checked as well
    log = store.read_jsonl(tmp_path / fidelity.FIDELITY_LOG)
    assert [rec["key"] for rec in log] == [r.key for r in results] and all(rec["ok"] for rec in log)
    assert log[0]["sample_id"] == "s0" and log[0]["plane"] == "final.post_norm"


def test_server_top1_reads_sglangs_shape(served):
    srv, _ = served
    ids = prompts(2)[1]
    out = SGLangClient(srv.url).generate(ids, PARAMS, "shape", return_logprob=True,
                                         logprob_start_len=len(ids) - 5, top_logprobs_num=2)
    meta = out["meta_info"]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"]) == 5
    assert meta["input_token_logprobs"][0][0] is None and meta["input_token_logprobs"][1][1] == ids[-4]
    top = server_top1(out, len(ids), len(ids) - 5)
    assert sorted(top) == list(range(len(ids) - 5, len(ids)))
    assert top[len(ids) - 1] == generated_token(out) == out["output_ids"][0]


def _corrupt(src: Path, dst_dir: Path, how: str) -> Path:
    """A copy of a captured sample whose final state is wrong in a way a capture bug would make it.

    (A pre-norm state stored as the post-norm one is not among them: the tiny model's norm
    weight is all ones, so the norm only rescales rows and leaves every argmax unchanged; a
    trained model's norm weight is not uniform.)"""
    s = reader.read_sample(src)
    t = dict(s.tensors)
    post = t["final.post_norm"]
    if how == "shift":          # one row late: the state of position p stored at p + 1
        t["final.post_norm"] = torch.cat([post[:1], post[:-1]])
    elif how == "wrong-layer":  # another layer's state stored as the final one
        t["final.post_norm"] = t["layer.2"].clone()
    elif how == "misplaced":    # rows of other positions (a slicing error between requests of a pass)
        t["final.post_norm"] = torch.roll(post, 17, dims=0)
    w = store.write_tensors(dst_dir, s.key, t, s.metadata)
    return w.path


@pytest.mark.parametrize("how", ["shift", "wrong-layer", "misplaced"])
def test_wrong_states_fail_at_almost_every_position(served, tiny_model_dir, tmp_path, how):
    srv, capture = served
    ids = prompts(4)[3]       # 100 tokens, 3 parts
    key = store.sample_key(ids)
    out = SGLangClient(srv.url).generate(ids, PARAMS, f"bad-{how}", **request_fields(key, len(ids), fraction=1.0,
                                                                                      positions=64))
    bad = _corrupt(wait_sample(capture, key), tmp_path / "bad", how)
    checker = FidelityChecker(LMHead.from_model_dir(tiny_model_dir), tmp_path, positions=64)
    try:
        r = checker.check(key, bad, out)
    finally:
        checker.close()
    # in this 4-layer random model layer.2's residual is still close to the final one (23 of 64
    # positions differ); a shift or misplaced rows change almost every argmax. (A partial sum of
    # the last layer's update barely moves this random model's argmax: the H200 run measures it.)
    assert not r.ok and r.mismatches >= (0.25 if how == "wrong-layer" else 0.8) * r.checked, (r.mismatches, r.checked)
    if how == "shift":
        assert r.hints["shift_minus_one"] >= 0.9   # the state of p sits at p + 1


def test_compare_marks_near_ties_within_the_tolerance():
    logits = torch.zeros(3, 10)
    logits[:, 4] = 1.0
    logits[0, 7] = 1.0 - 1e-4     # a near-tie: the server's bf16 logits preferred 7
    logits[1, 7] = 0.2            # far apart: a real mismatch
    diff = compare(logits, [7, 7, 4], [10, 11, 12], tol=0.02)
    assert [(d.pos, d.tie) for d in diff] == [(10, True), (11, False)]
    assert diff[0].margin_std < 0.02 < diff[1].margin_std


def test_a_derived_state_is_allowed_what_rounding_can_change_and_no_more():
    """HS_CAPTURE_FINAL=pre: our norm and the server's fused one may round each element differently
    by one unit in the last place. A disagreement within what that rounding moves is a tie (the GPU
    proof failed such a sample at margin 0.025 std); the same margin on a stored post-norm state is
    not, and a wrong state is far outside the allowance."""
    g = torch.Generator().manual_seed(5)
    H, V = 7168, 64
    head = torch.randn(V, H, generator=g) * 0.02
    ours = (torch.randn(H, generator=g) * 2).to(torch.bfloat16)   # our derived post-norm row
    logits = ours.float() @ head.T
    a, b = logits.topk(2).indices.tolist()
    allow = fidelity.rounding_allowance(ours, head, a, b)
    # the server's row: 2,000 draws of one-ulp differences either way on a random 20% (as measured) or all
    ulp = torch.ldexp(torch.full((H,), torch.finfo(torch.bfloat16).eps), torch.frexp(ours.float()).exponent - 1)
    moves = []
    for density in (0.2, 1.0):
        for _ in range(1000):
            eps = torch.randint(0, 2, (H,), generator=g) * 2 - 1
            eps = eps * (torch.rand(H, generator=g) < density)
            moves.append(abs(float((eps * ulp) @ (head[a] - head[b]))))
    assert max(moves) < allow < 20 * max(moves), (max(moves), allow)   # a bound, not a blanket
    std = float(logits.std())
    assert 0.02 < allow / std < 0.1
    # the top two exactly that far apart (less a hair): the server's rounding could flip them
    head[a] += (allow * 0.99 - float(logits[a] - logits[b])) * ours.float() / float(ours.float().pow(2).sum())
    logits = (ours.float() @ head.T)[None]
    assert int(logits.argmax()) == a and 0.02 < float(logits[0, a] - logits[0, b]) / std
    derived = compare(logits, [b], [7], tol=0.02, derived=(ours[None], head))
    stored = compare(logits, [b], [7], tol=0.02)
    assert [d.tie for d in derived] == [True] and [d.tie for d in stored] == [False]
    assert derived[0].allowance_std == pytest.approx(allow / float(logits.std()), rel=1e-2)
    far = int(logits[0].argsort()[V // 2])  # a token from the middle of the distribution: a wrong state
    (d,) = compare(logits, [far], [7], tol=0.02, derived=(ours[None], head))
    assert not d.tie and d.margin_std > 10 * (0.02 + d.allowance_std)


def test_sampled_fraction_is_stable_and_about_right():
    keys = [store.sample_key([i, i + 1]) for i in range(20000)]
    frac = sum(wants_positions(k, 0.01) for k in keys) / len(keys)
    assert 0.007 < frac < 0.013
    assert [wants_positions(k, 0.01) for k in keys[:500]] == [wants_positions(k, 0.01) for k in keys[:500]]
    assert request_fields(keys[0], 100, fraction=0.0, gaps=0) == {}
    # every sample: the server's best two at its last 16 positions (the logit gaps); a sampled one: 32
    assert request_fields(keys[0], 100, fraction=0.0) == {"return_logprob": True, "logprob_start_len": 84,
                                                          "top_logprobs_num": 2}
    assert request_fields(keys[0], 100, fraction=1.0)["logprob_start_len"] == 68
    assert request_fields(keys[0], 100, fraction=1.0, positions=32) == {
        "return_logprob": True, "logprob_start_len": 68, "top_logprobs_num": 2}


def test_k_consecutive_mismatches_stop_with_a_diagnosis():
    mon = FidelityMonitor(max_consecutive=3)
    good = Check("a" * 32, "last", checked=1)
    bad = Check("b" * 32, "positions", checked=32, mismatches=30, parts=3, hints={"shift_plus_one": 0.95})
    meta = {"sglang_release": "0.5.16", "tp_size": "8"}
    assert mon.observe(good, meta) is None
    assert mon.observe(bad, meta) is None and mon.observe(bad, meta) is None
    assert mon.observe(good, meta) is None      # a pass resets the run
    assert mon.observe(bad, meta) is None and mon.observe(bad, meta) is None
    reason = mon.observe(bad, meta)
    assert reason and "3 samples in a row" in reason and "shifted by one position" in reason
    assert "chunked prefill" in reason       # every failing one had parts > 1, every passing one 1
    st = mon.status()
    assert (st["checked"], st["passed"], st["rejected"], st["consecutive_mismatches"]) == (7, 2, 5, 3)
    # samples checked at once past K: only the one at K asks to stop (the fourth reached the stop first and the
    # run said "4 samples in a row")
    assert mon.observe(bad, meta) is None and mon.status()["consecutive_mismatches"] == 4
    fresh = FidelityMonitor(max_consecutive=1)
    msg = fresh.observe(Check("c" * 32, "last", checked=1, mismatches=1),
                        {"sglang_release": "0.5.9", "tp_size": "8"})
    assert "partial sum" in msg and "not the served model" in msg


def test_dashboard_shows_the_fidelity_counts_and_the_last_rejection():
    from rich.console import Console
    from rich.progress import Progress

    from hs_patch.control.dashboard import render

    mon = FidelityMonitor(max_consecutive=4)
    mon.observe(Check("a" * 32, "last", checked=1), {})
    mon.observe(Check("b" * 32, "positions", checked=32, mismatches=30), {})
    snap = {"run": "r1", "driver": {"state": "running", "samples": {"total": 2, "done": 1},
                                    "fidelity": mon.status()}}
    progress = Progress()
    console = Console(record=True, width=160)
    console.print(render(snap, "gpu-host", progress, progress.add_task("x")))
    text = console.export_text()
    assert "1/2 ok" in text and "1 (1 in a row, stop at 4)" in text
    assert "sample bbbbbbbbbbbb rejected: 30 of 32 positions" in text


def test_rejections_by_the_row_checks_stop_with_their_cause_and_the_dashboard_says_which_plane():
    from rich.console import Console
    from rich.progress import Progress

    from hs_patch.control.dashboard import render

    problem = ("layer.2: the stored rows, normalised with layer 2's input norm, are not what layer 2's attention "
               "read: another layer's state, one tensor-parallel rank's partial sum, or another prompt's rows")
    bad = Check("d" * 32, "last", checked=1, rows={"problems": [problem], "log_norms": {"layer.2": 1.0}})
    assert not bad.ok and bad.mismatches == 0
    mon = FidelityMonitor(max_consecutive=2)
    assert mon.observe(bad, {"sglang_release": "0.5.16", "tp_size": "8"}) is None
    reason = mon.observe(bad, {"sglang_release": "0.5.16", "tp_size": "8"})
    assert reason and "last: layer.2: the stored rows" in reason
    assert "not the fully reduced input of layer i" in reason and "hs-patch verify" in reason
    snap = {"run": "r1", "driver": {"state": "running", "samples": {"total": 2, "done": 0},
                                    "fidelity": mon.status()}}
    progress = Progress()
    console = Console(record=True, width=240)
    console.print(render(snap, "gpu-host", progress, progress.add_task("x")))
    assert "sample dddddddddddd rejected: layer.2: the stored rows" in console.export_text()


def test_a_plane_far_outside_the_runs_own_statistics_is_a_warning_never_a_rejection():
    from hs_patch.host.fidelity import policy

    mon = FidelityMonitor()
    for i in range(policy.OUTLIER_AFTER + 10):
        assert mon.observe(Check(f"{i:032x}", "last", checked=1,
                                 rows={"log_norms": {"layer.30": 2.0 + 0.01 * (i % 5)}}), {}) is None
    odd = Check("e" * 32, "last", checked=1, rows={"log_norms": {"layer.30": 3.0}})
    assert odd.ok and mon.observe(odd, {}) is None
    st = mon.status()
    assert st["warnings"] == 1 and "eeeeeeeeeeee: layer.30" in st["last_warning"] and st["rejected"] == 0
    assert 2.02 < st["planes"]["layer.30"]["mean_log_norm"] < 2.05  # the odd one counted in, not rejected


def test_a_tie_of_the_servers_bf16_logits_is_tolerated_and_a_wrong_state_is_not(tiny_model_dir):
    """The server computes its logits in bf16 and takes their argmax: two logits that round to one
    bf16 value give the lower id, deterministically. Found among random states through the tiny
    model's own head, computed as the stand-in (and SGLang) computes them: a disagreement over
    the 0.02 std tolerance that is such a tie passes; the same margin without the tie does not."""
    from transformers import DeepseekV3ForCausalLM

    head = DeepseekV3ForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.bfloat16).eval().lm_head
    g = torch.Generator().manual_seed(0)
    found = []
    with torch.no_grad():
        for _ in range(40):   # about one tie over 0.02 std in 15,000 states
            states = torch.randn(8000, head.weight.shape[1], generator=g).to(torch.bfloat16)
            served = head(states)                                      # bf16 logits
            ours = states.float() @ head.weight.float().T
            for i in (served.argmax(-1) != ours.argmax(-1)).nonzero().flatten().tolist():
                found.append((ours[i], int(served[i].argmax()), served[i]))
            if any(float(r.max() - r[t]) / float(r.std()) > 0.02 for r, t, _ in found):
                break
    assert found, "no tie among the random states"
    for row, tok, bf16 in found:
        assert bf16[tok] == bf16[int(row.argmax())] and tok < int(row.argmax()), "a tie, lower id first"
        (d,) = compare(row[None], [tok], [9], tol=0.02, logit_dtype=torch.bfloat16)
        assert d.tie and d.margin_std <= 0.02 + d.allowance_std
    row, tok, _ = max(found, key=lambda f: float(f[0].max() - f[0][f[1]]) / float(f[0].std()))
    (plain,) = compare(row[None], [tok], [9], tol=0.02)
    (tied,) = compare(row[None], [tok], [9], tol=0.02, logit_dtype=torch.bfloat16)
    assert plain.margin_std > 0.02 and not plain.tie and tied.tie, (plain, tied)
    far = int(row.argsort()[len(row) // 2])  # a token from the middle: a wrong state's answer
    (d,) = compare(row[None], [far], [9], tol=0.02, logit_dtype=torch.bfloat16)
    assert not d.tie and d.margin_std > 10 * (0.02 + d.allowance_std)
    assert LMHead(head.weight.detach(), torch.ones(head.weight.shape[1]), 1e-6).logit_dtype == torch.bfloat16
