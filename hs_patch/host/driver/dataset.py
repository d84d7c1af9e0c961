"""Dataset input for the driver: read JSONL files, detect each line's format, validate.

Three formats, detected per line (a file may mix them):

- OpenAI ``messages``: ``{"messages": [{"role": "user", "content": "..."}, ...]}``; roles
  ``system``, ``user``, ``assistant``, ``tool``; ``content`` a string or a list of
  ``{"type": "text", "text": ...}`` parts; an assistant turn's ``reasoning_content`` (a thinking
  model's reasoning, as SGLang's reasoning parser returns it) goes to the chat template, which
  decides what it renders of it (Kimi-K2.5's: only in the turns after the last user turn).
- ShareGPT ``conversations``: ``{"conversations": [{"from": "human", "value": "..."}, ...]}``;
  ``from`` ``human``/``user``, ``gpt``/``assistant``/``chatgpt``, ``system``, ``tool``/``function``.
- pre-tokenized ``input_ids``: ``{"input_ids": [int, ...], "loss_mask": [0|1, ...]}`` (the
  mask is optional; without it every token counts).

A line that is not one of these (not UTF-8, not JSON, nested too deeply to parse, not an
object, no or several format fields, wrong field types, text with a lone UTF-16 surrogate,
an empty conversation, no assistant turn, an unknown role, longer than the line limit)
becomes a :class:`Reject` with its file, line number and reason; it never stops the run.
Files are read by :mod:`hs_patch.host.driver.datafile` (compressed or not, any line ending, a
BOM, bounded line length). A sample's id is ``<file name>:<line>`` (unique and stable for
a given file; blank lines count in the numbering); an ``id`` field of the record is kept
as ``source_id``.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from hs_patch.host.driver import datafile

ROLE_MAP = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
            "gpt": "assistant", "chatgpt": "assistant", "tool": "tool", "function": "tool"}
OPENAI_ROLES = ("system", "user", "assistant", "tool")
FORMATS = ("messages", "conversations", "input_ids")


@dataclass
class Record:
    """One valid sample of the dataset."""

    sample_id: str                  # "<file name>:<line>"
    source: str                     # file name
    line: int                       # 1-based
    format: str                     # messages | conversations | input_ids
    messages: Optional[list[dict[str, str]]] = None   # normalized {"role", "content"[, "reasoning_content"]}
    input_ids: Optional[list[int]] = None
    loss_mask: Optional[list[int]] = None
    source_id: str = ""
    line_sha256: str = ""           # the line's own digest (line_digest): which line a sample was made from


@dataclass
class Reject:
    source: str
    line: int
    reason: str
    detail: str
    sample_id: str = field(init=False)

    def __post_init__(self) -> None:
        self.sample_id = f"{self.source}:{self.line}"

    def as_dict(self) -> dict[str, Any]:
        return {"t": round(time.time(), 3), "sample_id": self.sample_id, "source": self.source,
                "line": self.line, "reason": self.reason, "detail": self.detail}


class Invalid(ValueError):
    """A record that cannot become a sample: ``reason`` is a short tag, str() says why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


def source_name(path: Union[str, os.PathLike]) -> str:
    return Path(path).name


def line_limit(max_tokens: int, max_line_chars: int = 0) -> int:
    """Longest line read (characters): ``max_line_chars``, or by default 256 per allowed token
    (at least 1 Mi): real JSONL spends under 16 characters a token, escapes included, so
    only lines that cannot fit are skipped unread."""
    return max_line_chars or max(1 << 20, 256 * max_tokens)


def check_sources(paths: list[str]) -> None:
    """Refuse what cannot be a dataset file, and two files with the same name (sample ids would collide)."""
    seen: dict[str, str] = {}
    for p in paths:
        path = Path(p)
        if path.is_dir():
            raise ValueError(f"dataset path {p} is a directory: give the JSONL files in it "
                             f"(e.g. --data {p.rstrip('/')}/*.jsonl)")
        if not path.exists():
            raise FileNotFoundError(f"dataset file {p} does not exist (give JSONL files with --data)")
        if not path.is_file():
            raise ValueError(f"dataset path {p} is not a regular file (a device or pipe cannot be resumed): "
                             "give JSONL files")
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise ValueError(f"dataset file {p} cannot be read: {e.strerror}") from None
        if path.stat().st_size == 0:
            raise ValueError(f"dataset file {p} is empty: nothing to extract")
        if datafile.first_char(path) == "[":
            raise ValueError(f"dataset file {p} is a JSON array, not JSON lines (one object a line): convert it "
                             f"with jq -c '.[]' {p} > {path.stem}.jsonl")
        name = source_name(p)
        if name in seen:
            raise ValueError(f"two dataset files are named {name!r} ({seen[name]} and {p}); sample ids are "
                             "<file name>:<line>, so rename one of them")
        seen[name] = p


