"""``hs-extract accept``: a drafter's accept length against an EAGLE-3 server, and the greedy check.

The stand-in server reports EAGLE-3's per-request fields the way SGLang 0.5.16 does
(tests/lab/standin_spec.py: its drafter proposes the right token with a set probability, so the
accept length is known in advance; ``standin_flip_at`` makes it emit a different token)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hs_patch.host.extract_cli import main
from lab.standin_engine import Engine
from lab.standin_server import StandinServer
from lab.standin_spec import Speculative


def _draft(tmp: Path, name: str, **cfg) -> Path:
    d = tmp / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], **cfg}))
    return d


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("drafts")
    made = {
        "plain": None,
        "good": Speculative(str(_draft(tmp, "good")), 3, 1, 4, accuracy=0.9),
        "poor": Speculative(str(_draft(tmp, "poor")), 3, 1, 4, accuracy=0.2),
        "flip": Speculative(str(_draft(tmp, "flip")), 3, 1, 4, accuracy=0.9, flip_at=2),
    }
    srv = {k: StandinServer(Engine(str(tiny_model_dir), None, chunked_prefill_size=256, speculative=v)).start()
           for k, v in made.items()}
    yield srv
    for s in srv.values():
        s.close()


@pytest.fixture
def heldout(tmp_path):
    p = tmp_path / "heldout.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"write a function number {i}"}]} for i in range(5)]
    rows.append({"messages": [{"role": "user", "content": "add two numbers"},
                              {"role": "assistant", "content": "def add(a, b): return a + b"}]})
    rows.append({"messages": [{"role": "assistant", "content": "no question before me"}]})
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n")
    return p


def _accept(servers, name, tiny_model_dir, data, capsys, *extra) -> tuple[int, dict]:
    rc = main(["accept", "--server", servers[name].url, "--data", str(data), "--model", str(tiny_model_dir),
               "--max-new-tokens", "12", "--ignore-eos", "--json", *extra])
    out = capsys.readouterr().out.strip().splitlines()
    return rc, json.loads(out[-1]) if out else {}


def test_accept_length_is_completion_over_verify_passes_and_greedy_output_is_unchanged(
        servers, tiny_model_dir, heldout, tmp_path, capsys):
    report = tmp_path / "report.json"
    rc, s = _accept(servers, "good", tiny_model_dir, heldout, capsys, "--plain", servers["plain"].url,
                    "--out", str(report))
    assert rc == 0
    assert s["measured"] == 6 and s["rejected_lines"] == 2, "a user-only chat is a prompt; assistant-first and bad JSON are not"
    assert s["completion_tokens"] == 6 * 12 and s["verify_ct"] > 0
    assert s["accept_length"] == round(s["completion_tokens"] / s["verify_ct"], 4)
    assert s["server_settings"] == {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3,
                                    "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4,
                                    "speculative_draft_model_path": servers["good"].engine.spec.draft_path}
    assert s["greedy"] == {"compared": 6, "identical": 6, "differing": 0, "near_tie": 0, "mismatch": 0, "errors": 0}
    full = json.loads(report.read_text())
    per = full["by_conversation"]
    assert len(per) == 6 and sum(c["verify_ct"] for c in per) == s["verify_ct"]
    assert all(c["accept_length"] == round(c["completion_tokens"] / c["verify_ct"], 4) for c in per)
    assert {r["reason"] for r in full["rejects"]} == {"assistant_first", "bad_json"}
    # the prompt of a chat with an answer is the turns before that answer
    assert per[5]["prompt_tokens"] < per[5]["prompt_tokens"] + 12


def test_a_better_drafter_measures_a_longer_accept_length(servers, tiny_model_dir, heldout, capsys):
    _, good = _accept(servers, "good", tiny_model_dir, heldout, capsys)
    _, poor = _accept(servers, "poor", tiny_model_dir, heldout, capsys)
    assert 1.0 <= poor["accept_length"] < good["accept_length"] <= 4.0


def test_a_changed_greedy_output_is_found_and_judged_by_the_plain_servers_margin(
        servers, tiny_model_dir, heldout, tmp_path, capsys):
    report = tmp_path / "r.json"
    rc, s = _accept(servers, "flip", tiny_model_dir, heldout, capsys, "--plain", servers["plain"].url,
                    "--tie-margin", "0", "--out", str(report))
    assert rc == 3, "a difference beyond the margin fails the check"
    diffs = [c["greedy"] for c in json.loads(report.read_text())["by_conversation"]]
    assert all(d["at"] == 2 and d["spec_token"] != d["plain_token"] for d in diffs)
    assert all(d["margin_nats"] is not None and d["margin_nats"] >= 0 for d in diffs)
    # the tiny random model has exact bf16 ties: a margin of 0 is a near-tie even at --tie-margin 0
    assert s["greedy"]["differing"] == 6 and s["greedy"]["mismatch"] == sum(d["margin_nats"] > 0 for d in diffs) >= 1
    rc, s = _accept(servers, "flip", tiny_model_dir, heldout, capsys, "--plain", servers["plain"].url,
                    "--tie-margin", "1000")
    assert rc == 0 and s["greedy"]["near_tie"] == 6 and s["greedy"]["mismatch"] == 0


def test_wrong_servers_and_bad_input_are_refused_with_what_to_do(servers, tiny_model_dir, heldout, tmp_path, capsys):
    rc = main(["accept", "--server", servers["plain"].url, "--data", str(heldout), "--model", str(tiny_model_dir)])
    assert rc == 1 and "does not run EAGLE-3" in capsys.readouterr().err
    rc = main(["accept", "--server", servers["good"].url, "--plain", servers["good"].url, "--data", str(heldout),
               "--model", str(tiny_model_dir)])
    assert rc == 1 and "runs speculative decoding itself" in capsys.readouterr().err
    empty = tmp_path / "bad.jsonl"
    empty.write_text("{}\n")
    rc = main(["accept", "--server", servers["good"].url, "--data", str(empty), "--model", str(tiny_model_dir)])
    assert rc == 1 and "no usable conversation" in capsys.readouterr().err
    rc = main(["accept", "--server", servers["good"].url, "--data", str(heldout), "--model", str(tiny_model_dir),
               "--chat-template-kwargs", "{nope"])
    assert rc == 1 and "is not JSON" in capsys.readouterr().err
    rc = main(["accept", "--server", "http://127.0.0.1:9", "--data", str(heldout), "--model", str(tiny_model_dir)])
    assert rc == 1 and "failed after" in capsys.readouterr().err
