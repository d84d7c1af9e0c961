"""The GPU proof's extraction phase, rehearsed on the CPU against stand-in servers.

CI has no GPU, so tests/gpu/ runs only by hand; this runs its extraction code path (two
servers, three rows in rotating order, a real ``hs-extract drive`` subprocess per round)
with the stand-in server as the launcher, so a broken script is found here, not on the
lent machine. It checks the mechanics, not the speeds.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import common  # noqa: E402
import extract  # noqa: E402


def free_port_block(n: int) -> int:
    """The first of ``n`` ports free now, below the kernel's ephemeral range: a port the kernel hands out for
    another process's connection (the other test worker's) can be taken between this check and the server's
    bind, which is what happened to a closed-loop server picked from that range ("Address already in use")."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(10000, max(10001, low - n))
        if all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} free ports in a row below {low}")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.fixture
def standin_site(release_sources, tmp_path, monkeypatch) -> Path:
    """A copy of 0.5.16's sources to patch, the stand-in as the scripts' server, their record under tmp_path."""
    site = tmp_path / "site"
    shutil.copytree(release_sources["0.5.16"], site)
    monkeypatch.setattr(common.Server, "LAUNCHER", [sys.executable, str(ROOT / "tests/lab/standin_server.py"),
                                                   "--accept-sglang-flags", "--release", "0.5.16", "--threads", "1"])
    common.REC.out, common.REC.logs = tmp_path / "out", tmp_path / "logs"
    common.REC.out.mkdir()
    common.REC.logs.mkdir()
    return site


@pytest.mark.slow
def test_extraction_phase_runs_end_to_end_on_standins(standin_site, tiny_model_dir, tmp_path):
    a = argparse.Namespace(site=str(standin_site), work=str(tmp_path / "work"), dump_root=str(tmp_path / "dumps"),
                           prompts=5, tokens=40, long_prompts=1, long_tokens=150, concurrency=3, chunk=64, reps=1,
                           port=free_port_block(4) - 1, mem_fraction=0.3, tp_size=1,
                           warmup_prompts=2, round_offset=1)
    res = extract.extraction(a, str(tiny_model_dir), "cpu")
    assert [len(res[r]["tok_s"]) for r in extract.ROWS] == [1, 1, 1]
    assert res["order"] == [["driver", "pristine", "capture"]]  # round 1, two places on: a second call's round
    runs = res["driver"]["runs"]
    assert all(run["exit_code"] == 0 and run["samples_clean"] for run in runs)
    assert [run["done"] for run in runs] == [2, 5]  # the shorter warm-up round, then a measured one
    assert set(res["ratios"]) == {"capture/pristine", "driver/pristine"}
    assert res["hook_status"]["errors"] == 0 and res["hook_status"]["with_intent"] > 0
    extract.summarize_extraction("extract_cpu", res)
    assert all(run["first_request_s"] > 0 and run["startup"]["tokenizer_s"] >= 0 for run in runs)


def test_startup_phase_runs_the_bench_against_the_capturing_server(standin_site, tiny_model_dir, tmp_path):
    """Issue #36's start-up on the GPU host, rehearsed: a capturing server started as the GPU phase starts SGLang,
    then bench/driver_startup.py --server against it, before and after (here both this checkout), each model's
    tokenizer both ways (its own, and as remote code), the fidelity check on (the model has weights)."""
    import startup

    a = argparse.Namespace(site=str(standin_site), work=str(tmp_path / "work"), dump_root=str(tmp_path / "dumps"),
                           chunk=64, port=free_port_block(4) - 1, mem_fraction=0.3, tp_size=1,
                           startup_code=str(ROOT), startup_reps=1, startup_prompts="1", startup_models="fast,remote",
                           startup_tokenizer_cache="cold",
                           out=str(tmp_path / "out"))
    res = startup.startup(a, str(tiny_model_dir), "cpu")
    runs = res["runs"]
    # each run is in --out as it ends: what a call cut by its time limit brings back (the GPU call of 2026-12-07
    # lost every row when it was cut, the bench's output held in memory)
    assert [r for r in startup.read_jsonl(tmp_path / "out" / "startup-cpu.stdout") if "rep" in r] == runs
    assert {(r["code"], r["model"]) for r in runs} == {(c, m) for c in ("before", "after") for m in ("fast", "remote")}
    assert all(r["samples"] == 1 and r["first_request_s"] > 0 and r["process_s"] >= r["first_request_s"]
               for r in runs)
    assert all(r["startup"]["capture_check_s"] >= 0 for r in runs), "this checkout's start-up steps, both 'codes'"
    startup.summarize_startup("startup_cpu", res)


