"""The driver's tokenizer is AutoTokenizer's, loaded without transformers' auto classes where that is the same.

A model whose tokenizer is its own code (Kimi's, here the lab's stand-in of it: lab/remote_tokenizer.py)
gets the class AutoTokenizer gives, with the same vocabulary, special tokens, chat template, rendering, ids
and loss mask, without importing ``transformers.models.auto`` (and with it the generation utilities, torch
and scikit-learn: most of the driver's start-up, issue #36). Every other directory goes through AutoTokenizer.
"""

from __future__ import annotations

import json
import os
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
    assert type(short).__name__ == "StandinTikTokenizer" and not short.is_fast and tokenizer.way(short) == "own code"
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


def _variant(base: Path, dest: Path, **config) -> Path:
    """The tiny model's directory with its tokenizer_config.json changed."""
    dest.mkdir()
    for f in base.iterdir():
        if f.name != "model.safetensors":
            (dest / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((base / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**cfg, **config}))
    return dest


@pytest.mark.parametrize("tokenizer_class",
                         [None, "LlamaTokenizerFast", "Qwen2TokenizerFast", "PreTrainedTokenizerFast"])
def test_autotokenizers_choice_is_remembered_and_the_next_load_is_the_same(tiny_model_dir, tmp_path, monkeypatch,
                                                                          tokenizer_class):
    """The class AutoTokenizer picks (TokenizersBackend for a byte-level file declared as Llama's, Qwen2's own...)
    is remembered; the next load calls it without AutoTokenizer and gives the same tokenizer."""
    from transformers import AutoTokenizer

    monkeypatch.setenv(tokenizer.CACHE_ENV, str(tmp_path / "cache"))
    d = tiny_model_dir if tokenizer_class is None else _variant(tiny_model_dir, tmp_path / "m",
                                                                 tokenizer_class=tokenizer_class)
    auto = AutoTokenizer.from_pretrained(str(d))
    first = chat.load_tokenizer(str(d))
    same_tokenizer(first, auto)
    assert (tokenizer.way(first), tokenizer.way(auto)) == ("AutoTokenizer", None)
    remembered = json.loads(tokenizer.cache_path().read_text())
    assert list(remembered.values()) == [f"{type(auto).__module__}:{type(auto).__qualname__}"]

    def refuse(*a, **k):
        raise AssertionError("AutoTokenizer asked again")

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    again = chat.load_tokenizer(str(d))
    same_tokenizer(again, auto)
    assert tokenizer.way(again) == "remembered"


def test_a_changed_directory_or_flag_asks_autotokenizer_again(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizer.CACHE_ENV, str(tmp_path / "cache"))
    d = _variant(tiny_model_dir, tmp_path / "m")
    keys = {tokenizer.choice_key(d, False, "5.0")}
    chat.load_tokenizer(str(d))
    assert len(json.loads(tokenizer.cache_path().read_text())) == 1
    for change in (lambda: (d / "tokenizer_config.json").write_text('{"tokenizer_class": "Qwen2TokenizerFast"}'),
                   lambda: (d / "tekken.json").write_text("{}"),  # a file whose presence a choice reads
                   lambda: (d / "config.json").write_text((d / "config.json").read_text() + " ")):
        change()
        keys.add(tokenizer.choice_key(d, False, "5.0"))
    (d / "configuration_x.py").write_text("X = 1\n")  # a remote config class sets the model type
    keys.add(tokenizer.choice_key(d, False, "5.0"))
    (d / "configuration_x.py").write_text("X = 2\n")
    keys |= {tokenizer.choice_key(d, False, "5.0"), tokenizer.choice_key(d, True, "5.0"),
             tokenizer.choice_key(d, False, "5.1"), tokenizer.choice_key(str(d) + "/", False, "5.0")}
    # a backend installed beside transformers (mistral-common makes Mistral's directories MistralCommonBackend's)
    found = tokenizer.packages()
    monkeypatch.setattr(tokenizer, "packages", lambda: {**found, "mistral_common": "1.11.5"})
    keys.add(tokenizer.choice_key(d, False, "5.0"))
    assert len(keys) == 10
    monkeypatch.undo()
    monkeypatch.setenv(tokenizer.CACHE_ENV, str(tmp_path / "cache"))
    loaded = chat.load_tokenizer(str(d))  # the changed config: AutoTokenizer's choice again, remembered beside
    assert type(loaded).__name__ == "Qwen2Tokenizer"
    assert len(json.loads(tokenizer.cache_path().read_text())) == 2


