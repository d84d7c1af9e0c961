"""``hs-extract accept``: a drafter's accept length against an EAGLE-3 server, and the greedy check.

The stand-in server reports EAGLE-3's per-request fields the way SGLang 0.5.16 does
(tests/lab/standin_spec.py: its drafter proposes the right token with a set probability, so the
accept length is known in advance; ``standin_flip_at`` makes it emit a different token)."""

from __future__ import annotations

import json
import shutil
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
        "never": Speculative(str(_draft(tmp, "never")), 3, 1, 4, accuracy=0.0),
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
    rc, s, _ = _accept_err(servers, name, tiny_model_dir, data, capsys, *extra)
    return rc, s


def _accept_err(servers, name, tiny_model_dir, data, capsys, *extra) -> tuple[int, dict, str]:
    rc = main(["accept", "--server", servers[name].url, "--data", str(data), "--model", str(tiny_model_dir),
               "--max-new-tokens", "12", "--ignore-eos", "--json", *extra])
    cap = capsys.readouterr()
    out = cap.out.strip().splitlines()
    return rc, json.loads(out[-1]) if out else {}, cap.err


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


def test_both_accept_lengths_acceptance_by_position_output_digests_and_the_cap(
        servers, tiny_model_dir, heldout, tmp_path, capsys):
    """The gauge (1 + correct drafts / passes: SGLang's avg_spec_accept_length, no prefill token) beside the
    accept length that counts the prefill's token; acceptance by draft position from the per-request
    histograms; every output's sha256 kept (the ids with --output-ids); answers at the cap counted."""
    import hashlib

    report = tmp_path / "r.json"
    rc, s = _accept(servers, "good", tiny_model_dir, heldout, capsys, "--out", str(report), "--output-ids")
    assert rc == 0
    per = json.loads(report.read_text())["by_conversation"]
    correct = sum(c["correct_drafts"] for c in per)
    assert s["correct_drafts"] == correct and s["accept_length_gauge"] == round(1 + correct / s["verify_ct"], 4)
    # the prefill's token: one more token than passes x (1 + correct) per conversation, none cut at a stop here
    assert s["completion_tokens"] == s["verify_ct"] + correct + len(per)
    assert s["accept_length_gauge"] < s["accept_length"]
    for c in per:
        assert sum(c["histogram"]) == c["verify_ct"] and sum(k * n for k, n in enumerate(c["histogram"])) == \
            c["correct_drafts"]
        assert len(c["output_ids"]) == 12 and c["finish"] == "length"
        assert c["output_sha256"] == hashlib.sha256(",".join(map(str, c["output_ids"])).encode()).hexdigest()
    pos = s["by_position"]
    hist = [sum(c["histogram"][k] if k < len(c["histogram"]) else 0 for c in per) for k in range(4)]
    assert pos["histogram"][:4] == hist[:len(pos["histogram"])] and pos["passes"] == s["verify_ct"]
    assert len(pos["accepted_at"]) == 3, "positions 1..draft tokens - 1"
    assert pos["accepted_at"][0] == round(sum(hist[1:]) / s["verify_ct"], 5)
    assert pos["accepted_at"] == sorted(pos["accepted_at"], reverse=True)
    assert s["at_cap"] == 6 and s["finish"] == {"length": 6}, "--ignore-eos: every answer ran to the cap"
    rc, s2 = _accept(servers, "good", tiny_model_dir, heldout, capsys, "--out", str(report))
    assert "output_ids" not in json.loads(report.read_text())["by_conversation"][0], "ids only with --output-ids"
    assert [c["output_sha256"] for c in json.loads(report.read_text())["by_conversation"]] == \
        [c["output_sha256"] for c in per], "the same greedy outputs, the same digests"

    rc, never = _accept(servers, "never", tiny_model_dir, heldout, capsys)
    assert never["accept_length_gauge"] == 1.0 and never["accept_length"] == round(72 / 66, 4)
    assert never["by_position"]["accepted_at"] == [0.0, 0.0, 0.0]
    _, poor = _accept(servers, "poor", tiny_model_dir, heldout, capsys)
    assert poor["by_position"]["accepted_at"][0] < pos["accepted_at"][0]

    rc = main(["accept", "--server", servers["good"].url, "--data", str(heldout), "--model", str(tiny_model_dir),
               "--max-new-tokens", "12", "--ignore-eos"])
    text = capsys.readouterr().out
    assert rc == 0 and "the prefill's first token counted" in text and "SGLang's gauge avg_spec_accept_length" in text
    assert "accepted at draft position 1..: " in text and "answers at the --max-new-tokens cap (12): 6/6" in text


