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

from hs_patch import store
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


class GroupCpu:
    """CPU seconds (user + system) of every process in a server's process group (the launcher, the
    scheduler with the capture writer's threads, the detokenizer) while the block runs, from /proc.
    Capture row minus pristine row, per GB of states, is what writing costs inside the server: times
    the engine's rate, it says whether the writer's ceiling on the GPU host is its CPU."""

    TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __init__(self, pgid: int):
        self.pgid, self.seconds = pgid, None

    def total(self) -> Optional[float]:
        ticks, found = 0, False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                rest = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # a process that ended meanwhile
            if int(rest[2]) == self.pgid:  # fields after the name: state, ppid, pgrp, ..., utime (12th), stime
                ticks += int(rest[11]) + int(rest[12])
                found = True
        return ticks / self.TICK if found else None

    def __enter__(self) -> "GroupCpu":
        self._start = self.total()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self.total()
        self.seconds = None if None in (self._start, end) else round(end - self._start, 2)


def config_only_model(a: argparse.Namespace, layers: int) -> str:
    """A kimi-layer model directory of ``layers`` layers without weights (the servers load it as dummy)."""
    from make_model import build

    out = Path(a.work) / f"model-kimi-layer-h{a.sweep_hidden}-l{layers}-{'weights' if a.sweep_weights else 'dummy'}"
    if not (out / "config.json").exists():
        build(str(out), hidden=a.sweep_hidden, layers=layers, preset="kimi-layer", device="cuda",
              weights=a.sweep_weights)
    return str(out)


def sweep(a: argparse.Namespace, tag: str, model_for: Optional[Callable[[int], str]] = None) -> dict:
    """Every depth of ``a.sweep_layers``, one after another (two servers up at a time)."""
    model_for = model_for or (lambda n: config_only_model(a, n))
    depths = [int(x) for x in str(a.sweep_layers).split(",")]
    res: dict = {"depths": depths, "prompts": a.prompts, "tokens": a.tokens, "long_prompts": a.long_prompts,
                 "long_tokens": a.long_tokens, "concurrency": a.concurrency, "chunked_prefill_size": a.chunk,
                 "rounds": a.reps, "round_offset": a.round_offset, "dummy_weights": not a.sweep_weights, "runs": {}}
    REC.data[f"sweep_{tag}"] = res
    st = hs_patch_cli("apply", "--site", a.site)
    assert st["exit_code"] == 0 and st["state"] == "patched", st
    pristine = pristine_copy(a.site, Path(a.work) / "pristine-site")
    for i, layers in enumerate(depths):
        res["runs"][str(layers)] = _depth(a, model_for(layers), layers, i, pristine, f"{tag}-l{layers}", res)
        REC.save()
    return res


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
           parent: dict) -> dict:
    count = max(a.concurrency, round(a.prompts * 8 / layers))
    longest = max(a.tokens, a.long_tokens if a.long_prompts else 0)
    kv_tokens = a.concurrency * longest + a.chunk
    cfg = json.loads(Path(model_dir, "config.json").read_text())
    hidden = int(cfg["hidden_size"])
    planes = len(store.plane_names(default_layers(layers), "both"))
    res: dict = {"model": model_dir, "layers": layers, "hidden": hidden, "capture_layers": list(default_layers(layers)),
                 "planes": planes, "prompts": count, "capture_env": capture_env(getattr(a, "sweep_env", "")), "order": [], "memory": {}, **{r: {"tok_s": []} for r in ROWS},
                 "state_bytes_per_token": state_bytes_per_token(hidden, layers)}
    parent["runs"][str(layers)] = res
    dump = Path(a.dump_root) / f"dump-sweep-{tag}"
    shutil.rmtree(dump, ignore_errors=True)
    extra = ["--sleep-on-idle", "--max-total-tokens", str(kv_tokens)]
    if not a.sweep_weights:
        extra += ["--load-format", "dummy"]
    drive_extra = (() if a.sweep_weights else ("--no-fidelity-check",)) + tuple(os.environ.get("HS_SWEEP_DRIVE_ARGS", "").split())
    servers: dict[str, Server] = {}
    try:
        before = GpuMemory.used()
        servers["pristine"] = Server(f"sw-{tag}-pristine", model_dir, a.port + 1, a.chunk, None, extra,
                                     first_on_path=str(pristine), mem_fraction=a.mem_fraction, tp_size=a.tp_size)
        servers["pristine"].wait_ready()
        after_pristine = GpuMemory.used()
        servers["capture"] = Server(f"sw-{tag}-capture", model_dir, a.port + 2, a.chunk,
                                    {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": str(dump), **res["capture_env"]}, extra,
                                    mem_fraction=a.mem_fraction, tp_size=a.tp_size)
        servers["capture"].wait_ready()
        after_capture = GpuMemory.used()
        if None not in (before, after_pristine, after_capture):
            res["memory"]["held_after_start"] = {"pristine": after_pristine - before,
                                                 "capture": after_capture - after_pristine}
        rng = random.Random(17 + layers)
        for rnd in range(a.reps + 1):  # round 0 warms both servers up (plain client only)
            prompts = _prompts(a, rng, count, warmup=not rnd)
            total = sum(len(p) for p in prompts)
            k = (rnd - 1 + index + a.round_offset) % 3 if rnd else 0
            order = list(ROWS[k:] + ROWS[:k]) if rnd else ["pristine", "capture"]
            secs: dict[str, float] = {}
            for row in order:
                server = servers["pristine" if row == "pristine" else "capture"]
                hook = hook_counts(dump) if row != "pristine" else None
                with GpuMemory() as mem, GroupCpu(server.proc.pid) as cpu:
                    secs[row] = run_row(a, row, servers, model_dir, dump, prompts, rnd, tag, res, drive_extra)
                if rnd and hook is not None:
                    waits = hook_waits_since(dump, hook, len(prompts))
                    res[row].setdefault("hook_waits", []).append(waits)
                    if row == "capture":
                        res[row].setdefault("last_pass", []).append(last_pass(dump, res[row]["last_response_at"]))
                if rnd and cpu.seconds is not None:
                    res[row].setdefault("server_cpu_s_per_GB", []).append(
                        round(cpu.seconds / (total * res["state_bytes_per_token"] / 1e9), 3))
                growth = mem.growth()
                if growth is not None:
                    key = "pristine" if row == "pristine" else "capture"
                    res["memory"][f"{key}_growth_max"] = max(res["memory"].get(f"{key}_growth_max", 0), growth)
            end_round(res, f"sweep {tag}", rnd, order, total, secs, dump)
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(dump, ignore_errors=True)
    medians(res)
    res["engine_GBps_of_states"] = res["pristine"]["median_tok_s"] * res["state_bytes_per_token"] / 1e9
    REC.save()
    return res


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
