"""The stand-in server's requests: what ``/generate`` takes, SGLang's checks of it, and the
logprob fields it answers in SGLang's ``meta_info`` shape (``[logprob, id, null]`` entries)."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class Request:
    rid: str
    ids: list[int]
    max_new_tokens: int
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    iid: str = field(default_factory=lambda: uuid.uuid4().hex)
    start: float = field(default_factory=time.time)
    done: threading.Event = field(default_factory=threading.Event)
    result: Optional[dict[str, Any]] = None
    error: Optional[str] = None
    logprobs: dict[str, list] = field(default_factory=dict)   # SGLang's meta_info logprob fields


class BadRequest(ValueError):
    """Answered 400 with SGLang's ``{"error": {"message"}}``."""


def parse_request(body: Any, tokenizer: Any, vocab: int, context_length: int, max_req_input_len: int) -> Request:
    """A /generate body as a Request, or BadRequest with SGLang's message (tokenizer manager and scheduler checks)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("stream"):
        raise BadRequest("streaming is not supported by the stand-in server")
    ids = body.get("input_ids")
    if ids is None and isinstance(body.get("text"), str):
        ids = tokenizer(body["text"], add_special_tokens=False)["input_ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
        raise BadRequest("give input_ids as a non-empty list of token ids (batched requests are not supported)")
    if any(t < 0 or t >= vocab for t in ids):
        raise BadRequest(f"token id out of range [0, {vocab})")
    params = body.get("sampling_params") or {}
    max_new = int(params.get("max_new_tokens", 128))
    if len(ids) >= context_length:
        raise BadRequest(f"The input ({len(ids)} tokens) is longer than the model's context length "
                         f"({context_length} tokens).")
    if len(ids) + max_new >= context_length:
        raise BadRequest(f"Requested token count exceeds the model's maximum context length of "
                         f"{context_length} tokens. You requested a total of {len(ids) + max_new} tokens: "
                         f"{len(ids)} tokens from the input messages and {max_new} tokens for the completion.")
    if len(ids) >= max_req_input_len:
        raise BadRequest(f"Input length ({len(ids)} tokens) exceeds the maximum allowed length "
                         f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.")
    rid = body.get("rid") or uuid.uuid4().hex
    try:
        start = int(body.get("logprob_start_len", -1) if body.get("logprob_start_len") is not None else -1)
        k = int(body.get("top_logprobs_num", 0) or 0)
    except (TypeError, ValueError):
        raise BadRequest("logprob_start_len and top_logprobs_num must be integers") from None
    if start >= len(ids):
        raise BadRequest(f"logprob_start_len ({start}) is superior or equal to the input length ({len(ids)})")
    return Request(str(rid), list(ids), max_new, bool(body.get("return_logprob")), start, k)


def top_entries(logprobs: torch.Tensor, k: int) -> Optional[list]:
    """The top ``k`` of one position as SGLang lists them: ``[logprob, id, null]``, best first."""
    if k <= 0:
        return None
    v, i = logprobs.topk(k)
    return [[float(a), int(b), None] for a, b in zip(v, i)]

def input_logprobs(req: Request, lm_head: Any, states: torch.Tensor, first: int) -> None:
    """input_token_logprobs / input_top_logprobs from logprob_start_len on (first entry None, entry j
    from the logits at position start + j - 1), output_* for the first generated token."""
    n = len(req.ids)
    start = n - 1 if req.logprob_start_len < 0 else min(req.logprob_start_len, n - 1)
    lp = torch.log_softmax(lm_head(states[start:]).float(), dim=-1)
    k = req.top_logprobs_num
    tok = [[None, req.ids[start], None]] + [[float(lp[j - 1, req.ids[start + j]]), req.ids[start + j], None]
                                           for j in range(1, n - start)]
    top = [None] + [top_entries(lp[j - 1], k) for j in range(1, n - start)]
    req.logprobs = {"input_token_logprobs": tok, "output_token_logprobs": [], "output_token_logprobs_length": 0}
    if k > 0:
        req.logprobs.update(input_top_logprobs=top, output_top_logprobs=[])
    output_logprob(req, lp[-1], first, already_log=True)

def output_logprob(req: Request, logits: torch.Tensor, token: int, already_log: bool = False) -> None:
    lp = logits if already_log else torch.log_softmax(logits.float(), dim=-1)
    req.logprobs["output_token_logprobs"].append([float(lp[token]), token, None])
    req.logprobs["output_token_logprobs_length"] += 1
    if req.top_logprobs_num > 0:
        req.logprobs["output_top_logprobs"].append(top_entries(lp, req.top_logprobs_num))
