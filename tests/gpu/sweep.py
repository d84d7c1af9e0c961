"""Rate sweep of the GPU proof (issue #22): capture and ``hs-extract drive`` at three rates of states.

The engine's rate of states decides whether the writer keeps up: the same prompts on a shallower
model make more GB/s. For each depth of ``--sweep-layers`` (default 8, 16 and 32 layers of the
kimi-layer preset, hidden 7168: about 2.1, 1.0 and 0.5 GB/s of states on the H200) a pristine and
a capturing server run side by side on the one GPU with SGLang's dummy weights (``--load-format
dummy``: the same shapes and compute, nothing to build or read: the three depths fit one call;
``--sweep-weights`` writes real checkpoints instead), the product's default capture (3 layers +
both finals: 5 planes, 72,617 bytes a token). Rows, on the same prompts, in an order that rotates
with the depth (and ``--round-offset``):

- ``pristine``: the pristine server, a plain concurrent ``/generate`` client;
- ``capture``: the capturing server, the same client, timed until every sample is in the capture
  manifest (so a writer that falls behind shows even where a driver would hide it);
- ``driver``: ``hs-extract drive --concurrency N`` on the capturing server, from its first ``sent``
  to its last ``done`` (``--no-fidelity-check`` with dummy weights: there is no LM head to read;
  the ``extract`` phase runs the check on a real checkpoint).

Each depth gets ``--prompts`` x 8 / depth prompts (at least ``--concurrency``), so every row takes
about as long at every depth. GPU memory in use (``cudaMemGetInfo``) is sampled every 0.1 s while
each row runs (the other server idles, ``--sleep-on-idle``), so the growth under load of the
pristine and of the capturing server are told apart, with what each held once started; with
``--chunk 16384 --long-prompts 8`` that is the peak at 16K-token passes, capture on vs off.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from common import REC, Server, hs_patch_cli, pristine_copy
from extract import ROWS, end_round, medians, run_row
from proc_cpu import GroupCpu, WriterThreads

from hs_patch.samples import store
from hs_patch.server import fingerprint
from hs_patch.server.config import default_layers


def state_bytes_per_token(hidden: int, layers: int) -> int:
    """Bytes a token of the default capture stores: its planes (the layers + both finals, bf16), the id
    and loss mask (9), a fingerprint row per stream and a checksum row per stored plane and the embedded
    rows (BLOCKS x 4 bytes each: hs_patch.server.fingerprint). 72,617 at Kimi's width and 8 or more layers
    (layer-point and communicator families); fewer at 4 (two layers)."""
    ids = default_layers(layers)
    planes, streams = len(store.plane_names(ids, "both")), len(fingerprint.streams(ids, "both"))
    checksums = len(fingerprint.checksum_streams(ids, "both"))
    return planes * hidden * 2 + 9 + (streams + checksums) * fingerprint.BLOCKS * 4


class GpuMemory:
    """GPU memory in use (total - free), sampled every ``period`` s while the block runs: its start and peak."""

    def __init__(self, period: float = 0.1):
        self.period, self.start, self.peak = period, None, None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @staticmethod
    def used() -> Optional[int]:
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            free, total = torch.cuda.mem_get_info(0)
            return int(total - free)
        except Exception:  # noqa: BLE001 - a measurement, never a reason to fail the run
            return None

    def __enter__(self) -> "GpuMemory":
        self.start = self.peak = self.used()
        if self.start is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            u = self.used()
            if u is not None and (self.peak is None or u > self.peak):
                self.peak = u

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        u = self.used()
        if u is not None and (self.peak is None or u > self.peak):
            self.peak = u

    def growth(self) -> Optional[int]:
        return None if self.start is None else self.peak - self.start


def config_only_model(a: argparse.Namespace, layers: int) -> str:
    """A kimi-layer model directory of ``layers`` layers without weights (the servers load it as dummy)."""
    from make_model import build

    out = Path(a.work) / f"model-kimi-layer-h{a.sweep_hidden}-l{layers}-{'weights' if a.sweep_weights else 'dummy'}"
    if not (out / "config.json").exists():
        build(str(out), hidden=a.sweep_hidden, layers=layers, preset="kimi-layer", device="cuda",
              weights=a.sweep_weights)
    return str(out)


SETTINGS = ("prompts", "tokens", "long_prompts", "long_tokens", "concurrency", "chunk", "reps", "round_offset",
            "sweep_hidden", "sweep_weights", "sweep_env", "mem_fraction", "capture_mem_fraction")
START_S, ROUND_S = 120.0, 60.0  # a server's start and a round before the record has timed one (H100: the first start
# on a fresh machine 183 s, compiling kernels; later ones about 60 s; rounds 30-50 s)


def sweep(a: argparse.Namespace, tag: str, model_for: Optional[Callable[[int], str]] = None) -> dict:
    """Every depth of ``a.sweep_layers``, one after another (two servers up at a time). The record is kept in
    ``--work`` too: the same command run again on the same machine (a warm one: --work persists) continues it,
    skipping the rounds already measured, so a sweep longer than one call's limit is a few calls of the same
    command; ``--call-seconds`` stops a call cleanly before a depth or round that would not fit."""
    model_for = model_for or (lambda n: config_only_model(a, n))
    depths = [int(x) for x in str(a.sweep_layers).split(",")]
    settings = {k: getattr(a, k, None) for k in SETTINGS}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    kept = Path(a.work) / f"sweep-{tag}-{digest}.json"  # each setting its own record; the depths may grow
    res: dict = json.loads(kept.read_text()) if kept.exists() else {}
    if not res:
        res = {"settings": settings, "depths": depths, "prompts": a.prompts, "tokens": a.tokens,
               "long_prompts": a.long_prompts, "long_tokens": a.long_tokens, "concurrency": a.concurrency,
               "chunked_prefill_size": a.chunk, "rounds": a.reps, "round_offset": a.round_offset,
               "dummy_weights": not a.sweep_weights, "runs": {}, "calls": 0}
    res["depths"] = list(dict.fromkeys(res["depths"] + depths))
    res["calls"] += 1
    REC.data[f"sweep_{tag}"] = res

    def save() -> None:
        REC.save()
        kept.write_text(json.dumps(res, indent=1, default=str))

    st = hs_patch_cli("apply", "--site", a.site)
    assert st["exit_code"] == 0 and st["state"] == "patched", st
    pristine = pristine_copy(a.site, Path(a.work) / "pristine-site")
    for layers in depths:
        if len((res["runs"].get(str(layers)) or {}).get("order", [])) >= a.reps:
            continue  # measured in an earlier call
        if not _depth(a, model_for(layers), layers, res["depths"].index(layers), pristine, f"{tag}-l{layers}", res,
                      save):
            res["stopped"] = (f"call time: depth {layers} not finished; run the same command again on this machine "
                              "to continue")
            REC.log(res["stopped"])
            break
        res.pop("stopped", None)
    save()
    return res


def _left(a: argparse.Namespace) -> float:
    """Seconds left of this call (--call-seconds from the proof's start; no limit: infinite)."""
    limit = getattr(a, "call_seconds", 0) or 0
    return limit - (time.time() - REC.t0) if limit else float("inf")


def _prompts(a: argparse.Namespace, rng: random.Random, count: int, warmup: bool) -> list[list[int]]:
    long = min(a.long_prompts, count)
    lengths = [a.long_tokens] * long + [a.tokens] * (count - long)
    rng.shuffle(lengths)
    if warmup:  # few, but with the long prompts' shapes compiled
        lengths = sorted(lengths, reverse=True)[:min(2, long)] + [a.tokens] * max(0, a.warmup_prompts - min(2, long))
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def capture_env(spec: str) -> dict[str, str]:
    """``--sweep-env``: HS_CAPTURE_X=V pairs for the capturing server (the default capture's planes kept)."""
    env: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.startswith("HS_CAPTURE_") or key in ("HS_CAPTURE_DIR", "HS_CAPTURE_LAYERS",
                                                                     "HS_CAPTURE_FINAL"):
            raise SystemExit(f"--sweep-env: {item!r} is not HS_CAPTURE_X=V of a hook setting the sweep may "
                             "change (not DIR, LAYERS or FINAL: the rates assume the default capture)")
        env[key] = value
    return env


def _depth(a: argparse.Namespace, model_dir: str, layers: int, index: int, pristine: Path, tag: str,
           parent: dict, save: Callable[[], None]) -> bool:
    """One depth's rounds not yet measured (a warm-up round first); False if the call's time ran short first."""
    count = max(a.concurrency, round(a.prompts * 8 / layers))
    longest = max(a.tokens, a.long_tokens if a.long_prompts else 0)
    kv_tokens = a.concurrency * longest + a.chunk
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    hidden = int(cfg["hidden_size"])
    planes = len(store.plane_names(default_layers(layers), "both"))
    res: dict = parent["runs"].get(str(layers)) or {
        "model": model_dir, "layers": layers, "hidden": hidden, "capture_layers": list(default_layers(layers)),
        "planes": planes, "prompts": count, "capture_env": capture_env(getattr(a, "sweep_env", "")), "order": [],
        "memory": {}, **{r: {"tok_s": []} for r in ROWS},
        "state_bytes_per_token": state_bytes_per_token(hidden, layers), "timing": {}}
    parent["runs"][str(layers)] = res
    timing = res.setdefault("timing", {})
    start_s, round_s = _estimates(parent, timing)
    if _left(a) < 2 * start_s + 1.5 * round_s:  # both servers, the warm-up round and one measured round
        return False
    dump = Path(a.dump_root) / f"dump-sweep-{tag}"
    shutil.rmtree(dump, ignore_errors=True)
    extra = ["--sleep-on-idle", "--max-total-tokens", str(kv_tokens)]
    if not a.sweep_weights:
        extra += ["--load-format", "dummy"]
    # HS_SWEEP_DRIVE_ARGS: more hs-extract drive options for every driver row (e.g. --fidelity-gap-positions 0)
    drive_extra = ((() if a.sweep_weights else ("--no-fidelity-check",))
                   + tuple(os.environ.get("HS_SWEEP_DRIVE_ARGS", "").split()))
    servers: dict[str, Server] = {}
    done = len(res["order"])
    try:
        before = GpuMemory.used()
        servers["pristine"] = Server(f"sw-{tag}-pristine", model_dir, a.port + 1, a.chunk, None, extra,
                                     first_on_path=str(pristine), mem_fraction=a.mem_fraction, tp_size=a.tp_size)
        servers["pristine"].wait_ready()
        after_pristine = GpuMemory.used()
        servers["capture"] = Server(f"sw-{tag}-capture", model_dir, a.port + 2, a.chunk,
                                    {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), **res["capture_env"]}, extra,
                                    mem_fraction=getattr(a, "capture_mem_fraction", None) or a.mem_fraction,
                                    tp_size=a.tp_size)
        servers["capture"].wait_ready()
        timing["server_start_s"] = max(s.start_s or 0 for s in servers.values())
        after_capture = GpuMemory.used()
        if None not in (before, after_pristine, after_capture):
            res["memory"]["held_after_start"] = {"pristine": after_pristine - before,
                                                 "capture": after_capture - after_pristine}
        rng = random.Random(17 + layers)
        for rnd in range(a.reps + 1):  # round 0 warms both servers up (plain client only)
            prompts = _prompts(a, rng, count, warmup=not rnd)  # made for every round: the same in a resumed call
            if rnd and rnd <= done:
                continue  # measured in an earlier call
            if rnd and _left(a) < 1.2 * timing.get("round_s", round_s):
                return False
            t_round = time.time()
            _round(a, res, servers, model_dir, dump, prompts, rnd, index, tag, drive_extra)
            if rnd:
                timing["round_s"] = max(timing.get("round_s", 0.0), round(time.time() - t_round, 1))
            save()
        if getattr(a, "writer_profile", False) and "profile" not in res["capture"] and _left(a) > timing["round_s"]:
            _profile(a, res, servers, model_dir, dump, prompts, tag)
            save()
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(dump, ignore_errors=True)
    medians(res)
    res["engine_GBps_of_states"] = res["pristine"]["median_tok_s"] * res["state_bytes_per_token"] / 1e9
    save()
    return True


