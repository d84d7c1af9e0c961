"""The driver's tokenizer is AutoTokenizer's, loaded without transformers' auto classes where that is the same.

A model whose tokenizer is its own code (Kimi's, here the lab's stand-in of it: lab/remote_tokenizer.py)
gets the class AutoTokenizer gives, with the same vocabulary, special tokens, chat template, rendering, ids
and loss mask, without importing ``transformers.models.auto`` (and with it the generation utilities, torch
and scikit-learn: most of the driver's start-up, issue #36). Every other directory goes through AutoTokenizer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hs_patch.host.driver import chat, tokenizer
from lab.remote_tokenizer import make_remote_tokenizer_dir

ROOT = Path(__file__).resolve().parents[2]
CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital."}, {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "hello world"}]


@pytest.fixture(scope="module")
def remote_dir(tiny_model_dir, tmp_path_factory) -> Path:
    return make_remote_tokenizer_dir(tiny_model_dir, tmp_path_factory.mktemp("remote") / "model")


def same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab() and len(a) == len(b) and a.is_fast == b.is_fast
    assert a.all_special_tokens == b.all_special_tokens and a.special_tokens_map == b.special_tokens_map
    assert a.chat_template == b.chat_template and a.init_kwargs == b.init_kwargs
    assert getattr(type(a), "_auto_class", None) == getattr(type(b), "_auto_class", None)
    for gen in (False, True):
        assert chat.render(a, CONV[:4], generation_prompt=gen) == chat.render(b, CONV[:4], generation_prompt=gen)
    ea, eb = chat.encode_chat(a, CONV), chat.encode_chat(b, CONV)
    assert (ea.input_ids, ea.loss_mask, ea.text) == (eb.input_ids, eb.loss_mask, eb.text)
    assert chat.generation_prompt(a, CONV[:2]) == chat.generation_prompt(b, CONV[:2])


def test_remote_code_loads_autotokenizers_class_by_the_short_way(remote_dir, tiny_tokenizer):
    from transformers import AutoTokenizer

    short = chat.load_tokenizer(str(remote_dir), trust_remote_code=True)
    auto = AutoTokenizer.from_pretrained(str(remote_dir), trust_remote_code=True)
    assert type(short).__name__ == "StandinTikTokenizer" and not short.is_fast
    same_tokenizer(short, auto)
    # and it is the tiny model's tokenizer: the same ids as the fast one, so the stand-in server's model fits
    assert chat.encode_chat(short, CONV).input_ids == chat.encode_chat(tiny_tokenizer, CONV).input_ids


def test_the_short_way_imports_no_auto_class_no_generation_no_torch(remote_dir):
    """In a fresh interpreter: what the driver's start-up imports to load a remote-code tokenizer (the code before
    this change imported transformers.models.auto, its generation utilities and torch)."""
    probe = ("import json, sys; from hs_patch.host.driver import chat; "
             f"chat.load_tokenizer({str(remote_dir)!r}, True); "
             "print(json.dumps({m: m in sys.modules for m in ('transformers.models.auto', "
             "'transformers.generation', 'torch', 'sklearn')}))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "transformers.models.auto": False, "transformers.generation": False, "torch": False, "sklearn": False}


def test_other_directories_go_through_autotokenizer(tiny_model_dir, tiny_tokenizer, remote_dir, tmp_path):
    assert tokenizer.remote_class_ref(tiny_model_dir) is None
    same_tokenizer(chat.load_tokenizer(str(tiny_model_dir)), tiny_tokenizer)
    # remote code not trusted: AutoTokenizer's refusal, with the hint
    with pytest.raises(ValueError, match="--trust-remote-code"):
        chat.load_tokenizer(str(remote_dir))
    # a tokenizer_class naming another class than the code's (5.x registers its aliases first), another
    # repository's code: AutoTokenizer's way
    cfg = json.loads((remote_dir / "tokenizer_config.json").read_text())
    for change in ({"tokenizer_class": "PreTrainedTokenizerFast"},
                   {"auto_map": {"AutoTokenizer": ["other/repo--tokenization_x.X", None]}}):
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **change}))
        assert tokenizer.remote_class_ref(d) is None
    assert tokenizer.remote_class_ref(remote_dir) == "tokenization_standin.StandinTikTokenizer"