def test_older_and_newer_metric_names_are_read_and_metrics_that_do_not_add_up_fail(
        servers, tiny_model_dir, heldout, capsys):
    """SGLang 0.5.9 names the correct drafts spec_accept_token_num and the histogram spec_accept_histogram
    (0.5.16: spec_num_correct_drafts, spec_correct_drafts_histogram); a server without a histogram gives no
    positions; a histogram whose passes are not spec_verify_ct fails the conversation."""
    def rename(meta: dict, keep: dict) -> dict:
        drop = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_correct_drafts_histogram",
                "spec_accept_histogram")
        return {**{k: v for k, v in meta.items() if k not in drop}, **keep}

    def proxied(edit):
        def post(n, body):
            status, data = _Front.forward(servers["good"].url + "/generate", body)
            out = json.loads(data)
            out["meta_info"] = edit(out["meta_info"])
            return status, json.dumps(out).encode()
        return _Front(servers["good"].url, post)

    _, new = _accept(servers, "good", tiny_model_dir, heldout, capsys)
    for edit, gauge, positions in (
            (lambda m: rename(m, {"spec_accept_token_num": m["spec_num_correct_drafts"],
                                  "spec_accept_histogram": m["spec_correct_drafts_histogram"]}), True, True),
            (lambda m: rename(m, {"spec_num_correct_drafts": m["spec_num_correct_drafts"]}), True, False),
            (lambda m: rename(m, {}), False, False)):
        front = proxied(edit)
        try:
            rc, s = _accept({**servers, "x": front}, "x", tiny_model_dir, heldout, capsys)
        finally:
            front.close()
        assert rc == 0 and s["accept_length"] == new["accept_length"]
        assert s["accept_length_gauge"] == (new["accept_length_gauge"] if gauge else None)
        assert s["by_position"] == (new["by_position"] if positions else None)
    front = proxied(lambda m: {**m, "spec_correct_drafts_histogram": [m["spec_verify_ct"] + 1]})
    try:
        rc, s, err = _accept_err({**servers, "x": front}, "x", tiny_model_dir, heldout, capsys)
    finally:
        front.close()
    assert rc == 1 and s["failed"] == 6 and "do not add up" in s["first_error"]


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
    rc = main(["accept", "--server", servers["good"].url, "--plain", servers["plain"].url, "--data", str(heldout),
               "--model", str(tiny_model_dir), "--temperature", "1"])
    assert rc == 1 and "needs --temperature 0" in capsys.readouterr().err


class _Front:
    """An HTTP front: GET (server info) from ``info_url``, each POST /generate answered by ``post(n, body)``
    (n counts from 0) as (status, body); ``forward`` sends one to a server as it is."""

    def __init__(self, info_url: str, post):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        front, self.posted = self, threading.Event()
        self.count, self.lock = 0, threading.Lock()

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, status: int, data: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer(*_Front.forward(info_url + self.path, None))

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with front.lock:
                    n, front.count = front.count, front.count + 1
                front.posted.set()
                answer = post(n, body)
                if answer is None:   # hang up without an answer, as a dead server's proxy does
                    self.close_connection = True
                    return
                self._answer(*answer)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @staticmethod
    def forward(url: str, body) -> tuple[int, bytes]:
        import urllib.request

        req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"},
                                     method="POST" if body is not None else "GET")
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_greedy_check_that_could_not_compare_does_not_pass(servers, tiny_model_dir, heldout, capsys):
    """--plain answering nothing (dead, overloaded, refusing) is no proof that greedy output is unchanged."""
    dead = _Front(servers["plain"].url, lambda n, body: (400, b'{"error": {"message": "refused"}}'))
    try:
        rc, s, err = _accept_err(servers, "good", tiny_model_dir, heldout, capsys, "--plain", dead.url)
    finally:
        dead.close()
    assert s["greedy"]["errors"] == 6 and s["greedy"]["compared"] == 0
    assert rc == 1, "a check that compared nothing must not exit 0"
    assert "greedy check is incomplete" in err and "refused" in err


def test_answers_without_verify_passes_never_count_as_accepted_tokens(servers, tiny_model_dir, heldout, capsys):
    """Every other answer from a server without speculative decoding (no spec_verify_ct): its tokens
    must not be added to the accepted ones with no verify pass (an accept length above draft tokens)."""
    mixed = _Front(servers["good"].url, lambda n, body: _Front.forward(
        servers["plain" if n % 2 else "good"].url + "/generate", body))
    try:
        rc, s, err = _accept_err({**servers, "mixed": mixed}, "mixed", tiny_model_dir, heldout, capsys,
                                 "--concurrency", "1")
    finally:
        mixed.close()
    assert s["accept_length"] <= 4.0 and s["failed"] == 3 and "without spec_verify_ct" in s["first_error"]
    assert rc == 1, "a number over 3 of the 6 conversations asked for is not the measurement asked for"
    assert "incomplete: 3 of 6 conversations failed" in err and "without spec_verify_ct" in err
    rc, s, err = _accept_err(servers, "good", tiny_model_dir, heldout, capsys, "--max-new-tokens", "1")
    assert rc == 1 and s["accept_length"] is None, "one token each: no verify pass, nothing measured"
    assert "no answer had a verify pass" in err


