"""The served model's chat template and the loss mask (1 on assistant tokens).

The token ids are exactly what the server would prefill for the conversation: the
template rendered to text by the model's own tokenizer, then encoded without adding
special tokens (the template carries them), as ``apply_chat_template(tokenize=True)`` does.

Assistant spans are found on the rendered text. For assistant turn i, the text up to
the turn's start is the template of the turns before it with the generation prompt,
and the text up to its end is the template of the turns through it; when the full
rendering starts with those (templates that render a prefix of the conversation as a
prefix of the text, most do) the span is everything in between: the answer and the
end-of-turn token(s). Otherwise (templates that rewrite earlier turns, e.g. drop their
reasoning) the span is that turn as rendered (what follows the generation-prompt
header in the rendering through it; with its reasoning_content, then without), or failing that the turn's bare content
(without the end-of-turn token), found in the rendered text after the previous span; a
turn found neither way is a reject (``mask_alignment``). Characters map to tokens through the tokenizer's offsets (fast
tokenizers) or, for slow ones (Kimi's tiktoken tokenizer), by encoding the text up to
each span boundary and checking that it is a prefix of the full encoding.

A conversation that opens with an assistant turn has no history to render a generation
prompt from (``apply_chat_template([])`` is an error in transformers): its span is the
turn as rendered alone, after the assistant header the template puts before a generation
prompt (learnt from a one-turn history), or its bare content. Templates that refuse such
a conversation altogether give the reject ``assistant_first``. Anything the tokenizer
raises on a text is a reject too (``tokenizer_error``), never a failed run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hs_patch.host.driver.dataset import Invalid


@dataclass
class Encoded:
    input_ids: list[int]
    loss_mask: list[int]
    text: str


def render(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool = False,
           template_kwargs: Optional[dict[str, Any]] = None) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                             **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - jinja raises anything; the sample is rejected with the reason
        if messages and messages[0]["role"] == "assistant":
            raise Invalid("assistant_first", "the conversation starts with an assistant turn and the chat template "
                                             f"refuses it ({type(e).__name__}: {e}); drop that turn or put the "
                                             "user turn it answers before it") from None
        raise Invalid("template_error", f"the chat template failed: {type(e).__name__}: {e}") from None


def tokenize(tokenizer: Any, text: str, **kw: Any) -> Any:
    try:
        return tokenizer(text, add_special_tokens=False, **kw)
    except Exception as e:  # noqa: BLE001 - a text the tokenizer cannot take is a reject, not a failed run
        raise Invalid("tokenizer_error", f"the tokenizer refused the text: {type(e).__name__}: {e}"[:300]) from None


def encode_text(tokenizer: Any, text: str) -> list[int]:
    return list(tokenize(tokenizer, text)["input_ids"])


def assistant_spans(tokenizer: Any, messages: list[dict[str, str]], full: str,
                    template_kwargs: Optional[dict[str, Any]] = None) -> list[tuple[int, int]]:
    """Character spans of the assistant turns in ``full`` (the rendered conversation)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            # past this turn's own text, where the template kept it: an assistant turn that repeats it (an echo, a
            # tool result read back) is searched for after it, never found inside it
            for text in (m["content"], m["content"].strip()):
                at = full.find(text, cursor) if text else -1
                if at >= 0:
                    cursor = at + len(text)
                    break
            continue
        if i == 0:  # nothing before it to render a generation prompt from
            spans.append(_first_turn_span(tokenizer, m, full, template_kwargs))
            cursor = spans[-1][1]
            continue
        before = render(tokenizer, messages[:i], generation_prompt=True, template_kwargs=template_kwargs)
        through = render(tokenizer, messages[:i + 1], template_kwargs=template_kwargs)
        if full.startswith(through) and through.startswith(before) and cursor <= len(before) < len(through):
            span = (len(before), len(through))
        else:  # the turn as rendered (answer + end of turn), else its bare content, found in the text
            span = None
            pieces = [_rendered_turn(tokenizer, messages[:i], before, through, template_kwargs)]
            if "reasoning_content" in m:  # a template that drops an earlier turn's reasoning (Kimi-K2.5)
                plain = render(tokenizer, messages[:i] + [{"role": m["role"], "content": m["content"]}],
                               template_kwargs=template_kwargs)
                pieces.append(_rendered_turn(tokenizer, messages[:i], before, plain, template_kwargs))
            for piece in (*pieces, m["content"]):
                start = full.find(piece, cursor) if piece else -1
                if start >= 0:
                    span = (start, start + len(piece))
                    break
            if span is None:
                raise Invalid("mask_alignment", f"assistant turn {i} is not found in the rendered chat template "
                                                "text; the template changes it")
        spans.append(span)
        cursor = span[1]
    return spans


