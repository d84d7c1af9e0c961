"""A command run in a pseudo-terminal, its screen read as the operator reads it (the live dashboards).

fab's dashboards redraw in place when they write to a terminal (rich's Live: cursor moves and
rewritten lines), so a test that wants what the operator saw runs fab in a pty of a known size,
keeps every byte with when it came, and reads a table row as its latest drawing.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import termios
import threading
import time
from typing import Any, Callable

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][A-Z0-9]")


class Screen:
    def __init__(self, cmd: list[str], *, cwd: str, env: dict[str, str], columns: int = 220, lines: int = 60):
        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        env = {**env, "COLUMNS": str(columns), "LINES": str(lines), "TERM": "xterm-256color"}
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                     start_new_session=True)
        os.close(slave)
        self.master = master
        self.chunks: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # EIO: the command ended and closed the terminal
                return
            if not data:
                return
            with self._lock:
                self.chunks.append((time.monotonic(), data.decode("utf-8", "replace")))

    def text(self, since: float = 0.0) -> str:
        """What was written (from ``since``, time.monotonic()), escape sequences removed."""
        with self._lock:
            raw = "".join(c for t, c in self.chunks if t >= since)
        return ANSI.sub("", raw).replace("\r\n", "\n").replace("\r", "\n")

    def row(self, label: str, since: float = 0.0) -> list[str] | None:
        """The cells of the latest drawing of the table row ``label`` (from ``since``), or None."""
        found = None
        for line in self.text(since).split("\n"):
            cells = _cells(line)
            if cells and cells[0] == label:
                found = cells
        return found

    def first(self, label: str, test: Callable[[list[str]], bool], since: float = 0.0) -> tuple[float, list[str]] | None:
        """(when, cells) of the first drawing of the row ``label`` (from ``since``) that passes ``test``: when
        the operator could first see it."""
        with self._lock:
            chunks = [(t, c) for t, c in self.chunks if t >= since]
        tail = ""
        for t, chunk in chunks:
            *whole, tail = (tail + chunk).split("\n")
            for line in whole:
                for part in ANSI.sub("", line).split("\r"):
                    cells = _cells(part)
                    if cells and cells[0] == label and test(cells):
                        return t, cells
        return None

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._reader.join(5)

    def last_lines(self, n: int = 3) -> list[str]:
        return [x.rstrip() for x in self.text().rstrip().split("\n") if x.strip()][-n:]

    def close(self) -> Any:
        """End the command if it still runs (by its own pid), and the terminal."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


def _cells(line: str) -> list[str]:
    """A drawn table line's cells (columns are two spaces or more apart; the panel's border dropped)."""
    return [c for c in re.split(r"\s{2,}", line.strip(" │|")) if c]
