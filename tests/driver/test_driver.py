"""The driver against the stand-in server (real patched forward + capture hook, in this process)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from hs_patch.host.driver import chat, dataset, runstate
from hs_patch.host.driver.client import SGLangClient
from hs_patch.host.driver.run import EXIT_FAILURES, EXIT_OK, Driver
from hs_patch.samples import store
from hs_patch.server import fingerprint
from lab.drive_runs import config, drive, start_standin
from lab.runcheck import assert_complete, final_samples, ledger, write_chats
from lab.sglang_sim import reference
from lab.sample_files import flip_byte

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "data" / "tiny_chat.jsonl"


def test_example_dataset_end_to_end_then_resume(standin, tiny_model_dir, tiny_tokenizer, tmp_path):
    prom = tmp_path / "hs.prom"
    # a raw sample nobody in this run asked for (SGLang's warm-up request, another client)
    foreign = torch.tensor([7, 7, 7], dtype=torch.int64)
    capture = Path(standin.engine.capture.directory)
    w = store.write_sample(capture, store.sample_key(foreign), [store.tensor_bytes("input_ids", foreign)],
                           {"format": store.FORMAT})
    store.Manifest(capture).add(w)
    summary = drive(standin, tiny_model_dir, tmp_path, [EXAMPLE], prometheus=str(prom))
    assert not w.path.exists(), "the end-of-run sweep removes raw samples the run did not ask for"
    s = summary.status["samples"]
    assert summary.exit_code == EXIT_OK and summary.state == "finished"
    assert (s["done"], s["rejected"], s["duplicates"], s["failed"], s["remaining"], s["total"]) == (19, 12, 1, 0, 0, 32)
    records = {r.sample_id: r for r in dataset.read([str(EXAMPLE)]) if isinstance(r, dataset.Record)}
    expected = set(records) - {"tiny_chat.jsonl:26", "tiny_chat.jsonl:27"}  # duplicate of line 1; too long
    got = assert_complete(tmp_path / "samples", Path(standin.engine.capture.directory), expected)

    rejects = {r["line"]: r["reason"] for r in runstate.read_jsonl(tmp_path / "state" / "rejects.jsonl")}
    assert rejects[27] == "too_long" and rejects[14] == "not_utf8" and len(rejects) == 12
    dup = next(e for e in ledger(tmp_path / "state") if e["event"] == "duplicate")
    assert (dup["sample_id"], dup["duplicate_of"]) == ("tiny_chat.jsonl:26", "tiny_chat.jsonl:1")

    # the loss mask and provenance travel with each sample
    for sid in ("tiny_chat.jsonl:7", "tiny_chat.jsonl:22"):  # OpenAI multi-turn, ShareGPT multi-turn
        enc = chat.encode_chat(tiny_tokenizer, records[sid].messages)
        assert got[sid].input_ids.tolist() == enc.input_ids
        assert got[sid].tensors["loss_mask"].tolist() == enc.loss_mask
    assert got["tiny_chat.jsonl:23"].tensors["loss_mask"].tolist() == records["tiny_chat.jsonl:23"].loss_mask
    assert got["tiny_chat.jsonl:24"].metadata["loss_mask"] == "all"
    meta = got["tiny_chat.jsonl:7"].metadata
    assert (meta["run"], meta["source_id"], meta["input_format"], meta["loss_mask"]) == (
        "t", "oai-multi", "messages", "assistant")

    # the states are exactly what the model computes, also for a prompt prefilled in chunks
    long = got["tiny_chat.jsonl:25"]
    assert int(long.metadata["parts"]) >= 7  # 300 tokens, at most 48 per pass
    ref = reference(standin.engine.model, long.input_ids.tolist())
    for i in standin.engine.capture.layers:
        assert torch.equal(long.plane(f"layer.{i}"), ref.layer_in[i])
    assert torch.equal(long.plane("final.pre_norm"), ref.pre_norm)

    status = json.loads((tmp_path / "state" / "status.json").read_text())
    assert status["state"] == "finished" and status["samples"]["done"] == 19 and status["tokens"]["done_now"] > 0
    assert status["bytes_written"] == sum(p.stat().st_size for p in (tmp_path / "samples").glob("*.safetensors"))
    assert status["shipping"] == {"shipped": 0, "pending": 19}
    assert 'hs_extract_samples_done{run="t"} 19.0' in prom.read_text()

    # resume: everything is done and verified, nothing is sent again
    again = drive(standin, tiny_model_dir, tmp_path, [EXAMPLE])
    assert again.exit_code == EXIT_OK and again.status["samples"]["done_before"] == 19
    events = ledger(tmp_path / "state")
    last_start = max(i for i, e in enumerate(events) if e["event"] == "run_start")
    assert not [e for e in events[last_start:] if e["event"] == "sent"]
    assert_complete(tmp_path / "samples", Path(standin.engine.capture.directory), expected)

    with pytest.raises(runstate.RunError, match="max_tokens: was 512, now 256"):
        drive(standin, tiny_model_dir, tmp_path, [EXAMPLE], max_tokens=256)


def test_resume_redoes_exactly_what_is_not_verified(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    ids = write_chats(data, 10)
    assert drive(standin, tiny_model_dir, tmp_path, [data]).exit_code == EXIT_OK
    samples, state = tmp_path / "samples", tmp_path / "state"
    final = final_samples(samples)
    truncated, corrupted, deleted, shipped = (final[i] for i in ids[:4])
    with open(truncated.path, "r+b") as f:
        f.truncate(truncated.path.stat().st_size // 2)
    flip_byte(corrupted.path, -1)
    deleted_ids = deleted.input_ids.tolist()
    deleted.path.unlink()
    entry = store.read_manifest(samples)[shipped.key]
    shipped.path.unlink()  # what the shipper does after the destination verified the copy
    store.Manifest(samples).remove(shipped.key, reason="shipped")
    with open(state / "shipped.jsonl", "a") as f:
        f.write(json.dumps({"op": "shipped", "key": shipped.key, "sha256": entry["sha256"]}) + "\n")
    # a raw sample of this run left in the capture dir (the driver was killed before finalizing it)
    SGLangClient(standin.url).generate(deleted_ids, {"max_new_tokens": 1}, "hs-t-leftover")
    capture = Path(standin.engine.capture.directory)
    deadline = time.monotonic() + 10
    while deleted.key not in store.read_manifest(capture) and time.monotonic() < deadline:
        time.sleep(0.05)

    summary = drive(standin, tiny_model_dir, tmp_path, [data])
    s = summary.status["samples"]
    assert summary.exit_code == EXIT_OK and (s["done_before"], s["done_now"]) == (7, 3)
    events = ledger(state)
    last_start = max(i for i, e in enumerate(events) if e["event"] == "run_start")
    redone = {e["sample_id"] for e in events[last_start:] if e["event"] == "done"}
    assert redone == {truncated.metadata["sample_id"], corrupted.metadata["sample_id"], deleted.metadata["sample_id"]}
    start = [e for e in ledger(state) if e["event"] == "run_start"][-1]
    assert start["done_shipped"] == 1
    assert sorted(d.split(": ", 1)[1].split(" ")[0] for d in start["discarded"]) == ["No", "sha256", "size"]
    assert any(e["event"] == "raw_removed" and e["key"] == deleted.key for e in ledger(state))
    assert_complete(samples, capture, set(ids) - {shipped.metadata["sample_id"]})


def test_regeneration_replaces_the_answers_with_the_models_own(standin, tiny_model_dir, tiny_tokenizer, tmp_path):
    data = tmp_path / "chats.jsonl"
    ids = write_chats(data, 3)
    summary = drive(standin, tiny_model_dir, tmp_path, [data], regenerate=True, regen_max_new_tokens=12)
    assert summary.exit_code == EXIT_OK
    got = assert_complete(tmp_path / "samples", Path(standin.engine.capture.directory), ids)
    question = [r for r in dataset.read([str(data)])][0].messages[0]
    prompt = chat.generation_prompt(tiny_tokenizer, [question])
    answer = SGLangClient(standin.url).generate(prompt, {"max_new_tokens": 12}, "nocap-expected")["output_ids"]
    s = got[ids[0]]
    # the prompt as sent and the answer as the server generated it, not its text rendered again
    assert s.input_ids.tolist() == prompt + answer
    assert s.tensors["loss_mask"].tolist() == [0] * len(prompt) + [1] * len(answer)
    assert (s.metadata["regenerated"], s.metadata["loss_mask"]) == ("1", "generated")
    assert (s.metadata["regen_answers"], s.metadata["regen_left_out"]) == ("1", "0")
    assert len([e for e in ledger(tmp_path / "state") if e["event"] == "regen_done"]) == 3
    built = [e for e in ledger(tmp_path / "state") if e["event"] == "regen_sample"]
    assert [(e["kept"], e["dropped"]) for e in built] == [(1, 0)] * 3
    assert summary.status["regenerate"] == {"lines": 3, "answers_kept": 3, "answers_left_out": 0}
    # a run begun by a driver that built its samples from the answers' text: its resume is refused, not mixed
    run_json = tmp_path / "state" / "run.json"
    old = json.loads(run_json.read_text())
    del old["params"]["regen_samples"]
    run_json.write_text(json.dumps(old))
    with pytest.raises(runstate.RunError, match="(?s)regen_samples: was None, now \"the server's token ids\".*"
                       "regenerated by an older hs-extract.*start a new run"):
        drive(standin, tiny_model_dir, tmp_path, [data], regenerate=True, regen_max_new_tokens=12)


def test_regeneration_does_not_generate_a_turn_whose_prompt_reaches_the_limit(standin, tiny_model_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    write_chats(data, 2)   # questions of ~30 words: their prompts alone pass 16 tokens
    summary = drive(standin, tiny_model_dir, tmp_path, [data], regenerate=True, regen_max_new_tokens=4,
                    max_tokens=16)
    events = ledger(tmp_path / "state")
    assert not [e for e in events if e["event"] in ("regen_turn", "done")], "a turn over the limit was generated"
    rejects = [json.loads(x) for x in (tmp_path / "state" / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in rejects] == ["too_long"] * 2 and "assistant turn 1" in rejects[0]["detail"]
    assert summary.status["samples"]["rejected"] == 2


def test_regeneration_prompts_captured_by_0_5_9_are_removed(tiny_model_dir, tmp_path):
    """SGLang 0.5.9 has no request ids in the forward batch: the nocap- prompts are captured too."""
    srv = start_standin(tiny_model_dir, tmp_path / "capture", "0.5.9")
    try:
        data = tmp_path / "chats.jsonl"
        ids = write_chats(data, 3)
        summary = drive(srv, tiny_model_dir, tmp_path, [data], regenerate=True, regen_max_new_tokens=6)
        assert summary.exit_code == EXIT_OK
        removed = [e for e in ledger(tmp_path / "state") if e["event"] == "raw_removed"]
        assert any(e["reason"].startswith("regeneration prompt") for e in removed)
        assert_complete(tmp_path / "samples", tmp_path / "capture", ids)
    finally:
        srv.close()


def test_back_pressure_pauses_at_the_high_water_mark(standin, tiny_model_dir, tmp_path):
    """Fill the dump filesystem (a 20 MB quota here) past 80%: sending pauses until it drops below 60%."""
    data = tmp_path / "chats.jsonl"
    ids = write_chats(data, 24, words=60)
    samples, state, capacity = tmp_path / "samples", tmp_path / "state", 20_000_000
    ballast = tmp_path / "samples" / "ballast.bin"

    def usage(path: str) -> float:  # statvfs of a 20 MB filesystem, as the writer's renames and removals go on
        total = 0
        for p in Path(path).rglob("*"):
            try:
                total += p.stat().st_size if p.is_file() else 0
            except FileNotFoundError:
                pass
        return 100.0 * total / capacity

    driver = Driver(config(standin.url, standin.engine.capture.directory, tiny_model_dir, tmp_path, [data],
                           concurrency=2), usage=usage)
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(s=driver.run()), daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(e["event"] == "done" for e in _events(state)) < 4:
            time.sleep(0.05)
        ballast.write_bytes(b"\0" * int(0.85 * capacity))  # the dump dir reaches the high-water mark
        while time.monotonic() < deadline and not any(e["event"] == "pause" for e in _events(state)):
            time.sleep(0.05)
        time.sleep(1.0)
        events = _events(state)
        at = next(i for i, e in enumerate(events) if e["event"] == "pause")
        assert sum(e["event"] == "sent" for e in events[at:]) <= 2, "at most the samples in flight pass the mark"
        assert json.loads((state / "status.json").read_text())["state"] == "paused"
        sent_while_paused = sum(e["event"] == "sent" for e in _events(state))
        time.sleep(0.5)
        assert sum(e["event"] == "sent" for e in _events(state)) == sent_while_paused
        assert sent_while_paused < len(ids)
    finally:
        ballast.unlink(missing_ok=True)  # shipped away: below the low-water mark
        t.join(60)
        if t.is_alive():
            driver.request_stop("test timed out")
            t.join(10)
    assert result["s"].exit_code == EXIT_OK
    assert any(e["event"] == "resume" for e in _events(state))
    assert_complete(samples, Path(standin.engine.capture.directory), ids)


def _events(state: Path) -> list[dict]:
    return runstate.read_jsonl(state / "ledger.jsonl")


class NoCapture(BaseHTTPRequestHandler):
    """A server that answers like SGLang but writes no samples (capture off or another HS_CAPTURE_DIR);
    with ``capture_checks`` set it captures the driver's start-up check alone, into that directory."""

    radix = False
    capture_checks: "Path | None" = None
    fingerprints = True  # False: its hook is older than the fidelity check (no fingerprints in its samples)

    def log_message(self, *a):
        pass

    def _json(self, obj):
        data = json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        self._json({"version": "0.5.16", "disable_radix_cache": not NoCapture.radix})

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if NoCapture.capture_checks is not None and "-check-" in body["rid"]:
            ids = torch.tensor(body["input_ids"], dtype=torch.int64)
            meta = {"format": "hs_patch.sample/2"}
            if NoCapture.fingerprints:
                meta = {"format": store.FORMAT, fingerprint.META: fingerprint.describe([])}
            w = store.write_tensors(NoCapture.capture_checks, store.sample_key(ids), {"input_ids": ids}, meta)
            store.Manifest(NoCapture.capture_checks).add(w)
        self._json({"text": "", "output_ids": [1], "meta_info": {"id": "x", "prompt_tokens": 1}})


