"""--regenerate builds the sample from the server's own ids (hs_patch/host/driver/regenerate.py): the prompt as
sent, the answer as generated, with the tiny model's tokenizer and two chat templates, its own (which renders a
completed turn as it was generated) and a Kimi-K2.5-like one (which renders an earlier turn as <think></think> +
its content, the reasoning dropped). The server is a function here; tests/driver/test_driver.py runs it against
the stand-in server."""

from __future__ import annotations

import json

import pytest

from hs_patch.host.driver import chat, dataset, regenerate
from hs_patch.host.driver.client import ClientError

K25_LIKE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user and m.get('reasoning_content') -%}<think>{{ m['reasoning_content'] }}</think>"
    "{%- else -%}<think></think>{%- endif -%}{{ m['content'] }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

CHAT = [{"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "(the dataset's answer, replaced)"},
        {"role": "user", "content": "How many legs has a spider?"},
        {"role": "assistant", "content": "(replaced too)"}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    """The tiny model's tokenizer, with <think> and </think> as special tokens (as Kimi-K2.5's has them)."""
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    t.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return t


def server(tok, answers):
    """A /generate that answers turn k with the ids of answers[k] (text, or ids), recording the prompts."""
    prompts = []

    def generate(prompt, turn):
        prompts.append(prompt)
        a = answers[len(prompts) - 1]
        ids = a if isinstance(a, list) else chat.encode_text(tok, a)
        return {"text": tok.decode(ids, skip_special_tokens=True), "output_ids": ids,
                "meta_info": {"completion_tokens": len(ids)}}
    return generate, prompts


def test_a_template_that_renders_turns_as_generated_keeps_every_answer_in_one_sample(tok):
    generate, prompts = server(tok, ["Paris is the capital of France.<|im_end|>", "Eight.<|im_end|>"])
    built = regenerate.regenerate(tok, CHAT, generate)
    assert (built.kept, built.dropped) == (2, 0)
    answers = [{"role": "assistant", "content": "Paris is the capital of France."},
               {"role": "assistant", "content": "Eight."}]
    expected = chat.encode_chat(tok, [CHAT[0], answers[0], CHAT[2], answers[1]])
    assert built.input_ids == expected.input_ids and built.loss_mask == expected.loss_mask
    assert prompts[1] == built.input_ids[:len(prompts[1])]   # turn 2 was asked with turn 1's answer as generated


def test_thinking_answers_keep_their_reasoning_tokens_and_a_rewritten_turn_is_left_out(tok):
    """The K2.5 case: the answer's <think>R</think> is in the sample as generated (the text had lost both tags);
    the next prompt renders turn 1 as <think></think>A, so the sample restarts there and keeps turn 2 only."""
    out = ["<think>France, capital: Paris.</think>Paris.<|im_end|>", "<think>Spiders have eight.</think>Eight.<|im_end|>"]
    generate, prompts = server(tok, out)
    built = regenerate.regenerate(tok, CHAT, generate, {"chat_template": K25_LIKE})
    assert (built.kept, built.dropped) == (1, 1)
    second = chat.encode_text(tok, out[1])
    assert built.input_ids == prompts[1] + second
    assert built.loss_mask == [0] * len(prompts[1]) + [1] * len(second)
    rendered = tok.decode(prompts[1])
    assert "<think></think>Paris.<|im_end|>" in rendered and "France, capital" not in rendered
    think, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    assert built.input_ids[len(prompts[1])] == think and end in built.input_ids[len(prompts[1]):]


def test_a_generated_answer_goes_back_as_content_and_reasoning_content(tok):
    ids = chat.encode_text(tok, "<think> France, capital: Paris. </think> Paris.<|im_end|>")
    assert regenerate.history_message(tok, ids) == {"role": "assistant", "content": "Paris.",
                                                    "reasoning_content": "France, capital: Paris."}
    plain = chat.encode_text(tok, "Paris.<|im_end|>")
    assert regenerate.history_message(tok, plain) == {"role": "assistant", "content": "Paris."}


def test_without_a_reasoning_end_token_nothing_is_split(tiny_tokenizer):
    """The tiny tokenizer has no </think> token: the text "</think>" is content like any other."""
    ids = chat.encode_text(tiny_tokenizer, "a </think> b<|im_end|>")
    assert regenerate.history_message(tiny_tokenizer, ids) == {"role": "assistant", "content": "a </think> b"}


def test_an_answer_tokenized_otherwise_than_its_text_encodes_restarts_the_sample(tok):
    """A model may generate a tokenization of its text that encoding the text does not give back: the next prompt
    (the text encoded) does not start with the sample, so the sample keeps the prompt of the last turn whole and the
    earlier answer is left out, never a sequence the server did not see."""
    odd = [t for ch in "Paris" for t in chat.encode_text(tok, ch)] + chat.encode_text(tok, "<|im_end|>")
    assert odd != chat.encode_text(tok, "Paris<|im_end|>")
    generate, prompts = server(tok, [odd, "Eight.<|im_end|>"])
    built = regenerate.regenerate(tok, CHAT, generate)
    assert (built.kept, built.dropped) == (1, 1)
    assert built.input_ids[:len(prompts[1])] == prompts[1]


def test_the_answer_ids_come_from_output_ids_or_the_logprobs(tok):
    assert regenerate.answer_ids({"output_ids": [5, 6], "meta_info": {}}) == [5, 6]
    lp = {"meta_info": {"output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, None]], "completion_tokens": 2}}
    assert regenerate.answer_ids(lp) == [7, 8]
    with pytest.raises(ClientError, match="without the generated token ids"):
        regenerate.answer_ids({"text": "x", "meta_info": {"completion_tokens": 3}})
    assert regenerate.answer_ids({"text": "", "meta_info": {"completion_tokens": 0}}) == []
    # the end-of-turn token the server stopped at is in the answer whether or not its ids carry it
    eos = {"type": "stop", "matched": 2}
    assert regenerate.answer_ids({"output_ids": [5, 6], "meta_info": {"finish_reason": eos}}) == [5, 6, 2]
    assert regenerate.answer_ids({"output_ids": [5, 2], "meta_info": {"finish_reason": eos}}) == [5, 2]
    by_text = {"type": "stop", "matched": "</answer>"}
    assert regenerate.answer_ids({"output_ids": [5], "meta_info": {"finish_reason": by_text}}) == [5]
    length = {"type": "length", "length": 2}
    assert regenerate.answer_ids({"output_ids": [5, 6], "meta_info": {"finish_reason": length}}) == [5, 6]


def test_no_answer_at_all_is_a_reject(tok):
    generate, _ = server(tok, [[], []])
    with pytest.raises(dataset.Invalid) as e:
        regenerate.regenerate(tok, CHAT, generate)
    assert e.value.reason == "no_assistant_turn"
    with pytest.raises(dataset.Invalid):
        regenerate.regenerate(tok, CHAT[:1], generate)


def test_a_datasets_reasoning_content_is_rendered_where_the_template_puts_it(tok):
    """Without --regenerate, a line's reasoning_content reaches the template: the K2.5-like one renders it in the
    last answer (the loss on <think>R</think>A<|im_end|> as the model generated it) and drops it from the earlier."""
    line = {"messages": [CHAT[0], {"role": "assistant", "content": "Paris.", "reasoning_content": "Capital: Paris."},
                         CHAT[2], {"role": "assistant", "content": "Eight.", "reasoning_content": "Spiders: eight."}]}
    rec = dataset.parse_line(json.dumps(line).encode(), "f.jsonl", 1)
    enc = chat.encode_chat(tok, rec.messages, {"chat_template": K25_LIKE})
    assert "<think></think>Paris.<|im_end|>" in enc.text and "Capital: Paris." not in enc.text
    runs, run = [], []
    for t, m in zip(enc.input_ids, enc.loss_mask):
        if m:
            run.append(t)
        elif run:
            runs, run = runs + [run], []
    runs += [run] if run else []
    # the earlier answer as the template renders it (without its reasoning), end-of-turn token and all
    assert [tok.decode(r) for r in runs] == ["<think></think>Paris.<|im_end|>",
                                             "<think>Spiders: eight.</think>Eight.<|im_end|>"]


def test_a_prompt_that_reaches_the_limit_ends_the_line_there(tok):
    """K2.5-like: turn 2's prompt holds turn 1 rewritten, so it is longer than turn 1's sample; with a limit between
    the two, turn 2 is not generated and the sample keeps turn 1 (a restart would have left nothing to train on)."""
    out = ["<think>France, capital: Paris.</think>Paris.<|im_end|>", "<think>Spiders have eight.</think>Eight.<|im_end|>"]
    generate, prompts = server(tok, out)
    full = regenerate.regenerate(tok, CHAT, generate, {"chat_template": K25_LIKE})
    first = len(prompts[0]) + len(chat.encode_text(tok, out[0]))
    assert first < len(prompts[1])
    generate, asked = server(tok, out)
    built = regenerate.regenerate(tok, CHAT, generate, {"chat_template": K25_LIKE}, limit=len(prompts[1]))
    assert len(asked) == 1 and (built.kept, built.dropped, built.cut) == (1, 0, 3)
    assert built.input_ids == prompts[0] + chat.encode_text(tok, out[0]) and len(built.input_ids) == first
    assert full.cut == -1
    with pytest.raises(dataset.Invalid) as e:
        regenerate.regenerate(tok, CHAT, server(tok, out)[0], limit=len(prompts[0]))
    assert e.value.reason == "too_long" and "assistant turn 1" in str(e.value)


def test_answers_kept_within_a_truncation_are_counted(tok):
    generate, prompts = server(tok, ["Paris.<|im_end|>", "Eight.<|im_end|>"])
    built = regenerate.regenerate(tok, CHAT, generate)
    second = len(prompts[1])
    assert built.starts == [len(prompts[0]), second]
    assert (built.kept_within(len(built.input_ids)), built.kept_within(second), built.kept_within(second + 1)) == \
        (2, 1, 2)


def test_an_answer_cut_inside_its_reasoning_goes_back_as_reasoning(tok):
    cut = chat.encode_text(tok, "<think>France, capital")
    assert regenerate.history_message(tok, cut) == {"role": "assistant", "content": "",
                                                    "reasoning_content": "France, capital"}
    opened = chat.encode_text(tok, "<|im_assistant|>assistant<|im_middle|><think>")   # a prompt that opens it
    assert regenerate.history_message(tok, chat.encode_text(tok, "France, capital"), opened) == \
        {"role": "assistant", "content": "", "reasoning_content": "France, capital"}
    twice = chat.encode_text(tok, "<think>a</think>b</think>c")   # split at the first, as SGLang's parsers do
    assert regenerate.history_message(tok, twice) == {"role": "assistant", "content": "bc",
                                                      "reasoning_content": "a"}


def test_an_empty_answer_is_not_counted_as_kept(tok):
    generate, _ = server(tok, [[], "Eight.<|im_end|>"])
    built = regenerate.regenerate(tok, CHAT, generate)
    assert built.kept == 1