@pytest.mark.slow
def test_tp_phase_runs_end_to_end_and_catches_a_server_that_is_not_tp(standin_site, tiny_model_dir, tmp_path):
    """The TP phase's mechanics on CPU stand-ins. The stand-in ignores --tp-size, so its "TP=2" server is
    TP=1: planes, files and top-1 agree, and the rank and metadata checks must say it was not TP=2."""
    import tp_compare

    a = argparse.Namespace(site=str(standin_site), work=str(tmp_path / "work"), dump_root=str(tmp_path / "dumps"),
                           port=free_port_block(1), mem_fraction=0.3, tp_size=2, tp_chunk=64,
                           tp_lengths="40,150,7,90", layers=3, envelope_factor=4.0)
    res = tp_compare.tp_compare(a, str(tiny_model_dir), "cpu")
    assert res["planes_ok"] and all(t["rel_tpN_vs_tp1_max"] == 0.0 for t in res["planes"]), res["planes"]
    assert [t["plane"] for t in res["planes"]] == ["layer.0", "layer.1", "layer.2", "final.pre_norm",
                                                   "final.post_norm"]
    # the envelope is measured, not assumed; layer.0 is the embedding, exact in both dtypes (bf16 weights)
    assert [t["bf16_envelope_max"] > 0 for t in res["planes"]] == [False, True, True, True, True], res["planes"]
    assert res["top1"]["ok"] and res["top1"]["positions"] == 40 + 150 + 7 + 90
    f = res["files"]
    assert (f["prompts_in_manifest"], f["inspect_clean"]) == (4, True) and f["sample_files"] == f["manifest_entries"]
    assert f["metadata_tp"] == [("1", "0")] and not f["ok"], "samples written at TP=1 must not pass as TP=2"
    assert res["ranks"] == {"capturing": [(0, 1)], "silent": [], "ok": False}
    assert not res["ok"]
    tp_compare.summarize_tp("cpu", res)


@pytest.mark.slow
def test_sabotage_phase_rejects_every_case_on_a_standin_started_as_the_gpu_phase_starts_sglang(standin_site,
                                                                                                 tiny_model_dir,
                                                                                                 tmp_path):
    """The one-call GPU phase of issue #25, rehearsed: the stand-in server is started the way the phase
    starts SGLang (tests/gpu/sabotage_site first on its PYTHONPATH, HS_TEST_SABOTAGE=1), so the
    sabotage is installed inside the server process, and every case must come back rejected with the
    clean samples passing."""
    import sabotage

    a = argparse.Namespace(site=str(standin_site), work=str(tmp_path / "work"), dump_root=str(tmp_path / "dumps"),
                           port=free_port_block(1), mem_fraction=0.3, tp_size=1, sabotage_long=480)
    res = sabotage.sabotage(a, str(tiny_model_dir), "cpu")  # raises unless the servers installed the sabotage
    assert res["all_clean_pass"] and len(res["clean"]) == len(sabotage.CASES) + 2, res["clean"]
    assert res["all_cases_rejected"], {c: (r["problems"], r["gap_mismatches"]) for c, r in res["cases"].items()}
    assert all(c["chunks"] >= 2 for c in res["cases"].values()), "rows of every chunk were checked"
    assert 0 < res["clean_worst_chunk_ratio"] < 1 and 0 < res["clean_gap_worst_of_tolerance"] < 1
    assert res["gpu_cost"] == {}
    sabotage.summarize_sabotage("sabotage_cpu", res)


