"""Checked writes: every byte written or an exception, never a torn line or a short file.

The one place for the low-level file writing everything else uses: the capture hook's
sample writer (inside SGLang), the driver, the shipper, the patcher. Standard library
only (imported inside the SGLang server).

- :func:`write_all` / :func:`pwrite_all` loop over short writes and raise when the
  kernel writes nothing (a full disk raises ENOSPC on its own);
- :func:`write_atomic` / :func:`write_text_atomic` replace a file through a temporary
  file + fsync + rename, removing the temporary on any error;
- :class:`JsonLog` appends whole JSON lines under ``flock``; a failed or short append is
  cut back to where it started (so a full disk leaves no torn line), and a torn last line
  left by a crash (a killed process) is cut off before the next append.
- :func:`quiet_when_stdout_closes` ends a command quietly (exit 141) when the reader of its
  stdout went away (``hs-patch status | head -1``): the one write that may fail silently.

Everything is created owner-only (files 0600, directories 0700: :func:`private_dirs`),
whatever the process's umask: hidden states are the served model's internals, and the
SGLang server may be started by hand, outside the role's unit (whose UMask is 0077).
"""

from __future__ import annotations

import errno
import fcntl
import functools
import hashlib
import json
import mmap
import os
import select
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, ParamSpec

P = ParamSpec("P")

PRIVATE = 0o600      # files: owner read/write (a umask can only take bits away)
PRIVATE_DIR = 0o700  # directories we create


def private_dirs(path: str | os.PathLike) -> Path:
    """Create ``path`` and any missing parent as owner-only directories (existing ones are left as
    they are: a capture dir under /dev/shm must never chmod /dev/shm); returns the path."""
    path = Path(path)
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=PRIVATE_DIR)
        except FileExistsError:  # made meanwhile by another process
            pass
    if not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a directory")
    return path


def disk_full(e: BaseException) -> bool:
    """A write refused for space (ENOSPC) or quota (EDQUOT): freeing space and running again helps."""
    return isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)


EXIT_STDOUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for a writer whose reader went away


def stdout_closed() -> bool:
    """stdout is a pipe (or socket, terminal) whose reader has gone: poll reports an error on it."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by an object without a descriptor
        return False
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def quiet_when_stdout_closes(main: Callable[P, int]) -> Callable[P, int]:
    """Wrap a command's ``main``: when the reader of stdout closes early (``| head -1``), end with
    exit 141, as a shell reports such a writer, and no BrokenPipeError traceback. stdout is then
    pointed at /dev/null, so Python's own flush at exit cannot fail again. A BrokenPipeError from
    anything else (a socket, a subprocess's stdin) is raised as before."""

    @functools.wraps(main)
    def run(*args: P.args, **kwargs: P.kwargs) -> int:
        try:
            try:
                return main(*args, **kwargs)
            finally:  # what is still buffered goes now, where a closed reader can be caught
                sys.stdout.flush()
        except BrokenPipeError:
            if not stdout_closed():
                raise
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return EXIT_STDOUT_CLOSED

    return run


def write_all(fd: int, data: Any) -> int:
    """Write all of ``data`` (any buffer) to ``fd``; return the byte count or raise OSError."""
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "write wrote nothing (disk full?)")
        view = view[n:]
    return total


def pwrite_all(fd: int, data: Any, offset: int) -> int:
    """Write all of ``data`` at ``offset`` (positional, thread-safe on one fd)."""
    view = memoryview(data).cast("B")
    total = len(view)
    while view:
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno.ENOSPC, "pwrite wrote nothing (disk full?)")
        view, offset = view[n:], offset + n
    return total


