"""Reading a dataset file line by line with bounded work, whatever its encoding details.

- **Compression** is recognised by the file's first bytes (not its name): gzip
  (``.jsonl.gz``), bzip2 and xz are read through the standard library.
- **Line endings**: ``\\n``, ``\\r\\n`` and a lone ``\\r`` all end a line (JSON text cannot
  hold a raw CR or LF inside a string, so this never splits a record).
- **UTF-8 BOM**: accepted at the start of the file (and of any line, for concatenated files).
- **Bounded**: a line longer than ``max_chars`` characters is never held in memory whole:
  it is skipped to its end in 1 Mi-character pieces and reported as :class:`TooLong`.
- **Invalid UTF-8** is not an error of the file: each bad byte decodes to a lone
  surrogate (``surrogateescape``) and :func:`hs_patch.host.driver.dataset.parse_line` rejects
  that line with the byte's position.

A file that cannot be read to its end (a truncated ``.gz``, an I/O error) raises
:class:`DataFileError` naming the file and the last line read: nothing after it passes
silently.
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterator, Union

PIECE = 1 << 20  # characters read at a time while skipping an over-long line
_OPENERS: tuple[tuple[bytes, str, Callable[[str], IO[bytes]]], ...] = (
    (b"\x1f\x8b", "gzip", lambda p: gzip.open(p, "rb")),
    (b"BZh", "bzip2", lambda p: bz2.open(p, "rb")),
    (b"\xfd7zXZ\x00", "xz", lambda p: lzma.open(p, "rb")),
)
READ_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError, ValueError)


class DataFileError(RuntimeError):
    """A dataset file cannot be read (to its end); the message says which and where."""


@dataclass
class Line:
    number: int   # 1-based
    text: str     # without its line ending; may hold lone surrogates for bytes that are not UTF-8


@dataclass
class TooLong:
    number: int
    chars: int    # the line's length, counted while skipping it


def compression(path: Union[str, os.PathLike]) -> str:
    """``gzip``, ``bzip2``, ``xz`` or ``none``, from the file's first bytes."""
    with open(path, "rb") as f:
        head = f.read(6)
    return next((name for magic, name, _ in _OPENERS if head.startswith(magic)), "none")


def _open(path: str) -> IO[bytes]:
    kind = compression(path)
    opener = next((o for _, name, o in _OPENERS if name == kind), None)
    return opener(path) if opener else open(path, "rb")


def first_char(path: Union[str, os.PathLike], window: int = 1 << 16) -> str:
    """The first character that is not whitespace or a BOM in the file's first ``window`` characters
    (decompressed), or '' if there is none."""
    try:
        with io.TextIOWrapper(_open(str(path)), encoding="utf-8-sig", errors="surrogateescape") as f:
            head = f.read(window)
    except READ_ERRORS as e:
        raise DataFileError(f"dataset file {Path(path).name} cannot be read: {type(e).__name__}: {e}") from None
    stripped = head.lstrip(" \t\r\n\ufeff")
    return stripped[:1]


def lines(path: Union[str, os.PathLike], max_chars: int) -> Iterator[Union[Line, TooLong]]:
    """Every line of the file (blank ones too, so numbers match an editor's), in order."""
    path = str(path)
    name = Path(path).name
    n = 0
    try:
        with io.TextIOWrapper(_open(path), encoding="utf-8-sig", errors="surrogateescape", newline=None) as f:
            while True:
                s = f.readline(max_chars + 1)
                if not s:
                    return
                n += 1
                if s.endswith("\n"):
                    s = s[:-1]
                elif len(s) > max_chars:
                    total = len(s)
                    while True:
                        piece = f.readline(PIECE)
                        total += len(piece) - piece.endswith("\n")
                        if not piece or piece.endswith("\n"):
                            break
                    yield TooLong(n, total)
                    continue
                yield Line(n, s.lstrip("\ufeff"))
    except READ_ERRORS as e:
        where = f"after line {n}" if n else "at its start"
        raise DataFileError(f"dataset file {name} cannot be read {where}: {type(e).__name__}: {e}. Lines before "
                            "it were used; repair or replace the file (a truncated download or copy?)") from None


@dataclass
class Counts:
    lines: int = 0    # non-blank lines (the run's total before validation)
    blank: int = 0    # blank or whitespace-only lines (skipped, counted)


def count(paths: list[str], max_chars: int) -> Counts:
    c = Counts()
    for p in paths:
        for item in lines(p, max_chars):
            if isinstance(item, Line) and not item.text.strip():
                c.blank += 1
            else:
                c.lines += 1
    return c
