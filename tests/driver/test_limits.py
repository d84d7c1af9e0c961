"""Sample length limits: the server's own (as SGLang reports it) and the cheap character bound."""

from __future__ import annotations

import pytest

from hs_patch.host.driver import dataset, limits


def test_the_server_limit_is_read_from_sglang_server_info_fields():
    # /get_server_info of SGLang 0.5.9/0.5.16/0.5.23: scheduler_info's max_req_input_len (a prompt of that
    # many tokens is aborted) and server_args.context_length (null unless the server was given one)
    assert limits.server_limit({"max_req_input_len": 4090, "context_length": None}) == 4089
    assert limits.server_limit({"max_req_input_len": 4090, "context_length": 1000}) == 998
    assert limits.server_limit({}) is None
    lim = limits.effective(32768, {"max_req_input_len": 300})
    assert lim.tokens == 299 and "server's limit of 299 tokens" in lim.why and "--max-tokens is 32768" in lim.why
    assert limits.effective(200, {"max_req_input_len": 300}) == limits.Limit(200, "--max-tokens 200")


def test_the_character_bound_is_exact_and_refuses_before_tokenizing(tiny_tokenizer):
    longest = limits.longest_token_chars(tiny_tokenizer)
    assert longest == max(len(t) for t in tiny_tokenizer.get_vocab())
    lim = limits.Limit(10, "--max-tokens 10")
    limits.check_chars([{"role": "user", "content": "x" * 10 * longest}], lim, longest)  # may fit: not refused
    with pytest.raises(dataset.Invalid) as e:
        limits.check_chars([{"role": "user", "content": "x" * (10 * longest + 1)}], lim, longest)
    assert e.value.reason == "too_long" and "not tokenized" in str(e.value)
    # the bound never refuses what fits: the text's real token count is at least chars / longest
    text = "The quick brown fox jumps over the lazy dog. " * 40
    assert len(tiny_tokenizer(text)["input_ids"]) >= len(text) / longest


class NoVocab:
    def get_vocab(self):
        raise NotImplementedError


def test_a_tokenizer_without_a_vocabulary_gets_a_generous_bound():
    assert limits.longest_token_chars(NoVocab()) == limits.UNKNOWN_TOKEN_CHARS