def count_lines(paths: list[str], max_chars: int = 1 << 20, *, limit: int = 0,
                owns: Optional[Callable[[str], bool]] = None) -> datafile.Counts:
    """Non-blank lines of all files (the run's total before validation) and blank ones; with
    ``limit`` only the first ``limit`` non-blank lines, with ``owns`` only the lines whose
    sample id it accepts (a shard, ``hs_patch.shard``)."""
    if owns is None:
        c = datafile.count(paths, max_chars)
        if limit:
            c.lines = min(limit, c.lines)
        return c
    c, seen = datafile.Counts(), 0
    for p in paths:
        name = source_name(p)
        for item in datafile.lines(p, max_chars):
            blank = isinstance(item, datafile.Line) and not item.text.strip()
            if not blank:
                if limit and seen >= limit:
                    return c
                seen += 1
            if owns(f"{name}:{item.number}"):
                if blank:
                    c.blank += 1
                else:
                    c.lines += 1
    return c


def read(paths: list[str], max_chars: int = 1 << 20, *, prompts_only: bool = False
         ) -> Iterator[Union[Record, Reject]]:
    """Every non-blank line of every file, in order, as a Record or a Reject. ``prompts_only``: a chat
    needs no assistant turn (held-out prompts for ``hs-extract accept``)."""
    for p in paths:
        name = source_name(p)
        for item in datafile.lines(p, max_chars):
            if isinstance(item, datafile.TooLong):
                yield Reject(name, item.number, "too_long", f"the line has {item.chars} characters, over the "
                             f"line limit of {max_chars} (--max-line-chars); skipped unread")
                continue
            if not item.text.strip():
                continue
            try:
                rec = parse_line(item.text, name, item.number, prompts_only=prompts_only)
                rec.line_sha256 = line_digest(item.text)
                yield rec
            except Invalid as e:
                yield Reject(name, item.number, e.reason, str(e))


def line_digest(text: str) -> str:
    """The sha256 of a line as read (no line ending, no BOM; bytes that are not UTF-8 as they were): a resume
    over a changed file finds the samples of the lines still there by it (``reconcile.py``)."""
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def parse_line(raw: Union[bytes, str], source: str, line: int, *, prompts_only: bool = False) -> Record:
    text = raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a byte that is not UTF-8 (decoded as a lone surrogate)
        at = len(text[:e.start].encode("utf-8", "surrogateescape"))
        bad = text[e.start:e.start + 4].encode("utf-8", "surrogateescape")
        raise Invalid("not_utf8", f"byte {at} is not UTF-8 ({bad!r})") from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise Invalid("bad_json", "JSON nested too deeply to parse (over ~1000 levels of [ or {)") from None
    except ValueError as e:
        raise Invalid("bad_json", f"not valid JSON: {e}{_array_hint(text, line)}") from None
    if not isinstance(obj, dict):
        raise Invalid("bad_json", f"a line must be a JSON object, got {type(obj).__name__}{_array_hint(text, line)}")
    present = [k for k in FORMATS if k in obj]
    if not present:
        raise Invalid("unknown_format", f"no 'messages', 'conversations' or 'input_ids' field "
                                        f"(fields: {sorted(obj)[:8]})")
    if len(present) > 1:
        raise Invalid("ambiguous_format", f"several format fields {present}; keep one")
    fmt = present[0]
    source_id = obj.get("id", "")
    source_id = str(source_id) if isinstance(source_id, (str, int)) and not isinstance(source_id, bool) else ""
    rec = Record(f"{source}:{line}", source, line, fmt, source_id=_text(source_id, "id"))
    if fmt == "input_ids":
        rec.input_ids, rec.loss_mask = _tokens(obj)
    else:
        rec.messages = _conversation(obj[fmt], fmt, need_assistant=not prompts_only)
    return rec


def _array_hint(text: str, line: int) -> str:
    if line == 1 and text.lstrip().startswith("["):
        return "; the file looks like a JSON array, not JSON lines: convert it with jq -c '.[]' FILE > FILE.jsonl"
    return ""