def _first_turn_span(tokenizer: Any, turn: dict[str, str], full: str,
                     template_kwargs: Optional[dict[str, Any]]) -> tuple[int, int]:
    """An opening assistant turn: after the assistant header, through its end-of-turn token(s)."""
    through = render(tokenizer, [turn], template_kwargs=template_kwargs)
    probe = [{"role": "user", "content": ""}]
    try:
        plain = render(tokenizer, probe, template_kwargs=template_kwargs)
        prompt = render(tokenizer, probe, generation_prompt=True, template_kwargs=template_kwargs)
        header = prompt[len(plain):] if prompt.startswith(plain) else ""
    except Invalid:
        header = ""
    if full.startswith(through) and header and through.startswith(header) and len(header) < len(through):
        return len(header), len(through)
    at = full.find(turn["content"]) if turn["content"] else -1
    if at < 0:
        raise Invalid("mask_alignment", "the opening assistant turn is not found in the rendered chat template text")
    return at, at + len(turn["content"])


def _rendered_turn(tokenizer: Any, history: list[dict[str, str]], before: str, through: str,
                   template_kwargs: Optional[dict[str, Any]]) -> str:
    """The last turn of ``through`` as rendered: what follows the last generation prompt header."""
    plain = render(tokenizer, history, template_kwargs=template_kwargs)
    header = before[len(plain):] if before.startswith(plain) else ""
    at = through.rfind(header) if header else -1
    return through[at + len(header):] if at >= 0 else ""


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask = [0] * len(offsets)
    k = 0
    for t, (a, b) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= a:
            k += 1
        if k < len(spans) and a < spans[k][1] and b > spans[k][0] and b > a:
            mask[t] = 1
    return mask


def _mask_from_prefixes(tokenizer: Any, text: str, ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    mask = [0] * len(ids)
    for a, b in spans:
        idx = []
        for pos in (a, b):
            prefix = encode_text(tokenizer, text[:pos])
            if ids[:len(prefix)] != prefix:
                raise Invalid("mask_alignment", f"a token straddles the assistant span boundary at character {pos}; "
                                                "the loss mask cannot be aligned with this tokenizer")
            idx.append(len(prefix))
        for t in range(idx[0], idx[1]):
            mask[t] = 1
    return mask


def encode_chat(tokenizer: Any, messages: list[dict[str, str]],
                template_kwargs: Optional[dict[str, Any]] = None) -> Encoded:
    """Token ids of the conversation as the server sees it, and its loss mask."""
    full = render(tokenizer, messages, template_kwargs=template_kwargs)
    spans = assistant_spans(tokenizer, messages, full, template_kwargs)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenize(tokenizer, full, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        mask = _mask_from_offsets([tuple(o) for o in enc["offset_mapping"]], spans)
    else:
        ids = encode_text(tokenizer, full)
        mask = _mask_from_prefixes(tokenizer, full, ids, spans)
    if not any(mask):
        raise Invalid("no_assistant_turn", "the assistant turns are empty after tokenization")
    return Encoded(ids, mask, full)


def generation_prompt(tokenizer: Any, messages: list[dict[str, str]],
                      template_kwargs: Optional[dict[str, Any]] = None) -> list[int]:
    """Token ids that ask the model for the next assistant turn after ``messages``."""
    return encode_text(tokenizer, render(tokenizer, messages, generation_prompt=True, template_kwargs=template_kwargs))


def check_model_dir(model_dir: str) -> None:
    """ValueError unless ``model_dir`` is a directory (checked before anything of the run is written)."""
    from pathlib import Path

    p = Path(model_dir)
    if not p.is_dir():
        raise ValueError(f"--model {model_dir} {'is not a directory' if p.exists() else 'does not exist'}: give the "
                         "served model's directory (the one SGLang's --model-path names), which holds its "
                         "tokenizer and chat template")


def load_tokenizer(model_dir: str, trust_remote_code: bool = False) -> Any:
    """The served model's tokenizer (``AutoTokenizer``'s, :mod:`hs_patch.host.driver.tokenizer`); ValueError saying
    what to give if ``model_dir`` is not one."""
    from hs_patch.host.driver import tokenizer

    check_model_dir(model_dir)
    try:
        return tokenizer.load(model_dir, trust_remote_code)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; one clear message
        hint = "" if trust_remote_code else " (Kimi-K2/K2.5's tokenizer needs --trust-remote-code)"
        raise ValueError(f"cannot load the tokenizer of --model {model_dir}{hint}: {type(e).__name__}: {e}"[:800]) \
            from None


def vocab_bound(tokenizer: Any, model_dir: Optional[str]) -> int:
    """Token ids must be below this: the larger of the tokenizer's size and the config's vocab_size."""
    import json
    from pathlib import Path

    bound = len(tokenizer)
    if model_dir:
        cfg_path = Path(model_dir) / "config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
            for c in (cfg, cfg.get("text_config") or {}):
                if isinstance(c.get("vocab_size"), int):
                    bound = max(bound, c["vocab_size"])
    return bound