def test_a_missing_data_file_is_an_error_not_a_traceback(servers, tiny_model_dir, tmp_path, capsys):
    rc = main(["accept", "--server", servers["good"].url, "--data", str(tmp_path / "nope.jsonl"),
               "--model", str(tiny_model_dir)])
    assert rc == 1 and "nope.jsonl cannot be read" in capsys.readouterr().err


def test_an_out_file_that_cannot_be_written_is_refused_before_measuring(servers, tiny_model_dir, heldout, tmp_path,
                                                                        capsys):
    """Found only after the whole measurement (an hour at 1,000 chats), it lost the measurement."""
    before = servers["good"].engine.passes
    rc = main(["accept", "--server", servers["good"].url, "--data", str(heldout), "--model", str(tiny_model_dir),
               "--out", str(tmp_path / "no-such-dir" / "report.json")])
    assert rc == 1 and "no-such-dir does not exist or is not writable" in capsys.readouterr().err
    assert servers["good"].engine.passes == before, "nothing was sent"


def test_ctrl_c_stops_at_once_with_requests_in_flight(servers, tiny_model_dir, heldout, tmp_path):
    """A slow server: Ctrl-C must not wait up to --timeout for the requests in flight."""
    import os
    import signal
    import subprocess
    import sys
    import time

    slow = _Front(servers["good"].url, lambda n, body: (time.sleep(60), (503, b"{}"))[1])
    try:
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        # Ctrl-C's default for the child, however the suite was started: a shell without job control (CI's
        # `.ci/run &`, setsid) starts its background commands with SIGINT ignored, which children inherit
        # and Python then leaves ignored (the test timed out there; a `timeout` wrapper had hidden it)
        p = subprocess.Popen([sys.executable, "-m", "hs_patch.host.extract_cli", "accept", "--server", slow.url,
                              "--data", str(heldout), "--model", str(tiny_model_dir), "--out", str(tmp_path / "r.json")],
                             env=env, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert slow.posted.wait(60), "no request reached the server"
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        rc = p.wait(30)
        err = p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
        slow.close()
    assert time.monotonic() - t0 < 10 and rc == 130 and "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


def test_a_server_that_stops_answering_stops_the_run(servers, tiny_model_dir, heldout, capsys, monkeypatch):
    """Each conversation retries an unreachable server for about a minute: without a stop, 1,000
    held-out chats at --concurrency 16 would take an hour to fail."""
    from hs_patch.host.driver import client

    monkeypatch.setattr(client.RetryPolicy, "delay", lambda self, attempt: 0.0)
    gone = _Front(servers["good"].url, lambda n, body: None)
    try:
        rc, s, err = _accept_err({**servers, "gone": gone}, "gone", tiny_model_dir, heldout, capsys,
                                 "--concurrency", "1", "--max-consecutive-failures", "2")
    finally:
        gone.close()
    attempts = 1 + client.RetryPolicy().retries
    assert rc == 1 and gone.count == 2 * attempts, "two conversations tried, the other four never sent"
    assert s["failed"] == 6 and "2 conversations in a row" in s["stopped"] and "is the server up?" in err


def test_a_plain_server_of_another_model_path_is_named_before_any_difference(servers, tiny_model_dir, heldout,
                                                                              tmp_path, capsys):
    """--plain serving other weights would make every difference look like the drafter's: the two servers'
    model paths are compared and a difference said (a warning: the same weights may sit at two paths)."""
    copy = tmp_path / "same-weights-elsewhere"
    shutil.copytree(tiny_model_dir, copy)
    other = StandinServer(Engine(str(copy), None, chunked_prefill_size=256)).start()
    try:
        rc, s, err = _accept_err(servers, "good", tiny_model_dir, heldout, capsys, "--plain", other.url)
    finally:
        other.close()
    assert f"--plain serves {copy}" in err and "the same weights" in err
    assert rc == 0 and s["greedy"]["mismatch"] == 0, "the same weights: the check itself is unchanged"
    rc, s, err = _accept_err(servers, "good", tiny_model_dir, heldout, capsys, "--plain", servers["plain"].url)
    assert "warning" not in err