def _profile(a: argparse.Namespace, res: dict, servers: dict[str, Server], model_dir: str, dump: Path,
             prompts: list[list[int]], tag: str) -> None:
    """--writer-profile: one more capture row, not measured (py-spy pauses the process for each sample), with py-spy
    recording the capturing scheduler: what its threads' samples were doing (proc_cpu.hottest_frames)."""
    hook = hook_counts(dump)
    with WriterThreads(dump, Path(a.work) / f"pyspy-{tag}.txt") as threads:
        run_row(a, "capture", servers, model_dir, dump, prompts, 0, f"{tag}-profile", res)
        hook_waits_since(dump, hook, len(prompts))
    res["capture"]["profile"] = threads.profile or {"error": ["no py-spy on PATH, or no hook status"]}
    res["capture"]["profile_threads_cpu_s_per_GB"] = threads.per_gb(sum(map(len, prompts)) *
                                                                    res["state_bytes_per_token"] / 1e9)


def _estimates(parent: dict, timing: dict) -> tuple[float, float]:
    """(a server's start, a round) in seconds: this depth's as timed, else the longest of any depth in the record (on
    this machine, in an earlier call: the rows are sized alike at every depth), else START_S and ROUND_S."""
    known = [r.get("timing", {}) for r in parent["runs"].values()]
    start = timing.get("server_start_s") or max((t.get("server_start_s", 0) for t in known), default=0) or START_S
    rnd = timing.get("round_s") or max((t.get("round_s", 0) for t in known), default=0) or ROUND_S
    return start, rnd


