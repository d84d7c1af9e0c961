"""CPU seconds from /proc while a sweep row runs: a server's process group, and the capture writer's threads.

``GroupCpu``: every process of a server's group (launcher, scheduler, detokenizer): what writing costs
the capturing server beyond the pristine one, per GB of states. ``WriterThreads``: inside the scheduler
process that captures, each thread's user and system seconds, grouped by what the hook's status file
(``hook_status.json``: ``pid``, ``threads``, names to kernel thread ids) says it is: the writer's
coordinator (``hs_patch-writer``), its writers (``hs_patch-write_N``: whole requests hashed as written,
chunks written in place), the range hashers (``hs_patch-hash_N``: a chunked prompt's finishing read),
SGLang's scheduler (the process's main thread) and the rest (torch's, NCCL's threads). User time is
hashing and Python (sha256 is two thirds of a busy writer core on the CPU bench), system time the
kernel's copy into the page cache and page faults: where the writer's CPU per GB goes, by thread.
``py-spy`` (``--writer-profile``, where a ``py-spy`` binary is on PATH) adds their hottest native frames.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Optional

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
GROUPS = (("coordinator", "hs_patch-writer"), ("writers", "hs_patch-write_"), ("hashers", "hs_patch-hash_"))


def _stat_fields(path: Path) -> Optional[list[str]]:
    try:
        return path.read_text().rsplit(")", 1)[1].split()  # after the name: state, ppid, pgrp, ...
    except (OSError, IndexError):
        return None  # ended meanwhile


class GroupCpu:
    """CPU seconds (user + system) of every process in a server's process group while the block runs."""

    def __init__(self, pgid: int):
        self.pgid, self.seconds = pgid, None

    def total(self) -> Optional[float]:
        ticks, found = 0, False
        for stat in Path("/proc").glob("[0-9]*/stat"):
            rest = _stat_fields(stat)
            if rest is not None and int(rest[2]) == self.pgid:  # utime is the 12th field after the name, stime 13th
                ticks += int(rest[11]) + int(rest[12])
                found = True
        return ticks / TICK if found else None

    def __enter__(self) -> "GroupCpu":
        self._start = self.total()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self.total()
        self.seconds = None if None in (self._start, end) else round(end - self._start, 2)


def task_times(pid: int) -> dict[int, tuple[int, int]]:
    """Each thread of ``pid``: (user, system) clock ticks so far."""
    out = {}
    for stat in Path(f"/proc/{pid}/task").glob("[0-9]*/stat"):
        rest = _stat_fields(stat)
        if rest is not None:
            out[int(stat.parent.name)] = (int(rest[11]), int(rest[12]))
    return out


def hook_threads(dump: Path) -> tuple[Optional[int], dict[str, int]]:
    """The capturing process's pid and its capture threads (name -> kernel thread id) from hook_status.json."""
    try:
        doc = json.loads((dump / "hook_status.json").read_text())
    except (OSError, ValueError):
        return None, {}
    return doc.get("pid"), {str(k): int(v) for k, v in (doc.get("threads") or {}).items()}


def group_of(name: str) -> str:
    return next((g for g, prefix in GROUPS if name.startswith(prefix)), "other")


class WriterThreads:
    """User and system CPU seconds of the capturing scheduler's threads, by group, while the block runs.
    Threads the writer starts during the block (its pool grows on demand) count from zero. ``--writer-profile``:
    py-spy records the process meanwhile, its hottest frames per group in ``profile``."""

    def __init__(self, dump: Path, profile_to: Optional[Path] = None):
        self.dump, self.profile_to = dump, profile_to
        self.seconds: dict[str, dict[str, float]] = {}
        self.profile: dict[str, list] = {}
        self._spy: Optional[subprocess.Popen] = None

    def __enter__(self) -> "WriterThreads":
        self.pid, _ = hook_threads(self.dump)
        self._start = task_times(self.pid) if self.pid else {}
        spy = shutil.which("py-spy")
        if self.pid and self.profile_to is not None and spy:
            # (it pauses the process for each sample: the sweep profiles an extra row, never a measured one)
            self._spy = subprocess.Popen([spy, "record", "--pid", str(self.pid), "--native", "--threads", "--rate",
                                          "50", "--format", "raw", "--output", str(self.profile_to)],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self

    def per_gb(self, gb: float) -> dict[str, dict[str, float]]:
        """The groups' user and system seconds per GB of states written meanwhile."""
        return {g: {k: round(v / gb, 3) for k, v in t.items()} for g, t in self.seconds.items()} if gb else {}

    def __exit__(self, *exc: object) -> None:
        if not self.pid:
            return
        end = task_times(self.pid)
        _, names = hook_threads(self.dump)
        group = {tid: group_of(name) for name, tid in names.items()}
        group[self.pid] = "scheduler"  # the process's main thread: SGLang's scheduler loop and the hook's forward work
        sums: dict[str, list[int]] = {}
        for tid, (user, system) in end.items():
            u0, s0 = self._start.get(tid, (0, 0))
            acc = sums.setdefault(group.get(tid, "other"), [0, 0])
            acc[0] += user - u0
            acc[1] += system - s0
        self.seconds = {g: {"user": round(u / TICK, 2), "system": round(s / TICK, 2)} for g, (u, s) in sums.items()}
        if self._spy is not None:
            self._spy.send_signal(signal.SIGINT)  # py-spy writes its file when interrupted
            try:
                _, err = self._spy.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                self._spy.kill()
                err = "py-spy did not stop"
            self.profile = hottest_frames(self.profile_to, self.pid) if self.profile_to.exists() else \
                {"error": [err[-500:]]}


IDLE = re.compile(r"^(\w+\.)?(wait|get|_worker|select|_wait_for_tstate_lock|acquire|serve_forever|sleep) "
                  r"\((threading|queue|concurrent/futures/thread|selectors|socketserver)\.py")


def where(frames: list[str]) -> str:
    """What a sample of one thread was doing: ``idle`` (waiting for work), ``GIL`` (waiting to take the interpreter
    lock), or its innermost Python frame and the native frame under it (``_range_sha256
    (hs_patch/samples/files.py:255) > sha256_block_data_order (libcrypto.so.3)``)."""
    if any("take_gil" in f for f in frames[-6:]):
        return "GIL"
    py = next((f for f in reversed(frames) if ".py:" in f), "")
    if IDLE.match(py):
        return "idle"
    return f"{py} > {frames[-1]}" if py and frames[-1] != py else frames[-1]


def hottest_frames(raw: Path, pid: int, top: int = 12) -> dict[str, list]:
    """py-spy's raw (collapsed) stacks, each rooted at ``thread (TID): NAME``: per thread group, what its samples were
    doing (:func:`where`), the most frequent first, with their count and share of the group's busy samples (neither
    idle nor waiting for the GIL: those two are listed with their share of all the group's samples)."""
    got: dict[str, Counter] = {}
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        root, _, rest = stack.partition(";")
        if not rest or not count.isdigit() or not root.startswith("thread ("):
            continue
        tid, _, name = root[len("thread ("):].partition("): ")
        g = "scheduler" if tid == str(pid) else group_of(name)
        got.setdefault(g, Counter())[where(rest.split(";"))] += int(count)
    out = {}
    for g, c in got.items():
        total = sum(c.values())
        busy = total - c["idle"] - c["GIL"] or 1
        out[g] = [[w, n, round(n / (total if w in ("idle", "GIL") else busy), 3)] for w, n in c.most_common(top)]
    return out