@pytest.mark.slow
def test_sweep_phase_runs_every_depth_end_to_end_on_standins(standin_site, tmp_path):
    """Issue #22's rate sweep, rehearsed: two depths, each with its pristine and capturing server started as
    the GPU phase starts SGLang (dummy weights asked for; the stand-in loads the tiny model's), the three
    rows in an order that rotates with the depth, and the driver without the fidelity check (dummy weights
    have no LM head to read). Run as the GPU session runs it (issue #36): calls of the same command on one
    machine, each continuing the record the last one kept in --work, and one stopped by its time limit
    before a depth it could not finish."""
    import sweep
    from lab.tiny_model import make_tiny_model_dir

    a = argparse.Namespace(site=str(standin_site), work=str(tmp_path / "work"), dump_root=str(tmp_path / "dumps"),
                           prompts=4, tokens=40, long_prompts=1, long_tokens=150, concurrency=2, chunk=64, reps=1,
                           port=free_port_block(4) - 1, mem_fraction=0.3, tp_size=1, warmup_prompts=2,
                           round_offset=0, sweep_layers="4", sweep_hidden=64, sweep_weights=False,
                           sweep_env="HS_CAPTURE_SLOTS=4", call_seconds=0, capture_mem_fraction=0,
                           writer_profile=True)
    models = {n: str(make_tiny_model_dir(tmp_path / f"model-l{n}", layers=n)) for n in (4, 16)}
    first = sweep.sweep(a, "cpu", model_for=models.get)
    assert list(first["runs"]) == ["4"] and "stopped" not in first
    a.call_seconds = 1  # the next call has no time left: it starts no server and says how to go on
    a.sweep_layers = "4,16"
    cut = sweep.sweep(a, "cpu", model_for=models.get)
    assert "16" in cut["stopped"] and "same command again" in cut["stopped"]
    sweep.summarize_sweep("sweep_cut", cut)  # says NOT DONE
    partial = json.loads(json.dumps(cut))
    partial["runs"]["4"].pop("ratios")  # a depth cut between its rounds: no medians yet
    sweep.summarize_sweep("sweep_partial", partial)
    a.call_seconds = 0
    res = sweep.sweep(a, "cpu", model_for=models.get)  # continues: 4 is measured, 16 is run
    assert res["calls"] == 3 and "stopped" not in res
    runs = res["runs"]
    assert list(runs) == ["4", "16"]  # 4: the shallow depth that measures the writer's ceiling
    assert [r["order"] for r in runs.values()] == [[["pristine", "capture", "driver"]],
                                                   [["capture", "driver", "pristine"]]]
    assert [r["prompts"] for r in runs.values()] == [8, 2], "prompts x 8 / depth, at least concurrency"
    assert [r["planes"] for r in runs.values()] == [4, 5], "4 layers: SGLang's ids 2, 2, 1 captured once each"
    for r in runs.values():
        assert all(len(r[row]["tok_s"]) == 1 for row in extract.ROWS)
        assert all(d["exit_code"] == 0 and d["samples_clean"] for d in r["driver"]["runs"])
        assert r["hook_status"]["errors"] == 0 and r["engine_GBps_of_states"] > 0
        assert r["capture_env"] == {"HS_CAPTURE_SLOTS": "4"}
        waits = [r[row]["hook_waits"] for row in ("capture", "driver")]  # each row's own, once its samples are in
        assert all(len(w) == 1 and w[0]["complete"] and w[0]["waits"] >= 0 for w in waits), waits
        assert len(r["capture"]["tail_s"]) == 1 and r["capture"]["tail_s"][0] >= 0
        (lp,) = r["capture"]["last_pass"]  # the tail split: the writer's last pass of the row
        assert lp["samples"] >= 1 and lp["written_s"] >= 0 and lp["published_s"] >= 0, lp
        assert lp["landed_after_response_s"] < r["capture"]["tail_s"][0] + 1, lp
        cpu = {row: r[row]["server_cpu_s_per_GB"] for row in extract.ROWS}
        assert all(len(v) == 1 and v[0] > 0 for v in cpu.values()), cpu  # each row's server process group, /proc
        # the capturing process's threads, the writer's told apart by the ids hook_status.json gives (the tiny
        # model's writes take less than a clock tick: the stand-in's torch threads, "other", take the time here)
        (threads,) = r["capture"]["writer_threads_cpu_s_per_GB"]
        assert {"coordinator", "writers", "scheduler", "other"} <= set(threads), threads
        assert all(v >= 0 for t in threads.values() for v in t.values()) and threads["other"]["user"] > 0, threads
        assert r["timing"]["server_start_s"] > 0 and r["timing"]["round_s"] > 0
        # --writer-profile: one more capture row, not measured, py-spy's where there is one (none here)
        assert r["capture"]["profile"] and "writers" in r["capture"]["profile_threads_cpu_s_per_GB"]
        assert len(r["capture"]["tok_s"]) == 1
    logs = sorted((tmp_path / "logs").glob("server-sw-*.log"))
    assert len(logs) == 4 and all("--load-format dummy" in p.read_text() for p in logs), "dummy weights asked for"
    assert all("host staging (4 x " in p.read_text() for p in logs if p.name.endswith("-capture.log")), "--sweep-env"
    sweep.summarize_sweep("sweep_cpu", res)