@pytest.fixture
def nocapture():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), NoCapture)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    NoCapture.radix, NoCapture.capture_checks, NoCapture.fingerprints = False, None, True


def test_a_server_whose_hook_writes_no_fingerprints_is_refused_at_the_start(nocapture, tiny_model_dir, tmp_path):
    """Its samples could not be checked plane by plane: refused within seconds, saying what to do."""
    data = tmp_path / "chats.jsonl"
    write_chats(data, 1)
    NoCapture.capture_checks, NoCapture.fingerprints = tmp_path / "capture", False
    cfg = config(nocapture, str(tmp_path / "capture"), tiny_model_dir, tmp_path, [data])
    with pytest.raises(runstate.RunError, match="stores no fingerprints .*Run hs-patch apply with this version and "
                                                "restart the server"):
        Driver(cfg).run()
    assert not list((tmp_path / "capture").glob("*.safetensors")), "the probe's sample is removed all the same"


def test_consecutive_failures_stop_the_run_cleanly(nocapture, tiny_model_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    write_chats(data, 30)
    NoCapture.capture_checks = tmp_path / "capture"  # the start-up check passes, then nothing is captured
    cfg = config(nocapture, str(tmp_path / "capture"), tiny_model_dir, tmp_path, [data], raw_timeout=0.3,
                 max_consecutive_failures=3, concurrency=1)
    summary = Driver(cfg).run()
    assert summary.exit_code == EXIT_FAILURES and summary.state == "stopped"
    assert summary.status["samples"]["failed"] == 3 and "3 consecutive failures" in summary.message
    failed = [e for e in _events(tmp_path / "state") if e["event"] == "failed"]
    assert failed[0]["stage"] == "wait_raw" and "HS_CAPTURE_DIR" in failed[0]["error"]
    assert _events(tmp_path / "state")[-1]["event"] == "run_end"


def test_samples_failing_at_once_are_counted_up_to_the_limit_and_the_rest_abandoned(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    """Samples waiting at the same time fail at the same time (a server that stopped capturing, a loaded host): the
    run counts exactly --max-consecutive-failures of them, the one that reaches it stops the run, and the others
    are abandoned (redone on resume), never counted past the limit (CI once saw 5 failed of a limit of 3)."""
    cfg = config("http://127.0.0.1:9", str(tmp_path / "capture"), tiny_model_dir, tmp_path, [],
                 max_consecutive_failures=3)
    driver = Driver(cfg)
    driver.state_dir.mkdir(parents=True)
    driver.ledger = runstate.Ledger(driver.state_dir / runstate.LEDGER)
    write = runstate.Ledger.write
    # a slow ledger: unguarded, all eight would be past the stop check before the third stopped the run
    monkeypatch.setattr(runstate.Ledger, "write", lambda self, *a, **kw: (time.sleep(0.05), write(self, *a, **kw)))
    together = threading.Barrier(8)

    def fail(i: int) -> None:
        together.wait()
        driver._failed(dataset.Record(f"c.jsonl:{i}", "c.jsonl", i, "messages"), None, "wait_raw", "nothing captured")

    threads = [threading.Thread(target=fail, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    events = [e["event"] for e in _events(driver.state_dir)]
    assert driver.status.c.failed == 3 and len(driver.failures) == 3 and driver.stop.is_set()
    assert driver.exit_code == EXIT_FAILURES and "3 consecutive failures" in driver.stop_reason
    assert sorted(events) == ["abandoned"] * 5 + ["failed"] * 3


def test_a_state_dir_that_fills_up_stops_the_run_instead_of_hanging_it(standin, tiny_model_dir, tmp_path,
                                                                          monkeypatch):
    """Every ledger write failing (ENOSPC: the state dir's filesystem full) made each worker's failure bookkeeping
    raise in turn: the workers died one by one and the feeder waited for them for ever, SIGTERM included. Now the
    run stops, saying where to free space, and the process ends."""
    import errno

    data = tmp_path / "chats.jsonl"
    write_chats(data, 200)  # more lines than the work queue holds (2 x the 36 workers)
    write, writes = runstate.Ledger.write, []

    def fills_up(self, event, **fields):
        writes.append(event)
        if len(writes) > 12:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, event, **fields)

    monkeypatch.setattr(runstate.Ledger, "write", fills_up)
    ended: dict = {}

    def run() -> None:
        try:
            ended["summary"] = drive(standin, tiny_model_dir, tmp_path, [data], concurrency=4)
        except OSError as e:  # the end's own records cannot be written either: hs-extract drive says so, exit 1
            ended["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "the driver hung on a full state dir"
    said = ended.get("error") or ended.get("summary").message
    assert "No space left on device" in str(said), ended


def test_a_server_with_the_radix_cache_is_refused(nocapture, tiny_model_dir, tmp_path):
    NoCapture.radix = True
    data = tmp_path / "chats.jsonl"
    write_chats(data, 1)
    cfg = config(nocapture, str(tmp_path / "capture"), tiny_model_dir, tmp_path, [data])
    with pytest.raises(runstate.RunError, match="--disable-radix-cache"):
        Driver(cfg).run()


def test_one_driver_per_run_and_per_capture_dir(tiny_model_dir, tmp_path):
    data = tmp_path / "chats.jsonl"
    write_chats(data, 1)
    (tmp_path / "capture").mkdir()
    fd = runstate.take_lock(tmp_path / "capture" / ".hs-driver.lock", "capture dir")
    try:
        cfg = config("http://127.0.0.1:9", str(tmp_path / "capture"), tiny_model_dir, tmp_path, [data])
        with pytest.raises(runstate.RunError, match=f"in use by pid {os.getpid()}"):
            Driver(cfg).run()
    finally:
        os.close(fd)
    shutil.rmtree(tmp_path / "capture")


def test_two_runs_cannot_share_a_samples_dir(standin, tiny_model_dir, tmp_path):
    """A samples dir has one owner at a time: a second driver on it is refused at start."""
    (tmp_path / "samples").mkdir()
    held = runstate.take_lock(tmp_path / "samples" / ".hs-samples.lock", "run first")
    try:
        with pytest.raises(runstate.RunError, match="samples dir .* is in use"):
            drive(standin, tiny_model_dir, tmp_path, [EXAMPLE], run="other", state_dir=str(tmp_path / "s2"))
    finally:
        os.close(held)


def test_samples_are_written_once_and_adopted_by_rename(standin, tiny_model_dir, tmp_path, monkeypatch):
    """The driver never reads or rewrites a sample's states: each final file is the very
    inode the hook wrote, with the loss mask the driver's intent gave it."""
    from hs_patch.host.driver import adopt as adopt_mod
    from hs_patch.samples import intent

    inodes = {}
    real = adopt_mod.adopt

    def spy(watcher, entry, samples_dir, **kw):
        inodes[entry["key"]] = os.stat(watcher.directory / entry["file"]).st_ino
        return real(watcher, entry, samples_dir, **kw)

    monkeypatch.setattr("hs_patch.host.driver.sample_steps.adopt", spy)
    data = tmp_path / "d.jsonl"
    write_chats(data, 6, words=60)  # longer than the stand-in's 48-token chunks: several passes each
    summary = drive(standin, tiny_model_dir, tmp_path, [data])
    assert summary.exit_code == EXIT_OK
    entries = store.read_manifest(tmp_path / "samples")
    assert len(entries) == 6 and set(entries) == set(inodes)
    for key, entry in entries.items():
        assert os.stat(tmp_path / "samples" / entry["file"]).st_ino == inodes[key]
    assert any(e["parts"] > 1 for e in entries.values()), "chunked prompts are adopted the same way"
    assert not list((Path(standin.engine.capture.directory) / intent.DIR).glob("*.json")), "intents are cleaned up"


def test_a_sample_written_without_its_intent_fails_with_the_reason(standin, tiny_model_dir, tmp_path, monkeypatch):
    """If the server cannot use the driver's intent (here: it is unreadable), the sample is
    written without a loss mask; the driver fails it, naming errors.jsonl, and never adopts it."""
    from hs_patch.samples import intent

    real = intent.write
    monkeypatch.setattr(intent, "write", lambda d, key, mask, meta: real(d, key, mask[:-1], meta))  # wrong length
    data = tmp_path / "d.jsonl"
    write_chats(data, 2)
    summary = drive(standin, tiny_model_dir, tmp_path, [data], max_consecutive_failures=5)
    assert summary.status["samples"]["failed"] == 2 and summary.status["samples"]["done"] == 0
    failed = [e for e in ledger(tmp_path / "state") if e["event"] == "failed"]
    assert all(e["stage"] == "adopt" and "without the driver's intent" in e["error"] for e in failed)
    assert store.read_manifest(tmp_path / "samples") == {}