def write_atomic(path: str | os.PathLike, data: bytes, *, mode: int = PRIVATE, fsync: bool = True) -> None:
    """Replace ``path`` with ``data``: temp file in the same directory, fsync, rename.

    A reader sees the old file or the whole new one; on any error (disk full, failed
    fsync) the temporary is removed and the old file is left as it was.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        try:
            write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if os.path.getsize(tmp) != len(data):  # belt and braces: what is on disk is all of it
            raise OSError(errno.EIO, f"{tmp}: {os.path.getsize(tmp)} bytes on disk, {len(data)} written")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str, *, fsync: bool = False, mode: int = PRIVATE) -> None:
    """Replace a small text file (status, progress, parameters) so a reader never sees half of it."""
    write_atomic(path, text.encode("utf-8"), fsync=fsync, mode=mode)


MAPPED_STEP = 256 << 20  # bytes hashed per call when mapped
RANGE = 64 << 20  # bytes a range of a ranged digest (one GIL hand-over a range inside SGLang, as store.STEP)
RANGED = "sha256r64m:"  # a ranged digest: this, then the sha256 of the sha256 digests of its RANGE-byte ranges
_HASHERS: list[Any] = []  # the shared pool that hashes ranges side by side (made on first use)
_HASHERS_LOCK = threading.Lock()


def hashing_pool() -> Any:
    """The threads that hash a file's ranges side by side (hashlib releases the GIL on large buffers): one
    pool a process, 2 to 8 threads (one a CPU). Its tasks never wait on anything, so a writer's job may
    wait on them."""
    with _HASHERS_LOCK:
        if not _HASHERS:
            from concurrent.futures import ThreadPoolExecutor
            threads = max(2, min(8, os.cpu_count() or 1))
            _HASHERS.append(ThreadPoolExecutor(threads, thread_name_prefix="hs_patch-hash"))
        return _HASHERS[0]


def side_by_side(fn: Callable[[Any], Any], items: Any) -> list[Any]:
    """``[fn(x) for x in items]``, run on :func:`hashing_pool`'s threads side by side (fn's hashing and
    writing release the GIL). Returns or raises (the first failure, in order) only once every call has
    ended: none may still write into a descriptor the caller closes next. One item runs in the calling thread
    (most samples are under one range: no hand-off for nothing)."""
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    jobs = [hashing_pool().submit(fn, x) for x in items]
    for job in jobs:
        job.exception()  # waits for it, whatever it raised
    return [job.result() for job in jobs]


def ranged(range_digests: list[bytes]) -> str:
    """The ranged digest of a file whose RANGE-byte ranges, in order, have these sha256 digests."""
    return RANGED + hashlib.sha256(b"".join(range_digests)).hexdigest()


def digests_apart(a: str, b: str, at_least: int = 16) -> tuple[str, str]:
    """Two recorded digests cut short enough to print yet long enough to tell apart: each keeps its kind
    (``sha256r64m:`` for a ranged one) and at least ``at_least`` hex digits, more where they share a
    longer prefix (a fixed 12 characters of a ranged digest was its label and one hex digit)."""
    def split(d: str) -> tuple[str, str]:
        return (RANGED, d[len(RANGED):]) if d.startswith(RANGED) else ("", d)

    (ka, ha), (kb, hb) = split(a), split(b)
    n = at_least
    if ka == kb:
        while n < max(len(ha), len(hb)) and ha[:n] == hb[:n]:
            n += 4
    return ka + ha[:n], kb + hb[:n]


def size_change(size: int, expected: int) -> str:
    """How a file's size differs from what was recorded, in words ("truncated" only when it is shorter)."""
    if size < expected:
        return f"{expected - size} bytes short (truncated?)"
    return f"{size - expected} bytes over (grew: appended to or overwritten?)"


def file_digest(path: str | os.PathLike, like: str = "", *, mapped: bool = False) -> tuple[int, str]:
    """(size, digest) of a file, of the kind of ``like`` (a recorded digest): :func:`file_ranged` for a
    ranged one (the capture writer's, since issue #22), else plain :func:`file_sha256` (every sample
    written before, exports, datasets): so a sample is verified the way it was hashed."""
    if like.startswith(RANGED):
        return file_ranged(path, mapped=mapped)
    return file_sha256(path, mapped=mapped)