def test_py_spy_stacks_are_told_apart_by_thread_and_what_they_were_doing(tmp_path):
    """py-spy 0.4's raw output with --threads (seen on the dev VM against the stand-in's writer): each stack rooted
    at ``thread (TID): NAME``; idle waits apart from the busy samples' shares."""
    import proc_cpu

    raw = tmp_path / "raw.txt"
    raw.write_text(
        "thread (100): MainThread;serve (x.py:1);poll (libc.so.6) 7\n"
        "thread (101): hs_patch-write_0;Thread.run (threading.py:982);_worker (concurrent/futures/thread.py:81);"
        "0x7f (libc.so.6) 90\n"
        "thread (101): hs_patch-write_0;_worker (concurrent/futures/thread.py:83);"
        "write_temp (hs_patch/samples/store.py:289);"
        "_range_sha256 (hs_patch/samples/files.py:255);sha256_block_data_order_shaext (libcrypto.so.3) 6\n"
        "thread (102): hs_patch-write_1;write_temp (hs_patch/samples/store.py:289);"
        "pwrite_all (hs_patch/samples/files.py:124);"
        "__libc_pwrite64 (libc.so.6) 2\n"
        "thread (103): hs_patch-hash_0;_range_sha256 (hs_patch/samples/files.py:255);sha256_update (libcrypto.so.3) 4\n"
        "thread (104): hs_patch-writer;Writer._coordinate (hs_patch/server/writer.py:150) 1\n")
    got = proc_cpu.hottest_frames(raw, pid=100)
    assert got["writers"][0] == ["idle", 90, round(90 / 98, 3)]
    assert got["writers"][1] == ["_range_sha256 (hs_patch/samples/files.py:255) > sha256_block_data_order_shaext "
                                 "(libcrypto.so.3)", 6, 0.75]
    assert got["writers"][2][2] == 0.25 and set(got) == {"scheduler", "writers", "hashers", "coordinator"}
    assert got["scheduler"] == [["serve (x.py:1) > poll (libc.so.6)", 7, 1.0]]


def test_a_call_of_the_documented_length_starts_a_depth_on_a_fresh_machine_and_later():
    """--call-seconds 520 (bench/RESULTS.md section 11, the next GPU session): a depth starts when both servers, the
    warm-up and one measured round fit; what is not timed yet is estimated from the record's other depths, else
    defaults that let the first depth of a fresh machine start (a too careful estimate would stop every call before
    any depth)."""
    import sweep

    start, rnd = sweep._estimates({"runs": {}}, {})
    assert 2 * start + 1.5 * rnd < 520 - 60  # the call's set-up before its first depth: patch, copies, models
    timed = {"runs": {"2": {"timing": {"server_start_s": 150.0, "round_s": 45.0}}, "4": {"timing": {}}}}
    assert sweep._estimates(timed, {}) == (150.0, 45.0)  # a depth not run yet: the machine's own timings
    assert sweep._estimates(timed, {"server_start_s": 70.0, "round_s": 40.0}) == (70.0, 40.0)


def test_sweep_env_refuses_what_would_change_the_measured_rate():
    import sweep

    assert sweep.capture_env(" HS_CAPTURE_SLOTS=4, HS_CAPTURE_WRITERS=12 ") == {"HS_CAPTURE_SLOTS": "4",
                                                                               "HS_CAPTURE_WRITERS": "12"}
    for bad in ("HS_CAPTURE_LAYERS=1,2", "HS_CAPTURE_FINAL=none", "HS_CAPTURE_DIR=/x", "SLOTS=4", "HS_CAPTURE_SLOTS"):
        with pytest.raises(SystemExit, match="--sweep-env"):
            sweep.capture_env(bad)


def test_state_bytes_per_token_counts_the_planes_the_depth_captures():
    import sweep

    assert sweep.state_bytes_per_token(7168, 8) == sweep.state_bytes_per_token(7168, 61) == 72_617
    assert sweep.state_bytes_per_token(7168, 4) == 4 * 7168 * 2 + 9 + (17 + 5) * 32  # layers 1 and 2 (2, 2, 1 deduplicated)


def test_a_server_refuses_a_port_that_already_answers(tmp_path, monkeypatch):
    """A server left by a call cut at its time limit answered the next call's pristine row (it came up in
    1.1 s, a 32-layer model measured as the 4-layer one): a port that answers is refused, not reused."""
    monkeypatch.setattr(common.REC, "logs", tmp_path)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        with pytest.raises(RuntimeError, match="already answers"):
            common.Server("left-over", str(tmp_path), held.getsockname()[1], 64, None, [])


def test_stopping_a_server_ends_its_whole_group_when_the_launcher_already_died(tmp_path, monkeypatch):
    """SGLang's launcher can die (a failed scheduler) with its scheduler and detokenizer still running: stop()
    ended nothing then, since it looked at the launcher alone."""
    import time

    monkeypatch.setattr(common.REC, "logs", tmp_path)
    child = tmp_path / "child.pid"
    monkeypatch.setattr(common.Server, "LAUNCHER", [sys.executable, "-c", (
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(child)!r}, 'w').write(str(p.pid)); sys.exit(1)")])
    s = common.Server("launcher-dies", str(tmp_path), free_port_block(1), 64, None, [])
    deadline = time.monotonic() + 30
    while (s.proc.poll() is None or not child.exists() or not child.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(child.read_text())

    def running() -> bool:  # a killed orphan is reaped by init, or left a zombie where there is none
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    assert running(), "the launcher's child should outlive it"
    s.stop()
    deadline = time.monotonic() + 5
    while running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not running(), "the server's group was left running"
