"""Chat template rendering and the loss mask (1 on assistant tokens)."""

from __future__ import annotations

import pytest

from hs_patch.host.driver import chat, dataset

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris is the capital."}, {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "hello world"}]


def assistant_text(tok, enc: chat.Encoded) -> list[str]:
    """The masked tokens, decoded run by run."""
    runs, cur = [], []
    for t, m in zip(enc.input_ids, enc.loss_mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur))
            cur = []
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_mask_covers_each_answer_and_its_end_token(tiny_tokenizer):
    enc = chat.encode_chat(tiny_tokenizer, CONV)
    assert enc.input_ids == list(tiny_tokenizer.apply_chat_template(CONV, tokenize=True)["input_ids"])
    assert assistant_text(tiny_tokenizer, enc) == ["Paris is the capital.<|im_end|>", "hello world<|im_end|>"]


class SlowTokenizer:
    """The same tokenizer without offsets, like Kimi's tiktoken tokenizer."""

    is_fast = False

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, text, **kw):
        kw.pop("return_offsets_mapping", None)
        return self.tok(text, **kw)

    def __len__(self):
        return len(self.tok)

    def apply_chat_template(self, *a, **kw):
        return self.tok.apply_chat_template(*a, **kw)


def test_slow_tokenizer_gives_the_same_mask(tiny_tokenizer):
    fast = chat.encode_chat(tiny_tokenizer, CONV)
    slow = chat.encode_chat(SlowTokenizer(tiny_tokenizer), CONV)
    assert (slow.input_ids, slow.loss_mask) == (fast.input_ids, fast.loss_mask)


class RewritingTemplate(SlowTokenizer):
    """A template that rewrites earlier assistant turns (so the conversation's rendering does not
    start with the rendering of its first turns): it drops their reasoning and marks them."""

    is_fast = True

    def apply_chat_template(self, messages, **kw):
        last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
        msgs = [dict(m, content=m["content"].split("</think>")[-1] + " [history]")
                if m["role"] == "assistant" and i != last else m for i, m in enumerate(messages)]
        return self.tok.apply_chat_template(msgs, **kw)

    def __call__(self, text, **kw):
        return self.tok(text, **kw)


def test_template_that_rewrites_turns_falls_back_to_the_content(tiny_tokenizer):
    enc = chat.encode_chat(RewritingTemplate(tiny_tokenizer), CONV)
    # the rewritten turn: its content only (the template's end-of-turn is not known there)
    assert assistant_text(tiny_tokenizer, enc) == ["Paris is the capital.", "hello world<|im_end|>"]


def test_a_rewritten_turn_that_repeats_the_user_is_found_in_its_own_place(tiny_tokenizer):
    """The content fallback searched from the end of the previous assistant turn, so a user turn quoting the answer
    got the mask: "Repeat after me: Paris is the capital." masked its own words and left the answer unmasked."""
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Repeat after me: Paris is the capital."},
            {"role": "assistant", "content": "Paris is the capital."}, {"role": "user", "content": "thanks"},
            {"role": "assistant", "content": "hello world"}]
    enc = chat.encode_chat(RewritingTemplate(tiny_tokenizer), conv)
    assert assistant_text(tiny_tokenizer, enc) == ["Paris is the capital.", "hello world<|im_end|>"]
    user_turn = enc.text.index("Repeat after me:")
    before_answer = len(chat.encode_text(tiny_tokenizer, enc.text[:enc.text.index("Paris", user_turn + 20)]))
    assert not any(enc.loss_mask[:before_answer]), "a token of the user's turn is in the loss mask"


def test_unalignable_turns_and_template_errors_are_rejects(tiny_tokenizer):
    conv = [dict(m) for m in CONV]
    conv[2]["content"] = "<think>hmm</think>Paris is the capital."  # the template drops the reasoning
    with pytest.raises(dataset.Invalid) as e:
        chat.encode_chat(RewritingTemplate(tiny_tokenizer), conv)
    assert e.value.reason == "mask_alignment"
    with pytest.raises(dataset.Invalid) as e:
        chat.encode_chat(BrokenTemplate(), CONV)
    assert e.value.reason == "template_error" and "alternate" in str(e.value)


class BrokenTemplate:
    def apply_chat_template(self, *a, **kw):
        raise ValueError("Conversation roles must alternate user/assistant")


def test_generation_prompt_ends_with_the_assistant_header(tiny_tokenizer):
    ids = chat.generation_prompt(tiny_tokenizer, CONV[:2])
    assert tiny_tokenizer.decode(ids).endswith("<|im_assistant|>assistant<|im_middle|>")


def test_vocab_bound_reads_the_config(tiny_tokenizer, tiny_model_dir):
    assert chat.vocab_bound(tiny_tokenizer, str(tiny_model_dir)) == 512 > len(tiny_tokenizer)


def test_an_assistant_first_chat_masks_that_turn_as_rendered(tiny_tokenizer):
    conv = [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "ok"}]
    enc = chat.encode_chat(tiny_tokenizer, conv)
    assert enc.input_ids == list(tiny_tokenizer.apply_chat_template(conv, tokenize=True)["input_ids"])
    assert assistant_text(tiny_tokenizer, enc) == ["Hello there.<|im_end|>", "ok<|im_end|>"]


class RefusesAssistantFirst(SlowTokenizer):
    is_fast = True

    def apply_chat_template(self, messages, **kw):
        if messages and messages[0]["role"] != "user":
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        return self.tok.apply_chat_template(messages, **kw)


def test_a_template_that_refuses_assistant_first_gives_a_clear_reason(tiny_tokenizer):
    with pytest.raises(dataset.Invalid) as e:
        chat.encode_chat(RefusesAssistantFirst(tiny_tokenizer), [{"role": "assistant", "content": "a"},
                                                                 {"role": "user", "content": "b"}])
    assert e.value.reason == "assistant_first" and "starts with an assistant turn" in str(e.value)


def test_what_the_tokenizer_refuses_is_a_reject(tiny_tokenizer):
    with pytest.raises(dataset.Invalid) as e:  # a lone surrogate that got past the dataset reader
        chat.encode_chat(tiny_tokenizer, [{"role": "user", "content": "a\ud800"}, {"role": "assistant", "content": "b"}])
    assert e.value.reason == "tokenizer_error"


def test_a_model_path_that_is_not_a_directory_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--model /nonexistent does not exist: give the served model's directory"):
        chat.load_tokenizer("/nonexistent")
    (tmp_path / "m").mkdir()
    with pytest.raises(ValueError, match="cannot load the tokenizer of --model"):
        chat.load_tokenizer(str(tmp_path / "m"))
