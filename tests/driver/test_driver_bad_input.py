"""Hostile and unusual input against the driver on the stand-in server (issue 13): each run goes on
with a clear reason per line, or is refused at the start saying what to fix; nothing is lost and
nothing is accepted that should not be."""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch

from hs_patch.host import extract_cli
from hs_patch.host.driver import runstate
from hs_patch.host.driver.client import SGLangClient
from hs_patch.host.driver.run import EXIT_ERROR, EXIT_OK, Driver
from hs_patch.host.shipping import link as ship_link, shipper
from hs_patch.names import RunNameError
from hs_patch.samples import store
from lab.runcheck import assert_complete, ledger
from lab.sglang_sim import reference
from lab.standin_server import Engine, StandinServer
from lab.drive_runs import config, start_standin

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "Paris is the capital."}]}


def chat(i: int, words: int = 6) -> str:
    text = " ".join(["fox", "dog", "hidden", "states", "draft"][(i + k) % 5] for k in range(words))
    return json.dumps({"messages": [{"role": "user", "content": f"Question {i}: {text}?"},
                                    {"role": "assistant", "content": f"Answer {i}: {text}."}]})


@pytest.fixture(scope="module")
def standin(tiny_model_dir, tmp_path_factory):
    srv = start_standin(tiny_model_dir, tmp_path_factory.mktemp("capture"), "0.5.16")
    yield srv
    srv.close()


def run_driver(srv: StandinServer, model_dir: Path, tmp_path: Path, data: list[Path], **kw):
    cfg = config(srv.url, srv.engine.capture.directory, model_dir, tmp_path, data, **kw)
    return Driver(cfg).run()


def rejects(tmp_path: Path) -> dict[int, tuple[str, str]]:
    return {r["line"]: (r["reason"], r["detail"]) for r in runstate.read_jsonl(tmp_path / "state" / "rejects.jsonl")}


def sent_since_last_start(state: Path) -> list[dict]:
    events = ledger(state)
    last = max(i for i, e in enumerate(events) if e["event"] == "run_start")
    return [e for e in events[last:] if e["event"] == "sent"]


# ---------------------------------------------------------------------------- lines that used to stop a run


