"""The server's capture directory as the driver sees it.

The capture hook writes ``<key>.safetensors`` and appends ``op: add`` to
``manifest.jsonl`` when a file is complete. :class:`CaptureWatcher` tails that
manifest in one thread (incrementally: the file grows over a whole run) and lets the
driver's workers wait for a key that is added *after* they sent its request, so a
stale file of an earlier request for the same tokens is never mistaken for the new
one. It also removes raw samples (file + ``op: remove``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Optional

from hs_patch.samples import intent, store


class RawTimeout(TimeoutError):
    pass


class CaptureWatcher:
    def __init__(self, directory: str | os.PathLike, *, poll: float = 0.02):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / store.MANIFEST
        self.manifest = store.Manifest(self.directory)
        self.poll = poll
        self.seq = 0                                   # number of add records seen so far
        self.live: dict[str, dict[str, Any]] = {}      # key -> latest add record (with "_seq")
        self._offset = 0   # the end of the last complete line read
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self.read_new()
        self._thread = threading.Thread(target=self._run, name="hs-capture-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self.read_new()
            except OSError:
                pass  # the directory is briefly unavailable; try again at the next poll

    def read_new(self) -> None:
        """Read the lines completed since the last call and wake the waiters.

        Only whole lines are consumed: the offset stays at the end of the last complete line, so
        an append cut short (a full disk: the writer cuts the file back to where the line began
        and the next append writes there; a killed writer: the next append cuts the torn line off)
        is read again as it finally stands, never glued to the line after it."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        with self._cond:
            if size < self._offset:  # complete lines went away: the manifest was replaced, read it again
                self._offset, self.live = 0, {}
            if size == self._offset:
                return
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read(size - self._offset)
            end = data.rfind(b"\n") + 1  # an incomplete last line is read again, whole, next time
            if not end:
                return
            self._offset += end
            for raw in data[:end].split(b"\n"):
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except ValueError:
                    continue  # a line torn by a crash of the writer
                if not isinstance(rec, dict) or not isinstance(rec.get("key"), str):
                    continue  # not a record of the hook's writer
                if rec.get("op") == "add" and "file" in rec:
                    self.seq += 1
                    self.live[rec["key"]] = dict(rec, _seq=self.seq)
                elif rec.get("op") == "remove":
                    self.live.pop(rec["key"], None)
            self._cond.notify_all()

    def wait(self, key: str, after: int, timeout: float) -> dict[str, Any]:
        """The add record of ``key`` appended after add number ``after``; RawTimeout if none in time."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                rec = self.live.get(key)
                if rec is not None and rec["_seq"] > after:
                    return rec
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RawTimeout(key)
                self._cond.wait(min(left, 0.5))

    def get(self, key: str) -> Optional[dict[str, Any]]:
        with self._cond:
            return self.live.get(key)

    def keys(self) -> list[str]:
        with self._cond:
            return list(self.live)

    def remove(self, key: str, **why: Any) -> bool:
        """Delete a raw sample (and its intent) and record ``op: remove``; False if it was not there."""
        with self._cond:
            rec = self.live.pop(key, None)
        if rec is None:
            return False
        (self.directory / rec["file"]).unlink(missing_ok=True)
        intent.remove(self.directory, key)
        self.manifest.remove(key, **why)
        return True

    def forget(self, key: str, **why: Any) -> None:
        """Record ``op: remove`` for a sample whose file was moved away (adopted)."""
        with self._cond:
            self.live.pop(key, None)
        self.manifest.remove(key, **why)