def _round(a: argparse.Namespace, res: dict, servers: dict[str, Server], model_dir: str, dump: Path,
           prompts: list[list[int]], rnd: int, index: int, tag: str, drive_extra: tuple[str, ...]) -> None:
    """One round: the rows in the rotation's order, each with the hook's waits, the server's CPU, the writer's
    threads' CPU (the capturing server's rows) and the GPU memory."""
    total = sum(len(p) for p in prompts)
    gb = total * res["state_bytes_per_token"] / 1e9
    k = (rnd - 1 + index + a.round_offset) % 3 if rnd else 0
    order = list(ROWS[k:] + ROWS[:k]) if rnd else ["pristine", "capture"]
    secs: dict[str, float] = {}
    for row in order:
        server = servers["pristine" if row == "pristine" else "capture"]
        hook = hook_counts(dump) if row != "pristine" else None
        with GpuMemory() as mem, GroupCpu(server.proc.pid) as cpu, WriterThreads(dump) as threads:
            secs[row] = run_row(a, row, servers, model_dir, dump, prompts, rnd, tag, res, drive_extra)
            if hook is not None:  # the writer's last pass is in its threads' times
                waits = hook_waits_since(dump, hook, len(prompts))
        if rnd and hook is not None:
            res[row].setdefault("hook_waits", []).append(waits)
            if row == "capture":
                res[row].setdefault("last_pass", []).append(last_pass(dump, res[row]["last_response_at"]))
            res[row].setdefault("writer_threads_cpu_s_per_GB", []).append(threads.per_gb(gb))
        if rnd and cpu.seconds is not None:
            res[row].setdefault("server_cpu_s_per_GB", []).append(round(cpu.seconds / gb, 3))
        growth = mem.growth()
        if growth is not None:
            key = "pristine" if row == "pristine" else "capture"
            res["memory"][f"{key}_growth_max"] = max(res["memory"].get(f"{key}_growth_max", 0), growth)
    end_round(res, f"sweep {tag}", rnd, order, total, secs, dump)


