#!/usr/bin/env python3
"""The closed loop on one GPU, second pass (issue #34): a target trained for a fixed step count, our
samples, SpecForge's own capture, controls that must come out worse, SpecForge's trainer (three seeds
an arm, the same data order in every arm), SGLang's EAGLE-3, and paired intervals for every difference.

Phases, in order (``--plan`` prints each with its estimated seconds and how the calls split):

  setup       SpecForge's wheels, SGLang 0.5.14's site (SpecForge's pin) built in the background
  corpus      chats cut from the installed packages' sources, deduplicated; held-out chats from other
              files; the eval set (held-out + HumanEval + MT-Bench first turns, loop/evalset.py)
  target      its own BPE tokenizer and ChatML template, a DeepseekV3 (MLA + MoE) trained for exactly
              --target-steps; a random-weights server compiles SGLang's kernels meanwhile
  extract     the patched SGLang 0.5.16 server, capture on (layers 1..6: ours trains on 2,4,5, the
              controls need their neighbours): the target's greedy answers to the drafter prompts and
              to every eval prompt (not captured; the plain answers and the share at the cap);
              SpecForge's capture started on the same chats (background, --sf-shards processes);
              `hs-extract drive`, `export --format specforge --layers 2,4,5`, `drafter-config`
  launch_ours ours' trainings (--seeds) and the untrained floor, on ordered links (loop/order.py)
  controls    shuffled, zeroed, late, partial, scaled, prenorm (loop/controls.py), each training
              started as its features are written
  fp8         issue #35: the same chats captured by a server with HS_CAPTURE_DTYPE=fp8, exported
              dequantized, its trainings (--seeds, ours' order); bytes per token and the error per plane
              against the bf16 samples (loop/fp8arm.py); a failure here is recorded, the rest goes on
  specforge   SpecForge's capture awaited, linked in ours' order, its trainings (--seeds)
  serve_main  every arm at (3,1,4): each drafter exported and served as its training ends,
              `hs-extract accept` on every eval prompt
  serve_long  ours and SpecForge's seeds at (7,1,8)
  serve_t1    ours-s0 and prenorm-s0 at temperature 1 (where a sharper teacher should no longer help)
  specbench   SpecForge's benchmarks/bench_eagle3.py beside `hs-extract accept` (loop/specbench.py)
  greedy      ours-s0 at (3,1,4) with --plain: near-ties told from mismatches

Every call ends by packing what exists into --out (results.json, table.md, table.json,
conversations.jsonl.xz, logs.tar.xz: five files, everything measured so far); a phase already done is
skipped, so the same command resumes on the same machine; a call stops before a phase its time left
(--deadline) cannot hold. Trainings and SpecForge's capture run in their own sessions across calls.

usage (on the GPU machine, after `source .gpukit/device_setup.sh`):
  python3 tests/gpu/closed_loop.py --plan
  python3 tests/gpu/closed_loop.py --work /tmp/loop --out "$OUT/loop" --carry .loopcarry --deadline 540
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT), str(HERE.parent), str(HERE)]

from common import REC  # noqa: E402
from loop import controls, plan, record, specbench, table  # noqa: E402
from loop.evalset import subsets  # noqa: E402
from loop.steps import Steps  # noqa: E402

ARMS = ("ours", "specforge", "fp8", "shuffled", "zeroed", "late", "partial", "scaled", "prenorm", "untrained")


class Loop(Steps):
    def save(self) -> None:
        """state.json, whole: the measuring threads save at once (two renamed one temp file, and one failed its
        job with FileNotFoundError; the state changed while it was dumped)."""
        with self.lock:
            tmp = self.state_path.with_suffix(f".{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(self.state, indent=1, default=str))
            os.replace(tmp, self.state_path)

    def finish(self) -> None:
        """The few files that come back: everything measured so far, whatever this call did."""
        self.save()
        out = self.out
        (out / "results.json").write_text(json.dumps(self.state, indent=1, default=str))
        evalf = self.work / "eval.jsonl"
        if not evalf.exists():
            return
        subs = subsets(evalf)
        plain_rows = self.state.get("done", {}).get("extract", {}).get("plain_rows_file")
        plain = [json.loads(x) for x in Path(plain_rows).read_text().splitlines()] if plain_rows else []
        n = record.pack(self.state.get("measured", {}), plain, out, subs)
        notes = self.notes()
        try:
            text, data = table.render(table.read_rows(out / "conversations.jsonl.xz"), margin=self.a.margin,
                                      notes=notes)
        except Exception as e:  # noqa: BLE001 - the rows came back; the table can be made on the CPU
            text, data = f"table failed: {e}\n{traceback.format_exc()[-2000:]}\n", {}
        bench = specbench.render(self.state.get("specbench", {}))
        text += ("\n" + bench) if bench else ""
        (out / "table.md").write_text(text)
        (out / "table.json").write_text(json.dumps(data, indent=1))
        logs = [*(self.work / "train").glob("*/train.log"), *REC.logs.glob("*.log"),
                *(self.work / "logs").glob("sf-*.log")]
        record.pack_logs(logs, out)
        self.log(f"packed {n} rows into {out}")

    def notes(self) -> list[str]:
        d = self.state.get("done", {})
        t, ex = d.get("target", {}), d.get("extract", {})
        notes = [f"Target: {t.get('params')} parameters, {t.get('steps')} steps ({t.get('epochs')} epochs), "
                 f"final loss {t.get('final_loss')}, weights sha256-of-listing "
                 f"{d.get('setup', {}).get('target_sha256', t.get('sha256'))}.",
                 f"Plain target's answers at the max_new_tokens cap ({self.a.max_new}): "
                 f"{ex.get('plain_at_cap')} of {ex.get('plain_answers')}; drafter chats' answers at the cap: "
                 f"{ex.get('regen', {}).get('at_cap')} of {ex.get('regen', {}).get('chats')}."]
        order = {k: v.get("same_order") for k, v in self.state.get("order", {}).items()}
        if order and not all(order.values()):
            notes.append(f"Data order NOT the same in: {[k for k, v in order.items() if not v]}.")
        return notes

    def run(self, phases: list[str]) -> int:
        fns = {"setup": self.setup, "corpus": self.corpus, "target": self.target_phase, "extract": self.extract,
               "launch_ours": self.launch_ours, "controls": self.controls, "fp8": self.fp8, "specforge": self.specforge,
               "serve_main": self.serve_main, "serve_long": self.serve_long, "serve_t1": self.serve_t1,
               "specbench": self.specbench, "greedy": self.greedy}
        rc = 0
        try:
            for ph in phases:
                if ph in self.state["done"]:
                    continue
                need = plan.estimate(ph, self.a) * self.a.estimate_factor
                if ph.startswith("serve") or ph in ("specbench", "greedy"):
                    need = self.a.job_seconds   # these phases do what fits and resume the rest
                if self.left() < need:
                    self.log(f"stopping before {ph}: {self.left():.0f}s left, it needs about {need:.0f}s; "
                             "run the same command again to continue")
                    return 0
                self.log(f"phase {ph} ({self.left():.0f}s left)")
                t = time.time()
                try:
                    res = fns[ph]()
                except Exception as e:  # noqa: BLE001 - recorded, the call ends; fix and resume
                    self.state.setdefault("errors", {})[ph] = traceback.format_exc()[-4000:]
                    self.log(f"phase {ph} FAILED: {e}")
                    if ph not in plan.OPTIONAL:
                        return 1
                    self.state["done"][ph] = {"failed": str(e)[-2000:], "phase_s": round(time.time() - t, 1)}
                    self.save()
                    continue
                if res.pop("_incomplete", None):
                    self.state.setdefault("partial", {})[ph] = res
                    self.log(f"phase {ph} not complete this call: run the same command again")
                    return 0
                self.state["done"][ph] = {**res, "phase_s": round(time.time() - t, 1)}
                self.save()
            self.log("all phases done")
        finally:
            self.finish()
        return rc


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", action="store_true", help="print the phases, their estimated seconds and the calls")
    ap.add_argument("--site", default=os.environ.get("SGLKIT_SITE", "/tmp/site"), help="the 0.5.16 site (patched)")
    ap.add_argument("--work", default="/tmp/loop")
    ap.add_argument("--out", default=os.environ.get("OUT", "loop-out"), help="the results directory of this call "
                    "(a run's id is added: one directory per run)")
    ap.add_argument("--phases", default=",".join(plan.NAMES))
    ap.add_argument("--deadline", type=float, default=540, help="seconds this call may run")
    ap.add_argument("--estimate-factor", type=float, default=1.0, help="scale the phase estimates")
    ap.add_argument("--job-seconds", type=float, default=200, help="a server's start and measurement: no job "
                    "starts with less time left")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--block", type=int, default=512, help="target training sequence length")
    ap.add_argument("--batch", type=int, default=64, help="target training batch (sequences)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--target-steps", type=int, default=400, help="the target's training steps (a fixed count)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-chars", type=int, default=900, help="the longest function (characters) a chat holds: "
                    "answers short enough to end well inside --max-new")
    ap.add_argument("--target-chats", type=int, default=80000)
    ap.add_argument("--drafter-chats", type=int, default=2000)
    ap.add_argument("--heldout", type=int, default=500, help="held-out chats in the eval set (plus HumanEval "
                    "and MT-Bench)")
    ap.add_argument("--max-new", type=int, default=384)
    ap.add_argument("--draft-steps", type=int, default=1000)
    ap.add_argument("--draft-batch", type=int, default=4)
    ap.add_argument("--draft-lr", type=float, default=5e-4)
    ap.add_argument("--seeds", type=int, default=3, help="trainings per arm for ours and SpecForge's capture")
    ap.add_argument("--control-seeds", default="1", type=_control_seeds,
                    help="trainings per control: N for each, or kind:N,... (a control not named gets 1), e.g. scaled:3")
    ap.add_argument("--controls", default="shuffled,zeroed,late,partial,scaled,prenorm")
    ap.add_argument("--fp8-compare", type=int, default=200, help="samples of the fp8 run compared row by row with "
                    "the bf16 run's (leave the fp8 arm out with --phases)")
    ap.add_argument("--aux-layers", default="2,4,5", help="ours' aux planes (the product's default for 8 layers)")
    ap.add_argument("--sf-shards", type=int, default=4, help="SpecForge capture processes side by side")
    ap.add_argument("--margin", type=float, default=0.05, help="the non-inferiority margin at (3,1,4)")
    ap.add_argument("--max-servers", type=int, default=14)
    ap.add_argument("--max-running", type=int, default=256, help="each server's --max-running-requests")
    ap.add_argument("--kv-tokens", type=int, default=262144, help="each server's --max-total-tokens")
    ap.add_argument("--bench-list", default="humaneval:164", help="SpecForge's benchmarks at batch 8")
    ap.add_argument("--bench-list-b1", default="humaneval:40", help="... and at batch 1 (sequential: slower)")
    ap.add_argument("--port", type=int, default=31000)
    ap.add_argument("--shm", default="/dev/shm", help="where the capture and samples dirs go")
    ap.add_argument("--device", default="cuda", help="where the target trains")
    ap.add_argument("--carry", default=str(ROOT / ".loopcarry"), help="tests/gpu/loop/build_carry.sh's output")
    return ap


def _control_seeds(spec: str) -> str:
    """--control-seeds checked when the command is read, not when the controls phase reaches it."""
    try:
        for kind in controls.CONTROLS:
            controls.seeds_for(spec, kind)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return spec


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    work = Path(a.work)
    state = json.loads((work / "state.json").read_text()) if (work / "state.json").exists() else None
    if a.plan:
        print(plan.render(a, (state or {}).get("done")))
        return 0
    work.mkdir(parents=True, exist_ok=True)
    run_id = (state or {}).get("run_id") or time.strftime("run-%Y%m%d-%H%M%S")
    a.out = str(Path(a.out) / run_id)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    REC.out = Path(a.out)
    REC.logs = work / "logs"
    REC.logs.mkdir(exist_ok=True)
    loop = Loop(a, run_id)
    # a call cut by its time limit (`timeout` sends SIGTERM) still packs what it measured into --out
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return loop.run([p for p in a.phases.split(",") if p])
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminated(signum: int, frame: object) -> None:
    REC.log("SIGTERM: stopping; what was measured so far is packed into --out, the phase under way is not done")
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
