"""Sample length limits: the server's own (as SGLang reports it), its KV cache, and the cheap character bound."""

from __future__ import annotations

import pytest

from hs_patch.engine import kv_cache
from hs_patch.host.driver import dataset, limits, runstate
from hs_patch.host.driver.run import EXIT_OK
from lab.drive_runs import drive
from lab.runcheck import write_chats
from lab.standin_engine import Engine
from lab.standin_server import StandinServer


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


# --- the server's KV cache (hs_patch.engine.kv_cache): fab extract and the driver refuse a pool smaller than a sample


def test_a_kv_cache_smaller_than_the_longest_sample_is_named_with_what_to_change():
    # /server_info of SGLang 0.5.9/0.5.16/0.5.23: scheduler_info's max_total_num_tokens, server_args'
    # context_length (null unless given) and mem_fraction_static
    info = {"max_total_num_tokens": 17000, "context_length": None, "mem_fraction_static": 0.772}
    msg = kv_cache.shortfall(info, 32768)
    assert msg.startswith("the server's KV cache holds 17000 tokens (max_total_num_tokens), fewer than the 32769")
    assert "sglang_service_mem_fraction_static (now 0.772)" in msg and "sglang_service_cuda_graph_max_bs" in msg
    assert "--max-tokens 16999" in msg
    assert "(systemctl restart UNIT, the host's sglang_service_name)" in msg  # the driver does not know the unit
    assert "(systemctl restart sglang-kimi)" in kv_cache.shortfall(info, 32768, service="sglang-kimi")  # fab does
    assert kv_cache.shortfall({**info, "max_total_num_tokens": 32769}, 32768) is None
    assert kv_cache.shortfall({**info, "context_length": 16000}, 32768) is None  # no sample is longer than that
    assert kv_cache.shortfall({"context_length": 4096}, 32768) is None  # the server does not say: not refused


@pytest.fixture
def small_kv_standin(tiny_model_dir, tmp_path):
    srv = StandinServer(Engine(str(tiny_model_dir), str(tmp_path / "capture"), release="0.5.16",
                               chunked_prefill_size=48, batch_window_ms=3, max_total_num_tokens=300)).start()
    yield srv
    srv.close()


def test_the_driver_refuses_a_server_whose_kv_cache_cannot_hold_its_longest_sample(small_kv_standin, tiny_model_dir,
                                                                                    tmp_path):
    data = tmp_path / "chats.jsonl"
    write_chats(data, 2)
    with pytest.raises(runstate.RunError, match="KV cache holds 300 tokens .* fewer than the 513 .*--max-tokens 299"):
        drive(small_kv_standin, tiny_model_dir, tmp_path, [data], max_tokens=512)
    summary = drive(small_kv_standin, tiny_model_dir, tmp_path, [data], max_tokens=256)  # fits: the run goes on
    assert summary.exit_code == EXIT_OK, summary.message