def hook_counts(dump: Path) -> dict:
    """The capturing server's hook counters now (``hook_status.json``: current whenever its writer is idle)."""
    try:
        doc = json.loads((dump / "hook_status.json").read_text())
    except (OSError, ValueError):
        return {"samples": 0, "waits": 0, "wait_seconds": 0.0}
    return {k: doc.get(k, 0) for k in ("samples", "waits", "wait_seconds")}


def hook_waits_since(dump: Path, before: dict, samples: int, timeout: float = 10.0) -> dict:
    """The hook's waits for a staging slot during one row: its counters once the row's ``samples`` are
    written (the writer rewrites its status when idle), minus ``before``."""
    deadline = time.monotonic() + timeout
    now = hook_counts(dump)
    while now["samples"] < before["samples"] + samples and time.monotonic() < deadline:
        time.sleep(0.05)
        now = hook_counts(dump)
    return {"waits": now["waits"] - before["waits"],
            "seconds": round(now["wait_seconds"] - before["wait_seconds"], 3),
            "complete": now["samples"] >= before["samples"] + samples}


def last_pass(dump: Path, last_response_at: float) -> dict:
    """The writer's last pass of a row (``hook_status.json``): its copies landed this long after the row's
    last response (negative: before it), then its writes and hash, then publishing (splits the tail)."""
    try:
        doc = dict(json.loads((dump / "hook_status.json").read_text()).get("last_pass") or {})
    except (OSError, ValueError):
        return {}
    if doc:
        doc["landed_after_response_s"] = round(doc["queued"] + doc["landed_s"] - last_response_at, 3)
    return doc


def _tail_parts(r: dict) -> str:
    """The capture row's last pass, medians: landed after the last response / written / published (s)."""
    got = [x for x in r.get("capture", {}).get("last_pass") or [] if x]
    keys = ("landed_after_response_s", "written_s", "published_s")
    return "/".join(f"{statistics.median(x[k] for x in got):.2f}" for k in keys) if got else "-"