def test_the_remembered_way_imports_no_auto_class_no_generation_no_torch(tiny_model_dir, tmp_path):
    env = {**os.environ, tokenizer.CACHE_ENV: str(tmp_path / "cache")}
    probe = ("import json, sys; from hs_patch.host.driver import chat; "
             f"t = chat.load_tokenizer({str(tiny_model_dir)!r}); "
             "print(json.dumps([type(t).__name__, {m: m in sys.modules for m in ('transformers.models.auto', "
             "'transformers.generation', 'torch', 'sklearn')}]))")
    runs = [subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                           env=env) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    first, second = (json.loads(r.stdout.strip().splitlines()[-1]) for r in runs)
    assert first[0] == second[0] == "TokenizersBackend" and first[1]["transformers.models.auto"]
    assert second[1] == {"transformers.models.auto": False, "transformers.generation": False, "torch": False,
                         "sklearn": False}


def test_a_cache_that_cannot_be_read_or_written_costs_the_short_way_only(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                                         monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv(tokenizer.CACHE_ENV, str(cache))
    cache.mkdir()
    key = tokenizer.choice_key(tiny_model_dir, False, __import__("transformers").__version__)
    for text in ("{not json", "[" * 200000, json.dumps([1]), json.dumps({key: "os:system"}),
                 json.dumps({key: "transformers.x:Y"}),
                 json.dumps({key: "transformers.configuration_utils:PreTrainedConfig"}),
                 json.dumps({key: "transformers.utils:logging"})):
        tokenizer.cache_path().write_text(text)
        same_tokenizer(chat.load_tokenizer(str(tiny_model_dir)), tiny_tokenizer)
        assert json.loads(tokenizer.cache_path().read_text())[key].endswith(":TokenizersBackend")
    tokenizer.cache_path().unlink()
    cache.chmod(0o500)
    try:
        if os.access(cache, os.W_OK):  # root writes anyway: a file in the way of the directory instead
            cache.chmod(0o700)
            monkeypatch.setenv(tokenizer.CACHE_ENV, str(tmp_path / "in-the-way" / "x"))
            (tmp_path / "in-the-way").write_text("")
        same_tokenizer(chat.load_tokenizer(str(tiny_model_dir)), tiny_tokenizer)
    finally:
        cache.chmod(0o700)
    err = capsys.readouterr().err
    assert "could not remember the tokenizer's class" in err and tokenizer.CACHE_ENV in err


def test_a_remembered_class_that_fails_to_load_falls_back_to_autotokenizer(tiny_model_dir, tiny_tokenizer, tmp_path,
                                                                           monkeypatch):
    from transformers import TokenizersBackend

    class Broken(TokenizersBackend):
        @classmethod
        def from_pretrained(cls, *a, **k):
            raise OSError("gone")

    monkeypatch.setenv(tokenizer.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer, "_cached_class", lambda key: Broken)
    same_tokenizer(chat.load_tokenizer(str(tiny_model_dir)), tiny_tokenizer)


def _remember_one(cache: str, i: int) -> None:
    os.environ[tokenizer.CACHE_ENV] = cache
    from transformers import TokenizersBackend

    tokenizer._remember(f"key-{i}", TokenizersBackend)


def test_drivers_starting_side_by_side_keep_each_others_entries(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_remember_one, args=(str(tmp_path / "cache"), i)) for i in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 6
    cached = json.loads((tmp_path / "cache" / "tokenizer-classes.json").read_text())
    assert sorted(cached) == [f"key-{i}" for i in range(6)]
