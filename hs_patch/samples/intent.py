"""The driver's intent for a sample: what the hook adds to it when it writes it.

Before the driver sends a request it writes ``<capture dir>/intents/<key>.json``: the
sample's length, its loss mask (as spans of 1s) and its provenance (sample id, source,
line, run, ...). When the hook's writer completes the sample of that key, it reads the
intent and writes the loss mask and the provenance INTO the sample, so the sample is
final as written: the driver only renames it into the run's samples directory. Keyed by
content (``store.sample_key``), so it works on 0.5.9, whose forward batch has no request
ids. Standard library only (read inside the SGLang server).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from hs_patch.samples.files import write_text_atomic

FORMAT = "hs_patch.intent/1"
DIR = "intents"
MAX_METADATA_BYTES = 16 << 10  # the sample header reserves room for this (hs_patch.server.inplace.InPlaceSample)
MAX_FILE_BYTES = 4 << 20


class IntentError(ValueError):
    """An intent file is unusable; the message says why."""


@dataclass(frozen=True)
class Intent:
    key: str
    tokens: int
    loss_spans: tuple[tuple[int, int], ...]
    metadata: dict[str, str]

    @property
    def loss_tokens(self) -> int:
        return sum(e - s for s, e in self.loss_spans)

    def loss_mask(self) -> bytearray:
        """The mask as one byte per token (0 or 1)."""
        mask = bytearray(self.tokens)
        for s, e in self.loss_spans:
            mask[s:e] = b"\x01" * (e - s)
        return mask


def spans(mask: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of non-zero entries of ``mask``."""
    out, start = [], None
    for i, v in enumerate(mask):
        if v and start is None:
            start = i
        elif not v and start is not None:
            out.append((start, i))
            start = None
    if start is not None:
        out.append((start, len(mask)))
    return out


def path(capture_dir: str | os.PathLike, key: str) -> Path:
    return Path(capture_dir) / DIR / f"{key}.json"


def write(capture_dir: str | os.PathLike, key: str, loss_mask: Sequence[int], metadata: Mapping[str, Any]) -> Path:
    """Write the intent atomically (before the request is sent); returns its path."""
    meta = {str(k): str(v) for k, v in metadata.items()}
    if len(json.dumps(meta).encode()) > MAX_METADATA_BYTES:
        raise IntentError(f"provenance metadata over {MAX_METADATA_BYTES} bytes: shorten the record's id or source")
    doc = {"format": FORMAT, "key": key, "tokens": len(loss_mask), "loss_spans": spans(loss_mask), "metadata": meta}
    p = path(capture_dir, key)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(p, json.dumps(doc, separators=(",", ":")))
    return p


def read(capture_dir: str | os.PathLike, key: str, tokens: int) -> Intent | None:
    """The intent for ``key`` (None if there is none: a request that did not come from the
    driver); IntentError if the file is there but unusable (the sample is then written
    without it, and the error says why)."""
    p = path(capture_dir, key)
    try:
        if p.stat().st_size > MAX_FILE_BYTES:
            raise IntentError(f"{p}: larger than {MAX_FILE_BYTES} bytes")
        doc = json.loads(p.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise IntentError(f"{p}: unreadable ({e})") from None
    try:
        if doc["format"] != FORMAT or doc["key"] != key:
            raise IntentError(f"{p}: format {doc.get('format')!r} / key {doc.get('key')!r} not {FORMAT} / {key}")
        if int(doc["tokens"]) != tokens:
            raise IntentError(f"{p}: intent for {doc['tokens']} tokens, the sample has {tokens}")
        loss = tuple((int(s), int(e)) for s, e in doc["loss_spans"])
        if any(not 0 <= s < e <= tokens for s, e in loss) or list(loss) != sorted(loss):
            raise IntentError(f"{p}: loss spans outside 0..{tokens} or unordered")
        meta = doc["metadata"]
        if not isinstance(meta, dict) or len(json.dumps(meta).encode()) > MAX_METADATA_BYTES:
            raise IntentError(f"{p}: metadata missing or over {MAX_METADATA_BYTES} bytes")
    except (KeyError, TypeError) as e:
        raise IntentError(f"{p}: missing or malformed field ({e})") from None
    return Intent(key, tokens, loss, {str(k): str(v) for k, v in meta.items()})


def remove(capture_dir: str | os.PathLike, key: str) -> None:
    path(capture_dir, key).unlink(missing_ok=True)