def summarize_sweep(k: str, f: dict) -> None:
    print(f"\n{k}: {f['prompts']} prompts a round at 8 layers (x 8/depth at deeper ones) x {f['tokens']} tokens "
          f"({f['long_prompts']} of {f['long_tokens']}), concurrency {f['concurrency']}, chunk "
          f"{f['chunked_prefill_size']}, {f['rounds']} round(s) a depth, dummy weights {f['dummy_weights']}")
    print(f"  {'layers':>6}{'GB/s states':>12}{'pristine':>10}{'capture':>10}{'driver':>10}{'capt/pr':>9}{'drv/pr':>8}"
          f"{'waits c/d':>11}{'tail s':>8}{'land/write/pub':>16}{'CPU s/GB':>10}  GPU memory (MB): held at start pristine/capture, growth under load "
          "pristine/capture")
    for layers, r in f["runs"].items():
        if "ratios" not in r:
            continue
        m: dict[str, Any] = r.get("memory", {})
        held = m.get("held_after_start") or {}
        mb = [None if x is None else round(x / 1e6) for x in (held.get("pristine"), held.get("capture"),
                                                               m.get("pristine_growth_max"), m.get("capture_growth_max"))]
        print(f"  {layers:>6}{r['engine_GBps_of_states']:12.2f}{r['pristine']['median_tok_s']:10.0f}"
              f"{r['capture']['median_tok_s']:10.0f}{r['driver']['median_tok_s']:10.0f}"
              f"{r['ratios']['capture/pristine']:9.3f}{r['ratios']['driver/pristine']:8.3f}"
              f"{_row_waits(r):>11}{_median(r['capture'].get('tail_s')):>8}{_tail_parts(r):>16}{_writer_cpu(r):>10}  {mb}")
    print("  the capture row's threads in the capturing scheduler, CPU s per GB of states (user+system, medians; "
          "/proc, hook_status.json's thread ids), and the hottest native frames where --writer-profile ran py-spy:")
    for layers, r in f["runs"].items():
        print(f"  {layers:>6}  {_thread_cpu(r)}")
        for group, frames in (r.get("capture", {}).get("profile") or {}).items():
            print(f"          {group}: " + ("; ".join(map(str, frames)) if group == "error" else
                                            "; ".join(f"{fr[0][:90]} {fr[2]:.0%}" for fr in frames[:5])))
    print("  hs-extract drive, medians (s): the whole process / active (first sent to last done) / the command to its "
          "first request; /pristine as a whole process")
    for layers, r in f["runs"].items():
        runs = [x for x in r.get("driver", {}).get("runs", []) if x.get("first_request_s") is not None]
        if runs and "ratios" in r:  # (a depth cut short has no medians yet)
            med = {k: statistics.median(x[k] for x in runs) for k in ("wall_s", "active_s", "first_request_s")}
            whole = r["driver"]["median_tok_s"] * med["active_s"] / med["wall_s"] / r["pristine"]["median_tok_s"]
            print(f"  {layers:>6}  {med['wall_s']:.2f} / {med['active_s']:.2f} / {med['first_request_s']:.2f}  "
                  f"(whole process / pristine {whole:.3f})")
    if f.get("stopped"):
        print(f"  NOT DONE: {f['stopped']}")


def _median(xs: Optional[list]) -> str:
    return f"{statistics.median(xs):.2f}" if xs else "-"


def _row_waits(r: dict) -> str:
    """The hook's waits for a staging slot in the measured rounds: capture row / driver row (totals)."""
    got = [r.get(row, {}).get("hook_waits") for row in ("capture", "driver")]
    return "/".join("-" if not g else str(sum(x["waits"] for x in g)) for g in got)


def _writer_cpu(r: dict) -> str:
    """What writing cost the capturing server: its CPU s per GB of states minus the pristine server's."""
    cap, pri = (r.get(row, {}).get("server_cpu_s_per_GB") or [] for row in ("capture", "pristine"))
    if not cap or not pri:
        return "-"
    return f"{statistics.median(cap) - statistics.median(pri):.2f}"


def _thread_cpu(r: dict) -> str:
    """The capture row's writer threads by group: median user+system CPU s per GB of states (and the user share)."""
    got = r.get("capture", {}).get("writer_threads_cpu_s_per_GB") or []
    groups = sorted({g for x in got for g in x})
    parts = []
    for g in groups:
        tot = statistics.median(x[g]["user"] + x[g]["system"] for x in got if g in x)
        user = statistics.median(x[g]["user"] for x in got if g in x)
        parts.append(f"{g} {tot:.2f} ({user / tot:.0%} user)" if tot else f"{g} 0")
    return ", ".join(parts) or "-"