def test_hostile_lines_are_rejected_and_every_good_line_after_them_is_done(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "hostile.jsonl"
    big_content = {"messages": [{"role": "user", "content": "fox " * 150_000}, {"role": "assistant", "content": "a"}]}
    lines = [
        chat(1),                                                        # 1 good
        "[" * 100_000 + "]" * 100_000,                                  # 2 nested too deeply for json
        json.dumps({"messages": [{"role": "user", "content": "caf\ud800"}, {"role": "assistant", "content": "x"}]}),
        '{"messages": [{"role": "user", "content": "' + "y" * 3_000_000 + '"}]}',  # 4 over the line limit
        json.dumps(big_content),                                        # 5 600K characters: too long, untokenized
        json.dumps({"messages": [{"role": "assistant", "content": "Hello! Ask me anything."},
                                 {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}),
        "",                                                             # 7 blank: counted, numbered
        chat(8),                                                        # 8 good
    ]
    data.write_text("\n".join(lines) + "\n")
    t0 = time.monotonic()
    summary = run_driver(standin, tiny_model_dir, tmp_path, [data], max_line_chars=1_000_000, concurrency=2)
    seconds = time.monotonic() - t0
    assert summary.exit_code == EXIT_OK, summary.message
    got = rejects(tmp_path)
    assert {k: v[0] for k, v in got.items()} == {2: "bad_json", 3: "invalid_text", 4: "too_long", 5: "too_long"}
    assert "nested too deeply" in got[2][1] and "lone surrogate U+D800" in got[3][1]
    assert "--max-line-chars" in got[4][1] and "not tokenized" in got[5][1]
    s = summary.status["samples"]
    assert (s["done"], s["rejected"], s["blank"], s["total"]) == (3, 4, 1, 7)
    done = assert_complete(tmp_path / "samples", Path(standin.engine.capture.directory),
                           {"hostile.jsonl:1", "hostile.jsonl:6", "hostile.jsonl:8"})
    first = done["hostile.jsonl:6"]  # the assistant-first chat: its opening turn is trained on
    assert first.tensors["loss_mask"][:3].tolist() == [0, 0, 0] and int(first.tensors["loss_mask"].sum()) > 5
    assert seconds < 60
    # a resume: the same rejects (once each), nothing sent again
    again = run_driver(standin, tiny_model_dir, tmp_path, [data], max_line_chars=1_000_000)
    assert again.exit_code == EXIT_OK and not sent_since_last_start(tmp_path / "state")
    assert len(runstate.read_jsonl(tmp_path / "state" / "rejects.jsonl")) == 4


def test_a_line_longer_than_the_servers_context_is_rejected_as_too_long(tiny_model_dir, tmp_path):
    srv = StandinServer(Engine(str(tiny_model_dir), str(tmp_path / "capture"), context_length=100)).start()
    try:
        info = SGLangClient(srv.url).server_info()
        assert (info["max_req_input_len"], info["context_length"]) == (94, 100)  # SGLang's fields, SGLang's rule
        data = tmp_path / "ctx.jsonl"
        data.write_text(chat(1) + "\n" + chat(2, words=60) + "\n" + chat(3) + "\n")
        summary = run_driver(srv, tiny_model_dir, tmp_path, [data], max_tokens=512)
        assert summary.exit_code == EXIT_OK, summary.message
        reason, detail = rejects(tmp_path)[2]
        assert reason == "too_long" and "the server's limit of 93 tokens" in detail
        start = next(e for e in ledger(tmp_path / "state") if e["event"] == "run_start")
        assert start["max_tokens_effective"] == 93
        assert_complete(tmp_path / "samples", tmp_path / "capture", {"ctx.jsonl:1", "ctx.jsonl:3"})
    finally:
        srv.close()


def test_input_ids_0_is_never_swept_as_sglangs_health_probe_while_in_flight(tiny_model_dir, tmp_path, monkeypatch):
    """SGLang 0.5.9 captures its own /health prefill of [0] (no request ids in the forward batch);
    a dataset sample of exactly [0] in flight meanwhile is kept and done."""
    srv = start_standin(tiny_model_dir, tmp_path / "capture", "0.5.9")
    real = SGLangClient.generate

    def generate_then_health_check(self, ids, params, rid, context=None, **kw):
        out = real(self, ids, params, rid, context, **kw)
        if ids == [0]:  # SGLang's health probe of the same tokens lands while the sample is in flight,
            SGLangClient(srv.url).health_generate()
            time.sleep(1.0)  # and the driver's sweeps run meanwhile (every status interval, 0.2 s)
        return out

    monkeypatch.setattr(SGLangClient, "generate", generate_then_health_check)
    try:
        data = tmp_path / "zero.jsonl"
        data.write_text(chat(1) + '\n{"input_ids": [0]}\n' + chat(3) + "\n")
        summary = run_driver(srv, tiny_model_dir, tmp_path, [data], concurrency=1)
        assert summary.exit_code == EXIT_OK, summary.message
        got = assert_complete(tmp_path / "samples", tmp_path / "capture", {f"zero.jsonl:{i}" for i in (1, 2, 3)})
        ref = reference(srv.engine.model, [0])
        assert torch.equal(got["zero.jsonl:2"].plane("final.pre_norm"), ref.pre_norm)
    finally:
        srv.close()


@pytest.mark.parametrize("content,reason", [
    ("\n\n  \n\n", "4 blank"),
    ('{"prompt": "a", "completion": "b"}\n' * 3, "3 unknown_format"),
    ('\ufeff{"messages": []}\r\n{"messages": [{"role": "user", "content": "q"}]}\r\n', "1 empty"),
])
def test_a_run_that_extracts_nothing_from_a_non_empty_input_fails_with_the_reason(
        standin, tiny_model_dir, tmp_path, content, reason):
    data = tmp_path / "d.jsonl"
    data.write_text(content)
    argv = ["drive", "--run", "nothing", "--data", str(data), "--model", str(tiny_model_dir), "--server", standin.url,
            "--capture-dir", standin.engine.capture.directory, "--state-dir", str(tmp_path / "state"),
            "--samples-dir", str(tmp_path / "samples"), "--raw-timeout", "10", "--server-wait", "10"]
    rc = extract_cli.main(argv)
    end = ledger(tmp_path / "state")[-1]
    assert rc == EXIT_ERROR and end["event"] == "run_end" and end["exit_code"] == rc and end["state"] == "failed"
    assert "nothing was extracted" in end["message"]
    detail = " ".join(d for _, d in rejects(tmp_path).values()) + end["message"]
    assert reason in detail
    assert not (tmp_path / "state" / runstate.DONE).exists()


def test_a_directory_an_empty_file_and_a_json_array_are_refused_at_the_start(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "dir").mkdir()
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "array.json").write_text(json.dumps([CHAT, CHAT]))
    (tmp_path / "pretty.json").write_text("\n  [\n" + json.dumps(CHAT) + ",\n" + json.dumps(CHAT) + "\n]\n")
    for path, message in ((tmp_path / "dir", "is a directory"), (tmp_path / "empty.jsonl", "is empty"),
                          (tmp_path / "array.json", "is a JSON array, not JSON lines"),
                          (tmp_path / "pretty.json", "convert it with jq -c '.[]'")):
        rc = extract_cli.main(["drive", "--run", "r", "--data", str(path), "--model", str(tiny_model_dir),
                               "--state-dir", str(tmp_path / "s"), "--samples-dir", str(tmp_path / "d"),
                               "--capture-dir", str(tmp_path / "c")])
        assert rc == EXIT_ERROR and message in capsys.readouterr().err
    assert not (tmp_path / "s" / runstate.RUN_JSON).exists()


# ---------------------------------------------------------------------------- refused at the start, nothing pinned


def test_a_model_that_is_not_there_is_refused_before_the_run_pins_anything(standin, tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "c.jsonl"
    data.write_text(chat(1) + "\n")
    base = ["drive", "--run", "m", "--data", str(data), "--server", standin.url, "--capture-dir",
            standin.engine.capture.directory, "--state-dir", str(tmp_path / "state"), "--samples-dir",
            str(tmp_path / "samples"), "--raw-timeout", "10", "--server-wait", "10"]
    assert extract_cli.main(base + ["--model", "/nonexistent"]) == EXIT_ERROR
    assert "--model /nonexistent does not exist" in capsys.readouterr().err
    assert not (tmp_path / "state" / runstate.RUN_JSON).exists()
    # a model directory without a tokenizer: refused after run.json was written, but the run sent nothing,
    # so the right model is accepted next time; the ledger's exit code is the process's
    (tmp_path / "empty-model").mkdir()
    assert extract_cli.main(base + ["--model", str(tmp_path / "empty-model")]) == EXIT_ERROR
    assert "cannot load the tokenizer" in capsys.readouterr().err
    assert ledger(tmp_path / "state")[-1]["exit_code"] == EXIT_ERROR
    assert extract_cli.main(base + ["--model", str(tiny_model_dir)]) == EXIT_OK
    assert json.loads((tmp_path / "state" / runstate.RUN_JSON).read_text())["params"]["model"] == str(tiny_model_dir)
    # once a sample was sent, the parameters are pinned
    assert extract_cli.main(base + ["--model", str(tiny_model_dir), "--max-tokens", "100"]) == EXIT_ERROR
    assert "max_tokens: was 32768, now 100" in capsys.readouterr().err


def test_a_wrong_capture_dir_is_refused_at_the_start_saying_what_to_set(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text(chat(1) + "\n")
    wrong = tmp_path / "elsewhere"
    t0 = time.monotonic()
    with pytest.raises(runstate.RunError, match=f"no capture hook wrote into --capture-dir {wrong}.*HS_CAPTURE_DIR"):
        Driver(config(standin.url, str(wrong), tiny_model_dir, tmp_path, [data], raw_timeout=120)).run()
    assert time.monotonic() - t0 < 15
    # a status file left there by an earlier server: it names where that server writes
    shutil.copy(Path(standin.engine.capture.directory) / "hook_status.json", wrong / "hook_status.json")
    os.utime(wrong / "hook_status.json", (1, 1))
    doc = json.loads((wrong / "hook_status.json").read_text())
    (wrong / "hook_status.json").write_text(json.dumps(dict(doc, time=time.time() - 3600)))
    with pytest.raises(runstate.RunError, match="says it writes into .*: give --capture-dir"):
        Driver(config(standin.url, str(wrong), tiny_model_dir, tmp_path, [data], raw_timeout=120)).run()
    assert not [e for e in ledger(tmp_path / "state") if e["event"] == "sent"], "a dataset sample was sent"
    # what reached the server's real capture dir: the probes alone (two per check, a few tokens each), which
    # the next run there sweeps as not requested by it
    left = store.read_manifest(standin.engine.capture.directory)
    assert len(left) <= 4 and all(e["tokens"] < 64 for e in left.values())
    assert run_driver(standin, tiny_model_dir, tmp_path / "right", [data]).exit_code == EXIT_OK
    assert_complete(tmp_path / "right" / "samples", Path(standin.engine.capture.directory), {"c.jsonl:1"})


def test_a_skip_prefix_that_matches_the_drivers_requests_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HS_CAPTURE_SKIP_RID_PREFIX", "hs-")
    srv = start_standin(tiny_model_dir, tmp_path / "capture", "0.5.16")
    try:
        data = tmp_path / "c.jsonl"
        data.write_text(chat(1) + "\n")
        t0 = time.monotonic()
        with pytest.raises(runstate.RunError, match="HS_CAPTURE_SKIP_RID_PREFIX='hs-' matches the driver's request ids"):
            Driver(config(srv.url, str(tmp_path / "capture"), tiny_model_dir, tmp_path, [data], raw_timeout=120)).run()
        assert time.monotonic() - t0 < 20
    finally:
        srv.close()


def test_a_hook_status_that_names_its_skip_prefix_or_directory_is_checked_directly(tmp_path):
    from hs_patch.host.driver import capture_check

    status = {"pid": 1, "time": time.time(), "config": {"skip_rid_prefix": "hs-", "directory": str(tmp_path)}}
    assert "HS_CAPTURE_SKIP_RID_PREFIX='hs-' matches" in capture_check.skip_prefix_problem(status, "hs-r-", tmp_path)
    status["config"]["skip_rid_prefix"] = "nocap-"
    assert capture_check.skip_prefix_problem(status, "hs-r-", tmp_path) is None
    assert "give --capture-dir" in capture_check.skip_prefix_problem(status, "hs-r-", tmp_path / "other")


# ---------------------------------------------------------------------------- security


@pytest.mark.parametrize("bad", ["../x", "../../../../ABS", "", ".", "a/b", "..", "-x"])
def test_run_names_that_leave_the_runs_root_are_refused_by_the_cli(tmp_path, bad, tiny_model_dir):
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit, match="--run: run name"):
            extract_cli.main(["drive", f"--run={bad}", "--data", "x.jsonl", "--model", str(tiny_model_dir)])
        with pytest.raises(RunNameError):
            config("http://127.0.0.1:9", str(tmp_path / "c"), tiny_model_dir, tmp_path, [], run=bad)
    finally:
        os.chdir(cwd)
    assert not list(tmp_path.iterdir()), "something was created for a refused run name"


def test_every_path_the_cli_creates_is_owner_only_and_no_credential_is_written(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text(chat(1) + "\n" + '{"messages": []}\n')
    url = standin.url.replace("http://", "http://alice:pw-s3cret@") + "/?token=tok-s3cret"
    old = os.umask(0o022)  # as a user's shell
    try:
        rc = extract_cli.main(["drive", "--run", "perm", "--data", str(data), "--model", str(tiny_model_dir),
                               "--server", url, "--capture-dir", standin.engine.capture.directory,
                               "--state-dir", str(tmp_path / "state"), "--samples-dir", str(tmp_path / "out" / "samples"),
                               "--prometheus", str(tmp_path / "state" / "hs.prom"), "--raw-timeout", "10"])
    finally:
        os.umask(old)
    assert rc == EXIT_OK
    created = [p for root in (tmp_path / "state", tmp_path / "out") for p in [root, *root.rglob("*")]]
    assert len(created) > 8
    loose = [f"{p} {stat.filemode(p.stat().st_mode)}" for p in created if p.stat().st_mode & 0o077]
    assert not loose, f"readable by others: {loose}"
    lock = Path(standin.engine.capture.directory) / ".hs-driver.lock"
    assert not lock.stat().st_mode & 0o077
    for p in created:
        if p.is_file():
            assert b"s3cret" not in p.read_bytes(), p
    start = next(e for e in ledger(tmp_path / "state") if e["event"] == "run_start")
    assert start["params"]["server"] == f"http://***@127.0.0.1:{standin.port}?token=***"


# ---------------------------------------------------------------------------- a GPU-host reboot


def test_after_a_reboot_samples_at_the_destination_are_not_redone(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "c.jsonl"
    data.write_text("\n".join(chat(i) for i in range(4)) + "\n")
    samples, state, dest = tmp_path / "samples", tmp_path / "state", tmp_path / "dest"
    ship = shipper.ShipConfig(samples, state, ship_link.parse_dest(str(dest)))
    assert run_driver(standin, tiny_model_dir, tmp_path, [data]).exit_code == EXIT_OK
    assert shipper.ship(ship) == shipper.EXIT_OK
    at_dest = {p.name: p.stat().st_ino for p in (dest / "samples").iterdir()}
    assert len(at_dest) == 4

    shutil.rmtree(samples)  # the reboot empties /dev/shm; the state dir survives
    summary = run_driver(standin, tiny_model_dir, tmp_path, [data])
    assert summary.exit_code == EXIT_OK and summary.status["samples"]["done_before"] == 4
    assert not sent_since_last_start(state)

    shutil.rmtree(samples)  # worse: the state's shipping records are lost too
    (state / runstate.SHIPPED).unlink()
    follow = shipper.ShipConfig(samples, state, ship_link.parse_dest(str(dest)), follow=True)
    (state / runstate.DONE).touch()  # (so that --follow ends; the driver removes it when it starts)
    assert shipper.ship(follow) == shipper.EXIT_OK  # the shipper starts first: it reads the destination's manifest
    summary = run_driver(standin, tiny_model_dir, tmp_path, [data])
    assert summary.exit_code == EXIT_OK and summary.status["samples"]["done_before"] == 4
    assert not sent_since_last_start(state)
    assert {p.name: p.stat().st_ino for p in (dest / "samples").iterdir()} == at_dest, "replaced at the destination"
