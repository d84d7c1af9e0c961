"""Extraction part of the GPU proof: what a user runs, side by side with pristine SGLang.

Three rows on the same prompts, in an order that rotates by round, two servers up at once
on the one GPU (pristine, and patched with capture on):

- ``pristine``: pristine SGLang, a plain concurrent ``/generate`` client (max_new_tokens 1);
- ``capture``: the capturing server, the same plain client, timed until every sample is
  in the capture manifest (hook + writer);
- ``driver``: the capturing server driven by ``hs-extract drive --concurrency N`` on a
  pre-tokenized dataset of the same prompts (intents, hook + writer, adopt, manifests),
  timed from its first ``sent`` to its last ``done`` ledger event (``active``; the
  process's whole wall time, with imports and the tokenizer load, is reported too).

``--round-offset K`` starts the rotation K places on, so two shorter calls (``--reps 2`` and
``--reps 2 --round-offset 2``) together run each order, when one call would outlast its time
limit; the per-round ratios of both are comparable (each is measured within its round).

``--long-prompts K --long-tokens T`` makes K of the prompts T tokens long, so with a small
``--chunk`` they are prefilled in many passes (the merge cost that format 1 paid).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import REC, ROOT, Server, hs_patch_cli, pristine_copy, wait_for_samples

from hs_patch.samples import store

ROWS = ("pristine", "capture", "driver")


def _plain(server: Server, prompts: list[list[int]], concurrency: int, tag: str) -> float:
    t = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(server.generate, prompts, [f"{tag}-{i}" for i in range(len(prompts))]))
    return time.perf_counter() - t


def _drive(a: argparse.Namespace, server: Server, model_dir: str, dump: Path, prompts: list[list[int]],
           rnd: int, tag: str, extra: tuple[str, ...] = ()) -> dict:
    work = Path(a.work) / f"extract-{tag}-r{rnd}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    samples = Path(a.dump_root) / f"samples-{tag}-r{rnd}"
    cmd = [sys.executable, "-m", "hs_patch.host.extract_cli", "drive", "--run", f"proof-{tag}-r{rnd}",
           "--data", str(data), "--model", model_dir, "--server", server.url, "--capture-dir", str(dump),
           "--state-dir", str(work / "state"), "--samples-dir", str(samples), "--concurrency", str(a.concurrency),
           "--max-tokens", str(max(len(p) for p in prompts)), "--raw-timeout", "600", "--server-wait", "120", *extra]
    t, launched = time.perf_counter(), time.time()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=server.env)
    wall = time.perf_counter() - t
    ledger = [json.loads(x) for x in (work / "state" / "ledger.jsonl").read_text().splitlines() if x.strip()]
    sent = [e["t"] for e in ledger if e["event"] == "sent"]
    done = [e["t"] for e in ledger if e["event"] == "done"]
    start = next((e for e in ledger if e["event"] == "run_start"), {})
    res = {"exit_code": out.returncode, "wall_s": round(wall, 2), "done": len(done),
           "active_s": round(max(done) - min(sent), 3) if done and sent else None,
           # the start-up (issue #36): the command to its first request, and where it went (run_start's startup)
           "first_request_s": round(min(sent) - launched, 3) if sent else None, "startup": start.get("startup"),
           "stderr_tail": out.stderr[-2000:] if out.returncode else ""}
    if out.returncode or len(done) != len(prompts):
        # what the server and the driver said, into the record that comes back (the machine and its
        # /dev/shm do not): the hook's errors, the ledger's retries and failures
        errors = dump / store.ERRORS
        said = {"errors_jsonl_tail": errors.read_text()[-4000:] if errors.exists() else "",
                "ledger_retries_and_failures": [e for e in ledger if e["event"] in ("retry", "failed")][-20:]}
        REC.data.setdefault("drive_failures", []).append({"tag": tag, "round": rnd, **res, **said})
        REC.save()
        raise RuntimeError(f"hs-extract drive: exit {out.returncode}, {len(done)}/{len(prompts)} done:\n"
                           f"{out.stderr[-3000:]}\n{out.stdout[-1000:]}\n{json.dumps(said)[-3000:]}")
    res["samples_clean"] = bool(store.read_manifest(samples)) and len(store.read_manifest(samples)) == len(prompts)
    shutil.rmtree(samples, ignore_errors=True)
    return res


def extraction(a: argparse.Namespace, model_dir: str, tag: str) -> dict:
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    n_layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    layers = sorted({2, n_layers // 2, n_layers - 2} & set(range(n_layers)))  # 16 layers: 2, 8, 14
    longest = max(a.tokens, a.long_tokens if a.long_prompts else 0)
    kv_tokens = a.concurrency * longest + a.chunk
    res: dict = {"model": model_dir, "layers": n_layers, "hidden": hidden, "prompts": a.prompts, "tokens": a.tokens,
                 "long_prompts": a.long_prompts, "long_tokens": a.long_tokens, "concurrency": a.concurrency,
                 "chunked_prefill_size": a.chunk, "capture_layers": layers, "capture_final": "pre",
                 "rounds": a.reps, "round_offset": a.round_offset, "order": [], **{r: {"tok_s": []} for r in ROWS}}
    REC.data[f"extract_{tag}"] = res
    st = hs_patch_cli("apply", "--site", a.site)
    assert st["exit_code"] == 0 and st["state"] == "patched", st
    pristine = pristine_copy(a.site, Path(a.work) / "pristine-site")
    dump = Path(a.dump_root) / f"dump-extract-{tag}"
    shutil.rmtree(dump, ignore_errors=True)
    capture = {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), "HS_CAPTURE_FINAL": "pre",
               "HS_CAPTURE_LAYERS": ",".join(map(str, layers))}
    extra = ["--sleep-on-idle", "--max-total-tokens", str(kv_tokens)]
    servers: dict[str, Server] = {}
    try:
        servers["pristine"] = Server(f"ex-{tag}-pristine", model_dir, a.port + 1, a.chunk, None, extra,
                                     first_on_path=str(pristine), mem_fraction=a.mem_fraction, tp_size=a.tp_size)
        servers["pristine"].wait_memory()
        servers["capture"] = Server(f"ex-{tag}-capture", model_dir, a.port + 2, a.chunk, capture, extra,
                                    mem_fraction=a.mem_fraction, tp_size=a.tp_size)
        for s in servers.values():
            s.wait_ready()
        rng = random.Random(13)
        for rnd in range(a.reps + 1):  # round 0 warms up
            k = (rnd + a.round_offset) % 3 if rnd else 0  # --round-offset: a later call continues the rotation
            order = list(ROWS[k:] + ROWS[:k])
            lengths = [a.long_tokens] * a.long_prompts + [a.tokens] * (a.prompts - a.long_prompts)
            rng.shuffle(lengths)
            if not rnd and a.warmup_prompts:  # a shorter warm-up that still compiles the long prompts' shapes
                lengths = sorted(lengths, reverse=True)[:min(2, a.long_prompts)] + \
                    [a.tokens] * max(0, a.warmup_prompts - min(2, a.long_prompts))
            prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
            total = sum(lengths)
            secs = {row: run_row(a, row, servers, model_dir, dump, prompts, rnd, tag, res) for row in order}
            end_round(res, f"extract {tag}", rnd, order, total, secs, dump)
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(dump, ignore_errors=True)
    driver_wall = [total_s["wall_s"] for total_s in res["driver"].get("runs", [])[1:]]
    res["driver_wall_s"] = driver_wall
    medians(res)
    return res


def run_row(a: argparse.Namespace, row: str, servers: dict[str, Server], model_dir: str, dump: Path,
            prompts: list[list[int]], rnd: int, tag: str, res: dict, drive_extra: tuple[str, ...] = ()) -> float:
    """Seconds of one row: the plain client on pristine; on the capturing server until every sample is in
    its manifest; or hs-extract drive's active time (its run recorded under res["driver"]["runs"])."""
    if row == "driver":
        d = _drive(a, servers["capture"], model_dir, dump, prompts, rnd, tag, drive_extra)
        res["driver"].setdefault("runs", []).append(d)
        return d["active_s"]
    if row == "pristine":
        return _plain(servers["pristine"], prompts, a.concurrency, f"{tag}-{rnd}-p")
    t = time.perf_counter()
    responses = _plain(servers["capture"], prompts, a.concurrency, f"{tag}-{rnd}-c")
    res["capture"]["last_response_at"] = time.time()  # the sweep places the writer's last pass against it
    wait_for_samples(dump, {store.sample_key(p) for p in prompts}, timeout=600)
    seconds = time.perf_counter() - t
    # what the writer still had to do once the last response came (its latency, or a backlog if it grows
    # with the round's length)
    if rnd:
        res["capture"].setdefault("tail_s", []).append(round(seconds - responses, 3))
    for f in dump.glob("*.safetensors"):  # keep /dev/shm small between rows
        f.unlink()
    return seconds