def _text(value: str, where: str) -> str:
    """``value`` if it is valid Unicode text: JSON can escape half of a UTF-16 pair (\\ud800) alone."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise Invalid("invalid_text", f"{where}: a lone surrogate U+{ord(value[e.start]):04X} at character "
                                      f"{e.start} is not text (an escaped half of a UTF-16 pair?)") from None
    return value


def _tokens(obj: dict[str, Any]) -> tuple[list[int], Optional[list[int]]]:
    ids = obj["input_ids"]
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise Invalid("bad_field", "input_ids must be a list of non-negative integers")
    if not ids:
        raise Invalid("empty", "input_ids is empty")
    mask = obj.get("loss_mask")
    if mask is None:
        return ids, None
    if not isinstance(mask, list) or not all(m in (0, 1) and not isinstance(m, float) for m in mask):
        raise Invalid("bad_field", "loss_mask must be a list of 0/1")
    if len(mask) != len(ids):
        raise Invalid("bad_field", f"loss_mask has {len(mask)} entries for {len(ids)} input_ids")
    if not any(mask):
        raise Invalid("no_assistant_turn", "loss_mask has no 1: nothing to train on")
    return ids, [int(m) for m in mask]


def _content(value: Any, where: str) -> str:
    if isinstance(value, str):
        return _text(value, where)
    if isinstance(value, list) and all(isinstance(p, dict) for p in value):
        texts = []
        for part in value:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise Invalid("bad_field", f"{where}: only text content parts are supported, got "
                                           f"type {part.get('type')!r}")
            texts.append(_text(part["text"], where))
        return "".join(texts)
    raise Invalid("bad_field", f"{where}: content must be a string or a list of text parts")


def _conversation(turns: Any, fmt: str, need_assistant: bool = True) -> list[dict[str, str]]:
    role_key, text_key = ("role", "content") if fmt == "messages" else ("from", "value")
    if not isinstance(turns, list):
        raise Invalid("bad_field", f"'{fmt}' must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise Invalid("empty", f"'{fmt}' is empty")
    out = []
    for i, turn in enumerate(turns):
        where = f"{fmt}[{i}]"
        if not isinstance(turn, dict):
            raise Invalid("bad_field", f"{where} must be an object")
        if role_key not in turn or text_key not in turn:
            raise Invalid("bad_field", f"{where} needs '{role_key}' and '{text_key}'")
        raw_role = turn[role_key]
        allowed = OPENAI_ROLES if fmt == "messages" else tuple(ROLE_MAP)
        if not isinstance(raw_role, str) or raw_role.lower() not in allowed:
            raise Invalid("bad_role", f"{where}: role {raw_role!r} is not one of {', '.join(allowed)}")
        out.append({"role": ROLE_MAP[raw_role.lower()], "content": _content(turn[text_key], where)})
        reasoning = turn.get("reasoning_content") if fmt == "messages" else None
        if reasoning is not None and out[-1]["role"] == "assistant":  # the chat template decides what it renders
            out[-1]["reasoning_content"] = _content(reasoning, f"{where}.reasoning_content")
    if need_assistant and not any(t["role"] == "assistant" for t in out):
        raise Invalid("no_assistant_turn", f"'{fmt}' has no assistant turn: nothing to train on")
    return out


class RejectLog:
    """``rejects.jsonl``: one line per rejected (file, line), appended at most once across restarts. What counts is
    this pass's (``now``): every line is read again on each start and rejected again while it is bad, so a line
    fixed since an earlier start is not counted, nor listed among the missing (it was, for ever)."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        self._lock = threading.Lock()
        self.seen: set[tuple[str, int]] = set()   # in the file
        self.now: dict[tuple[str, int], dict[str, Any]] = {}   # rejected in this pass
        if self.path.exists():
            for raw in self.path.read_bytes().splitlines():
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue  # a torn last line from a crash: the reject is written again
                self.seen.add((rec["source"], rec["line"]))

    def add(self, reject: Reject) -> None:
        with self._lock:
            where = (reject.source, reject.line)
            self.now[where] = reject.as_dict()
            if where not in self.seen:
                self.seen.add(where)
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(reject.as_dict(), sort_keys=True) + "\n")

    @property
    def by_reason(self) -> dict[str, int]:
        with self._lock:
            return dict(Counter(r["reason"] for r in self.now.values()))

    @property
    def total(self) -> int:
        return len(self.now)
