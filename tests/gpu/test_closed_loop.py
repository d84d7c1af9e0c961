"""The closed loop's GPU script (tests/gpu/closed_loop.py), rehearsed on the CPU.

CI has no GPU and SpecForge's trainer needs one (FSDP), so this runs the loop's own glue on
stand-in servers: the extract phase (the target's greedy answers through a capturing server
without capturing them, ``hs-extract drive`` over those chats with the default capture,
``export --format specforge``, ``drafter-config``), the variants phase (transformers states,
the one-layer-late and pre-norm mistakes, paired sample by sample), and the serve and table
phases (EAGLE-3 stand-ins at two settings and a plain one, ``hs-extract accept`` against each).
It checks the mechanics and what each file holds, not the accept lengths. The specforge phase's
own glue is checked here too: SpecForge's preprocessing with ``lfm`` tokenizes the loop's chats as
our driver does, and the 0.5.14 site is assembled from the kit without touching it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

import closed_loop  # noqa: E402
import common  # noqa: E402
from loop import corpus, features, specforge  # noqa: E402
from test_gpu_scripts import free_port_block  # noqa: E402


@pytest.fixture
def loop_env(release_sources, tmp_path, monkeypatch):
    from lab.tiny_model import make_tiny_model_dir

    site = tmp_path / "site"
    shutil.copytree(release_sources["0.5.16"], site)
    monkeypatch.setattr(common.Server, "LAUNCHER", [sys.executable, str(ROOT / "tests/lab/standin_server.py"),
                                                   "--accept-sglang-flags", "--release", "0.5.16", "--threads", "1"])
    work = tmp_path / "work"
    make_tiny_model_dir(work / "target", layers=8)  # deep enough for three distinct default planes, and one late
    chats = [{"messages": [{"role": "user", "content": f"write function {i} that adds {i} to x"},
                           {"role": "assistant", "content": "unused: the target's own answer replaces it"}]}
             for i in range(4)]
    corpus.write_jsonl(work / "drafter_prompts.jsonl", chats)
    corpus.write_jsonl(work / "heldout.jsonl", [{"messages": c["messages"][:1]} for c in chats[:3]])
    argv = ["--site", str(site), "--work", str(work), "--out", str(tmp_path / "out"), "--device", "cpu",
            "--shm", str(tmp_path / "shm"),
            "--port", str(free_port_block(12)), "--max-new", "6", "--settings", "3,1,4;7,1,8"]
    return work, argv


@pytest.mark.slow
def test_extract_variants_serve_and_table_phases_run_on_standins(loop_env, monkeypatch):
    work, argv = loop_env
    assert closed_loop.main([*argv, "--phases", "extract,variants"]) == 0
    state = json.loads((work / "state.json").read_text())
    ext = state["done"]["extract"]
    assert ext["layers"] == [2, 4, 5], "the default capture of an 8-layer model is SGLang's own [2, n//2, n-3]"
    assert ext["drafter_config"]["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert ext["regen"]["chats"] == 4 and ext["features"]["files"] == 4, ext
    ours, hf, late, pre = (work / "feat" / v for v in ("ours", "hf", "late", "prenorm"))
    names = [p.relative_to(ours) for p in features.ckpts(ours)]
    assert names == [p.relative_to(hf) for p in features.ckpts(hf)] == [p.relative_to(pre) for p in features.ckpts(pre)]
    for rel in names:
        a, b, c, d = (features.load(root / rel) for root in (ours, hf, late, pre))
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], d["loss_mask"])
        assert a["aux_hidden_state"].shape == b["aux_hidden_state"].shape == c["aux_hidden_state"].shape
        assert not torch.equal(b["aux_hidden_state"], c["aux_hidden_state"]), "late is another layer's state"
        assert torch.equal(a["aux_hidden_state"], d["aux_hidden_state"]) and not torch.equal(
            a["hidden_state"], d["hidden_state"]), "prenorm changes only the teacher's state"
        cos = torch.nn.functional.cosine_similarity(a["aux_hidden_state"].float(), b["aux_hidden_state"].float(), -1)
        assert float(cos.min()) > 0.99, "SGLang's path (patched forward) and transformers agree"
    head = features.lm_head_of(work / "target")
    agree = features.agreement(ours, pre, head, "cpu")
    assert agree["paired"] == 4 and agree["loss_masks_equal"] == 4 and agree["positions"] > 0

    # what the drafters phase leaves (SpecForge's trainer needs a GPU): two exported drafters
    state["done"]["drafters"] = {"export": {}, "agreement": {"prenorm": agree}}
    for name, acc in (("ours-s0", 0.9), ("untrained", 0.0)):
        d = work / "drafters" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"],
                                                   "standin_draft_accuracy": acc}))
        state["done"]["drafters"]["export"][name] = {"rc": 0}
    (work / "state.json").write_text(json.dumps(state))
    assert closed_loop.main([*argv, "--phases", "serve,table"]) == 0
    runs = json.loads((work / "state.json").read_text())["done"]["serve"]["runs"]
    assert sorted(runs) == ["ours-s0@3,1,4", "ours-s0@7,1,8", "untrained@3,1,4", "untrained@7,1,8"]
    for k, r in runs.items():
        assert r["rc"] == 0 and r["measured"] == 3 and r["greedy"]["identical"] == 3, (k, r)
        assert r["server_settings"]["speculative_num_draft_tokens"] == (4 if "3,1,4" in k else 8)
    # a drafter never right: 6 tokens, the first from the prefill pass, 5 verify passes (SGLang counts the same)
    assert runs["untrained@3,1,4"]["accept_length"] == 1.2 < runs["ours-s0@3,1,4"]["accept_length"]
    table = (work.parent / "out" / "table.md").read_text()
    assert "| ours-s0 |" in table and "| untrained | 1.200 | 1.200 |" in table



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


def test_table_names_only_the_drafters_the_run_has():
    """A run without the variants phase (--phases ...,specforge,...) describes no transformers or
    mistake rows it does not have."""
    import argparse

    from loop.report import render

    runs = {f"{n}@3,1,4": {"accept_length": x, "greedy": {"identical": 60, "compared": 64, "near_tie": 4}}
            for n, x in (("ours-s0", 3.4), ("ours-s1", 3.39), ("specforge", 3.38), ("untrained", 1.006))}
    state = {"done": {"serve": {"runs": runs}, "drafters": {"agreement": {"specforge": {
        "teacher_argmax_agreement": 0.9982, "aux_cosine_mean": 0.99998}}}, "target": {"params": 1}}}
    text = render(state, argparse.Namespace(settings="3,1,4"))
    assert "| specforge | 3.380 | 60/64 (4) | 0.9982 | 1.0000 |" in text
    assert "- specforge:" in text and "- untrained:" in text and "- ours:" in text
    assert "- hf:" not in text and "- late:" not in text and "- prenorm:" not in text
    assert "run-to-run spread of ours at 3,1,4: 3.390-3.400 (2 seeds)" in text
