"""How long a sample may be, and cheap checks that refuse longer ones before the costly work.

- :func:`server_limit`: the longest prompt the SGLang server accepts for a prefill with
  ``max_new_tokens`` 1, from ``/server_info`` (same fields in 0.5.9, 0.5.16, 0.5.23):
  ``max_req_input_len`` (the scheduler's ``min(context_len - 1, token pool - 1) - 5``; it
  aborts a prompt of that many tokens or more: ``managers/utils.validate_input_length``)
  and ``context_length`` when the server was started with one (the tokenizer manager
  refuses ``len >= context_len`` and ``len + max_new_tokens >= context_len``).
- :func:`check_chars`: a conversation with more content characters than
  ``limit x (longest token in characters)`` cannot fit in ``limit`` tokens, so it is
  refused without rendering or tokenizing it (a 50 MB line costs a scan, not a minute
  and gigabytes of tokenizer memory). The bound is exact, never too strict: every token
  covers at most that many characters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from hs_patch.host.driver.dataset import Invalid

UNKNOWN_TOKEN_CHARS = 1024  # if the vocabulary cannot be listed: a generous bound


@dataclass(frozen=True)
class Limit:
    tokens: int   # the longest sample sent
    why: str      # what sets it, for reject messages: "--max-tokens 32768" or the server's limit


def server_limit(info: Mapping[str, Any]) -> Optional[int]:
    """The longest prompt (tokens) the server prefills with one new token; None if it does not say."""
    found = []
    m = info.get("max_req_input_len")
    if isinstance(m, int) and not isinstance(m, bool) and m > 1:
        found.append(m - 1)
    c = info.get("context_length")
    if isinstance(c, int) and not isinstance(c, bool) and c > 2:
        found.append(c - 2)
    return min(found) if found else None


def effective(max_tokens: int, info: Mapping[str, Any]) -> Limit:
    server = server_limit(info)
    if server is not None and server < max_tokens:
        return Limit(server, f"the server's limit of {server} tokens (max_req_input_len "
                             f"{info.get('max_req_input_len')}, context_length {info.get('context_length')}; "
                             f"--max-tokens is {max_tokens})")
    return Limit(max_tokens, f"--max-tokens {max_tokens}")


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the vocabulary's longest token (added and special tokens included).

    Byte-level vocabularies spell each byte as one character, so this counts bytes, which
    is at least the characters a token covers: the bound stays safe."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max((len(t) for t in vocab), default=0)
    except Exception:  # noqa: BLE001 - a tokenizer without a listable vocabulary: stay generous
        return UNKNOWN_TOKEN_CHARS
    return max(1, int(longest))


def check_chars(messages: list[dict[str, str]], limit: Limit, longest: int) -> None:
    """Refuse a conversation whose content alone needs more than ``limit.tokens`` tokens."""
    chars = sum(len(m["content"]) for m in messages)
    if chars > limit.tokens * longest:
        raise Invalid("too_long", f"{chars} characters of content need at least {-(-chars // longest)} tokens "
                                  f"(the longest token has {longest} characters) > {limit.why}; not tokenized")