def file_ranged(path: str | os.PathLike, *, mapped: bool = False) -> tuple[int, str]:
    """(size, ranged digest) of a file, its ranges hashed side by side (:func:`hashing_pool`): a 221 MB sample
    in about a quarter of one core's sha256 time. ``mapped`` as in :func:`file_sha256` (own files only)."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        if mapped and size:
            with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                view = memoryview(m)
                try:
                    digests = side_by_side(lambda s: hashlib.sha256(view[s:s + RANGE]).digest(),
                                           range(0, size, RANGE))
                finally:
                    view.release()
            return size, ranged(digests)
        digests = side_by_side(lambda s: _range_sha256(f.fileno(), s, min(RANGE, size - s)),
                               range(0, size, RANGE))
    return size, ranged(digests)


def _range_sha256(fd: int, start: int, length: int) -> bytes:
    """sha256 of up to ``length`` bytes of ``fd`` from ``start``, read in 8 MiB blocks (a file cut meanwhile
    gives a digest of what is there, which the caller's comparison then rejects, as file_sha256's does)."""
    h = hashlib.sha256()
    buf = bytearray(min(length, 8 << 20))
    view = memoryview(buf)
    while length:
        n = os.preadv(fd, [view[:min(length, len(buf))]], start)
        if n <= 0:
            break
        h.update(view[:n])
        start, length = start + n, length - n
    return h.digest()


def file_sha256(path: str | os.PathLike, *, mapped: bool = False) -> tuple[int, str]:
    """(size, sha256) of a file, read in 8 MiB blocks (each block hashed while it is in the CPU cache).

    ``mapped``: hashed in place through mmap, 256 MiB per call: about 10% more CPU than reading
    (page faults), but two GIL hand-overs per 8 MiB block become one per 256 MiB, which is what
    counts inside SGLang, where the capture writer's threads share the GIL with the scheduler
    (bench/writer_ceiling.py). Only for a file no other process can truncate meanwhile (a
    mapped page past a new end is a SIGBUS): the writer's own temporary files."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        if mapped:
            size = os.fstat(f.fileno()).st_size
            if size:
                with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
                    view = memoryview(m)
                    try:
                        for start in range(0, size, MAPPED_STEP):
                            h.update(view[start:start + MAPPED_STEP])
                    finally:
                        view.release()
            return size, h.hexdigest()
        size = 0
        buf = bytearray(8 << 20)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
            size += n
    return size, h.hexdigest()


def _cut_torn_tail(fd: int, size: int) -> int:
    """If the file does not end with a newline (a writer was killed mid-line), cut the torn
    line off; return the new size. Only called under the file's flock."""
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return size
    start = max(0, size - (1 << 20))
    while True:
        chunk = os.pread(fd, size - start, start)
        nl = chunk.rfind(b"\n")
        if nl >= 0 or start == 0:
            keep = start + nl + 1 if nl >= 0 else 0
            os.ftruncate(fd, keep)
            return keep
        start = max(0, start - (1 << 20))


def append_line(path: str | os.PathLike, line: bytes, *, mode: int = PRIVATE, fsync: bool = False) -> None:
    """Append one complete line (ending in b"\\n") to ``path``, whole or not at all."""
    if not line.endswith(b"\n"):
        raise ValueError("append_line needs a complete line")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, mode)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        size = _cut_torn_tail(fd, os.fstat(fd).st_size)
        try:
            write_all(fd, line)
            if fsync:
                os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)  # no torn line: the log is as it was before this append
            raise
    finally:
        os.close(fd)


class JsonLog:
    """An append-only JSON-lines log shared by processes (one whole line per record).

    ``append`` serializes with sorted keys; records must be JSON-serializable (``default``
    turns anything else into a string, e.g. paths in a ledger).
    """

    def __init__(self, path: str | os.PathLike, *, mode: int = PRIVATE, fsync: bool = False):
        self.path = Path(path)
        private_dirs(self.path.parent)
        self.mode, self.fsync = mode, fsync
        self._lock = threading.Lock()

    def append(self, record: Mapping[str, Any]) -> None:
        line = (json.dumps(record, separators=(",", ":"), sort_keys=True, default=str) + "\n").encode()
        with self._lock:
            append_line(self.path, line, mode=self.mode, fsync=self.fsync)


UNREADABLE = object()  # what json_lines gives for a line that is not JSON


def json_lines(path: str | os.PathLike) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of an append-only JSON-lines file, ``UNREADABLE``
    for a line that is not JSON; a torn last line (a crash mid-append; the next append cuts it) is
    passed over."""
    lines = Path(path).read_bytes().split(b"\n")
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            value = json.loads(raw)
        except (ValueError, RecursionError):
            if n == len(lines):  # no newline after it: torn; a bad line that ends in one was written whole
                continue
            value = UNREADABLE
        yield n, value


def read_jsonl(path: str | os.PathLike, *, strict: bool = True) -> list[dict[str, Any]]:
    """The records of an append-only JSON-lines log ([] if it does not exist).

    A torn last line (a crash mid-append; the next append cuts it) is ignored. A bad line
    elsewhere raises ValueError naming the file and line, unless ``strict`` is false
    (then it is skipped).
    """
    path = Path(path)
    if not path.exists():
        return []
    records = []
    for n, rec in json_lines(path):
        if isinstance(rec, dict):
            records.append(rec)
        elif strict:
            why = "unreadable line" if rec is UNREADABLE else "not a JSON object"
            raise ValueError(f"{path}:{n}: {why}; it was not written by hs_patch")
    return records