def end_round(res: dict, what: str, rnd: int, order: list[str], total: int, secs: dict[str, float],
              dump: Path) -> None:
    """Record a round's speeds (round 0 warms up) and the hook's status (after every round: a call cut
    at its time limit keeps it), log it, save the record."""
    if rnd:
        res["order"].append(order)
        for row in ROWS:
            res[row]["tok_s"].append(total / secs[row])
    hook = dump / "hook_status.json"
    res["hook_status"] = json.loads(hook.read_text()) if hook.exists() else None
    REC.log(f"{what} round {rnd} ({'warm-up, ' if not rnd else ''}order {','.join(order)}): "
            + ", ".join(f"{r} {total / secs[r]:.0f}" for r in order) + " tok/s; hook waits "
            + str((res["hook_status"] or {}).get("waits")))
    REC.save()


def medians(res: dict) -> None:
    """Each row's median tok/s and the per-round ratios to pristine with their medians."""
    per_round = {f"{r}/pristine": [x / y for x, y in zip(res[r]["tok_s"], res["pristine"]["tok_s"])]
                 for r in ("capture", "driver")}
    res["ratios_per_round"] = per_round
    res["ratios"] = {k: statistics.median(v) for k, v in per_round.items()}
    for r in ROWS:
        res[r]["median_tok_s"] = statistics.median(res[r]["tok_s"])
    REC.save()


def summarize_extraction(k: str, f: dict) -> None:
    print(f"\n{k}: {f['layers']} layers, hidden {f['hidden']}, {f['prompts']} prompts x {f['tokens']} tokens "
          f"({f['long_prompts']} of {f['long_tokens']}), chunk {f['chunked_prefill_size']}, concurrency "
          f"{f['concurrency']}, layers {f['capture_layers']} + final, {f['rounds']} rounds (tok/s)")
    for r in ROWS:
        print(f"  {r:10}{f[r]['median_tok_s']:12.0f}  {[round(x) for x in f[r]['tok_s']]}")
    for name, xs in f["ratios_per_round"].items():
        print(f"  {name:18}{statistics.median(xs):7.3f}  rounds {[round(x, 3) for x in xs]}")
    print(f"  hs-extract drive whole-process wall times (imports, tokenizer, health check included): "
          f"{f['driver_wall_s']} s; command to first request: "
          f"{[r.get('first_request_s') for r in f['driver'].get('runs', [])[1:]]} s")
