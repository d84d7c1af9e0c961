"""The loop's phases in the order they run, what each costs on one H200 and what that estimate rests on.

Phases marked ``bg`` leave processes running in their own sessions (trainings, SpecForge's capture):
they go on across calls while the machine stays warm (it is given back 30 s after a call: chain the
calls). A call stops before a phase its time left cannot hold; the same command resumes.
"""

from __future__ import annotations

import argparse

# name, estimate in seconds (with the defaults), what it rests on
PHASES: list[tuple[str, float, str]] = [
    ("setup", 20, "SpecForge wheels to their --target (5 s); SGLang 0.5.14 site built in the background"),
    ("corpus", 10, "2026-12-05: 6.8 s"),
    ("target", 0, "tokenizer 10 s + --target-steps x 0.46 s (2026-12-04, H200: 283 steps in 130 s of 32K tokens, "
                  "alone on the GPU; 2026-12-06, H100: 400 steps in 112 s, the phase 129 s) + save; a "
                  "random-weights server compiles the Triton kernels meanwhile (107 s)"),
    ("extract", 200, "2026-12-06, H100: 185 s (server 44 s, answers 37 s, drive 90 s for 448K tokens at 6 "
                     "planes). Capture server 50 s with the kernels compiled (149.5 s without, 2026-12-04), the "
                     "target's answers to the drafter prompts and the eval prompts 45 s (38.9 s for 2,000), drive "
                     "70 s (66 s for 600K tokens at 3 planes; 6 planes here), export 16 s; SpecForge's capture "
                     "starts in the background as soon as the chats exist"),
    ("launch_ours", 15, "ordered links (reads each file once) and the trainings started"),
    ("controls", 65, "a control, written side by side with the others, each training started as it ends (scaled "
                     "by --controls): six 3.7 GB controls 387 s on 2026-12-06 (H100 host, --work on its disk, ten "
                     "trainings starting beside it; each file fsynced); two in /dev/shm 112 s on 2026-12-07 "
                     "(scaled 109 s, prenorm 22 s, SpecForge's capture beside them)"),
    ("fp8", 220, "issue #35: a second capture server with HS_CAPTURE_DTYPE=fp8 (50 s, beside the trainings and "
                 "SpecForge's capture), its drive, export 16 s, the two runs' samples compared; its trainings "
                 "started. 2026-12-06, H100, beside ours' five trainings: server 47 s, drive 123 s (bf16's, "
                 "alone: 87 s), the phase 190 s"),
    ("specforge", 175, "waits for SpecForge's capture in --sf-shards shards (2026-12-05: 310 s in one "
                       "process at batch size 1 beside the trainings; 2026-12-06, H100: 134 s in 4 shards, "
                       "the phase 171 s with the agreement check)"),
    ("serve_main", 0, "every arm at (3,1,4), each as its training ends: SpecForge's trainings end last (30 s "
                      "start + --draft-steps x 0.25 s: 0.14-0.16 s a step with 6 at once on 2026-12-04, 13 at once "
                      "not measured), then export 10 s, server 60-110 s (2026-12-04/05), accept on ~750 prompts "
                      "60 s; 2026-12-06, H100: 302 s for 13 drafters in two waves of --max-servers 8 (servers up "
                      "in 101-106 s eight at once, 70-75 s five at once; accept 33-65 s)"),
    ("serve_long", 200, "ours and SpecForge's seeds at (7,1,8): server 60-85 s, accept 60 s"),
    ("serve_t1", 150, "ours-s0 and prenorm at temperature 1, (3,1,4)"),
    ("specbench", 240, "SpecForge's bench_eagle3.py on ours-s0 and specforge-s0, (3,1,4) and (7,1,8), batch 8 "
                       "(HumanEval 164) and 1 (HumanEval 40), beside hs-extract accept on the same prompts"),
    ("greedy", 150, "ours-s0 at (3,1,4) with --plain: the greedy check with near-ties (a plain server)"),
]
NAMES = [p[0] for p in PHASES]
MAIN = ["setup", "corpus", "target", "extract", "launch_ours", "controls", "fp8", "specforge", "serve_main"]
OPTIONAL = {"fp8": "the fp8 arm (issue #35): its failure is recorded and the loop goes on without it"}


def estimate(name: str, a: argparse.Namespace) -> float:
    base = dict((n, s) for n, s, _ in PHASES)[name]
    if name == "target":
        return 40 + a.target_steps * 0.46
    if name == "controls":
        return base * max(1, len([k for k in a.controls.split(",") if k]))
    if name == "serve_main":   # the last trainings (SpecForge's, started at the end of its phase), then servers
        return 30 + a.draft_steps * 0.25 + 150
    return base


def render(a: argparse.Namespace, done: dict | None = None) -> str:
    done = done or {}
    phases = [p for p in a.phases.split(",") if p]
    lines = [f"{'phase':<12} {'est. s':>7}  {'cumul.':>7}  basis"]
    total = 0.0
    for n, _, why in PHASES:
        if n not in phases:
            continue
        s = 0.0 if n in done else estimate(n, a)
        total += s
        lines.append(f"{n:<12} {s:>7.0f}  {total:>7.0f}  {'(done) ' if n in done else ''}{why}")
    calls = []
    left, k = 0.0, 0
    for n in phases:
        s = 0.0 if n in done else estimate(n, a)
        if k == 0 or left + s > a.deadline:
            k += 1
            calls.append([])
            left = 0.0
        calls[-1].append(n)
        left += s
    lines += ["", f"about {total:.0f} s of commands ({total / 60:.1f} min) plus the machine's start (60-180 s); in "
              f"calls of --deadline {a.deadline:.0f} s:"]
    lines += [f"  call {i + 1}: {', '.join(c)}" for i, c in enumerate(calls)]
    lines.append(f"the main table (ours vs SpecForge x {a.seeds} seeds, the controls, at (3,1,4)) is complete after "
                 "serve_main; every call packs what it has measured so far into --out")
    return "\n".join(lines)
