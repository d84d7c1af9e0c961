"""The shipper's link to its destination: rsync over one multiplexed SSH connection, and
the verify-and-commit step (:mod:`hs_patch.host.shipping.at_destination`) run on the destination.

Destination layout under ``path``: ``samples/<key>.safetensors`` (verified files only),
``manifest.jsonl`` (rewritten atomically), ``.incoming/`` (rsync's landing directory;
rsync writes each file under a temporary name and renames it when complete, and keeps
an interrupted transfer in ``.incoming/.rsync-partial/`` to resume it). Nothing reaches
``samples/`` without its sha256 computed on the destination, so a partial or damaged
transfer can never pass for a sample.
"""

from __future__ import annotations

import ctypes
import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INCOMING = ".incoming"
REMOTE_SOURCE = (Path(__file__).parent / "at_destination.py").read_text()
# rsync exit codes after which verification decides per file: 0 ok, 23 some files not
# transferred, 24 some source files vanished (removed while queued).
RSYNC_PER_FILE = {0, 23, 24}
IO_TIMEOUT = 120  # seconds without I/O before rsync gives up on a stalled link


class ConfigError(ValueError):
    """Arguments or configuration that cannot work; the message says what to fix."""


class LinkError(RuntimeError):
    """The destination could not be reached, or refused an operation."""

    @property
    def permanent(self) -> bool:
        """A refusal that waiting does not cure (host key, authentication, unknown host, bad option);
        everything else (refused, timed out, reset, no route, a failing command) is an outage."""
        return PERMANENT.search(str(self)) is not None


# what ssh says when waiting cannot help (its own messages, not those of a command it runs), and the
# storage host's forced command refusing (gate.py: a --dest outside its ROOT, another hs-patch there), and the
# verify step finding a manifest line that is not JSON (at_destination.py)
PERMANENT = re.compile(r"Host key verification failed|REMOTE HOST IDENTIFICATION HAS CHANGED|"
                       r"Permission denied \((publickey|password|keyboard|gssapi|hostbased)|"
                       r"Could not resolve hostname|Bad configuration option|no such identity|"
                       r"Too many authentication failures|Bad owner or permissions|hs-ingest-gate: refused|"
                       r"hs-verify: refused")


@dataclass(frozen=True)
class Dest:
    host: str | None  # "[user@]host" (an SSH alias works), or None for a local directory
    path: str

    def __str__(self) -> str:
        return f"{self.host}:{self.path}" if self.host else self.path

    def rsync_target(self, sub: str) -> str:
        path = f"{self.path.rstrip('/')}/{sub}/"
        return f"{self.host}:{path}" if self.host else path


def parse_dest(text: str) -> Dest:
    """``[user@]host:path`` (as rsync reads it: a ``:`` before any ``/``) or a local path."""
    head, colon, tail = text.partition(":")
    if colon and "/" not in head:
        if not head or not tail:
            raise ConfigError(f"--dest {text!r}: give [user@]host:path, e.g. hs-storage:/srv/hs-samples/RUN")
        return Dest(head, tail)
    if not text:
        raise ConfigError("--dest is empty: give [user@]host:path or a local directory")
    return Dest(None, text)


# ssh -o values that let a connection go on without a verified host key (ssh_config(5):
# StrictHostKeyChecking takes yes/no/off/false/ask/accept-new; "none" and /dev/null
# empty the known hosts; KnownHostsCommand and DNS answers replace them).
_UNVERIFIED = {"stricthostkeychecking": {"no", "off", "false", "accept-new", "0"},
               "userknownhostsfile": {"/dev/null", "none"}, "globalknownhostsfile": {"/dev/null", "none"},
               "verifyhostkeydns": {"yes", "true"}, "knownhostscommand": None}


def unverified_host_key_options(options: list[str]) -> list[str]:
    """The ``-o`` values among ``options`` that would accept a host key nobody checked."""
    bad = []
    for opt in options:
        name, _, value = opt.strip().replace("=", " ", 1).partition(" ")
        refused = _UNVERIFIED.get(name.lower(), set())
        words = value.strip().strip('"').lower().split()
        if refused is None or any(w in refused for w in words):
            bad.append(opt)
    return bad


@dataclass
class SshOptions:
    key: str | None = None
    port: int | None = None
    known_hosts: str | None = None
    options: list[str] = field(default_factory=list)  # "Name=value", passed as ssh -o
    # DANGER: ship to a host whose key nobody checked (see --allow-unverified-host-key)
    allow_unverified_host_key: bool = False

    def __post_init__(self) -> None:
        bad = unverified_host_key_options(self.options)
        if bad and not self.allow_unverified_host_key:
            raise ConfigError(
                f"--ssh-option {', '.join(bad)} would ship to a host whose key is not verified (a changed or "
                "spoofed storage host would receive the samples without a word). Put the storage host's key in "
                "known_hosts (--known-hosts FILE) instead; only for a throw-away test setup, add "
                "--allow-unverified-host-key")

    def argv(self) -> list[str]:
        """The ssh command; ssh keeps the first value given for an option, so the user's
        ``options`` come first and ours are only defaults (``~/.ssh/config`` comes last)."""
        argv = ["ssh"]
        for opt in self.options:
            argv += ["-o", opt]
        if self.key:
            argv += ["-i", self.key, "-o", "IdentitiesOnly=yes"]
        if self.port:
            argv += ["-p", str(self.port)]
        if self.known_hosts:
            argv += ["-o", f"UserKnownHostsFile={self.known_hosts}"]
        for opt in ("StrictHostKeyChecking=yes", "BatchMode=yes", "ConnectTimeout=20",
                    "ServerAliveInterval=15", "ServerAliveCountMax=4"):
            argv += ["-o", opt]
        return argv


_libc = ctypes.CDLL(None, use_errno=True)


def _child_setup() -> None:
    """In each child: die with the shipper (a killed shipper leaves no rsync or ssh
    writing behind its back: PR_SET_PDEATHSIG), and keep out of its terminal's process
    group, so Ctrl-C reaches only the shipper, which finishes the batch first."""
    _libc.prctl(1, signal.SIGTERM)


def _tail(text: bytes | str, n: int = 600) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return text.strip()[-n:]


class Link:
    """Use as a context manager: opens the SSH master connection and closes it."""

    def __init__(self, dest: Dest, ssh: SshOptions, *, bwlimit_kbps: int = 0):
        self.dest = dest
        self.bwlimit_kbps = bwlimit_kbps
        self._ssh_base = ssh.argv()
        self._ssh: list[str] = []
        self._tmp: str | None = None
        self._master: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Link:
        if self.dest.host:
            self._tmp = tempfile.mkdtemp(prefix="hs-ship-")
            control = Path(self._tmp) / "cm"
            self._ssh = self._ssh_base + ["-o", f"ControlPath={control}"]
            log_path = Path(self._tmp) / "master.log"
            with open(log_path, "wb") as log:
                self._master = subprocess.Popen(
                    self._ssh + ["-o", "ControlMaster=yes", "-o", "ControlPersist=no", "-N", self.dest.host],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                    preexec_fn=_child_setup, start_new_session=True)
            deadline = time.monotonic() + 30
            while not control.exists():
                if self._master.poll() is not None or time.monotonic() > deadline:
                    why = _tail(log_path.read_bytes()) or "no answer within 30 s"
                    self.__exit__(None, None, None)
                    raise LinkError(
                        f"cannot open an SSH connection to {self.dest.host}: {why}. Check the host name, "
                        "--ssh-port, --ssh-key and that the host key is in known_hosts (--known-hosts; "
                        "StrictHostKeyChecking=yes unless --ssh-option says otherwise), or ~/.ssh/config.")
                time.sleep(0.05)
            self._ssh += ["-o", "ControlMaster=no"]
        return self

    def alive(self) -> bool:
        """Whether the SSH master connection still runs (always true for a local destination)."""
        if not self.dest.host:
            return True
        return self._master is not None and self._master.poll() is None

    def reopen(self) -> None:
        """A new SSH master connection after the old one died (an outage); LinkError if it cannot open."""
        self.__exit__(None, None, None)
        self.__enter__()

    def __exit__(self, *exc: Any) -> None:
        if self._master is not None:
            self._master.terminate()
            try:
                self._master.wait(10)
            except subprocess.TimeoutExpired:
                self._master.kill()
                self._master.wait()
            self._master = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def send(self, src_dir: Path, names: list[str], *, recheck: bool = False) -> tuple[int, str]:
        """rsync ``names`` (in ``src_dir``) into the destination's ``.incoming/``.

        Files already at the destination with the same size and mtime (in ``.incoming/``
        or ``samples/``) are not sent again; verification decides whether they are right.
        ``recheck`` sends every file whatever the destination holds (after a mismatch).
        Returns rsync's exit code and the end of its error output.
        """
        # --modify-window=-1: mtimes to the nanosecond (rsync's default, whole seconds, took another shipper's
        # copy of a sample landed in the same second with the same size for this one's, and never sent it)
        argv = ["rsync", "--times", "--modify-window=-1", "--partial-dir=.rsync-partial", f"--timeout={IO_TIMEOUT}",
                "--from0", "--files-from=-"]
        argv += ["--ignore-times"] if recheck else ["--compare-dest=../samples"]
        if self.bwlimit_kbps:
            argv.append(f"--bwlimit={self.bwlimit_kbps}")
        if self.dest.host:
            argv += ["-e", shlex.join(self._ssh)]
        argv += [f"{src_dir}/", self.dest.rsync_target(INCOMING)]
        p = subprocess.run(argv, input=b"\0".join(n.encode() for n in names), stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, preexec_fn=_child_setup, start_new_session=True)
        return p.returncode, _tail(p.stderr)

    def start_commit(self, files: list[dict[str, Any]], *, list_entries: bool = False, check: str = "",
                     timeout: float = 300) -> Commit:
        """Start verifying ``files`` on the destination and committing those that match (see
        ship_remote); the shipper sends the next batch meanwhile. With no files it only
        checks that the destination is reachable and writable."""
        if self.dest.host:
            argv = self._ssh + [self.dest.host, "python3 -c " + shlex.quote(REMOTE_SOURCE)]
        else:
            argv = [sys.executable, "-c", REMOTE_SOURCE]
        # bounded: hashing at >= 20 MB/s plus the connection's own limits; the step ends itself after it too
        seconds = timeout + sum(f["bytes"] for f in files) / 20e6
        request = {"root": self.dest.path, "files": files, "list": list_entries, "check": check, "seconds": seconds}
        return Commit(argv, request, str(self.dest), timeout=seconds)

    def commit(self, files: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return self.start_commit(files).wait()

    def check_destination(self, deep: bool = False) -> dict[str, Any]:
        """What the destination holds, checked (at_destination's module doc): ``entries`` (key, file,
        bytes, sha256, sample_id of every sample its manifest lists, once the damaged are dropped),
        ``damaged`` (key, file, why) and ``checked`` (how many files were looked at)."""
        # a deep check hashes every file there: no time limit worth guessing (the link's own keepalives stay)
        return self.start_commit([], list_entries=True, check="deep" if deep else "cheap",
                                 timeout=86400.0 if deep else 600.0).wait(answer=None)


class Commit:
    """One verify-and-commit run on the destination (stdin, stdout, stderr in temp files,
    so that nothing blocks while it runs in the background)."""

    def __init__(self, argv: list[str], request: dict[str, Any], where: str, timeout: float):
        self.where, self.timeout = where, timeout
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        with tempfile.TemporaryFile() as stdin:
            stdin.write(json.dumps(request).encode())
            stdin.seek(0)
            self._proc = subprocess.Popen(argv, stdin=stdin, stdout=self._out, stderr=self._err,
                                          preexec_fn=_child_setup, start_new_session=True)
        self._deadline = time.monotonic() + timeout

    def wait(self, answer: str | None = "results") -> Any:
        """The per-file results (another part of the answer, or all of it with None); LinkError if the
        destination did not answer."""
        try:
            rc = self._proc.wait(max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise LinkError(f"verification on {self.where} took more than {self.timeout:.0f} s") from None
        out, err = self._read(self._out), self._read(self._err)
        if rc != 0:  # a refusal's own line first: a long one must not lose the words that make it permanent
            said = next((x for x in err.decode(errors="replace").splitlines() if PERMANENT.search(x)), "")
            raise LinkError(f"verification on {self.where} failed (exit {rc}): {said[:1000] or _tail(err)}")
        try:
            doc = json.loads(out)
            return doc if answer is None else doc[answer]
        except (ValueError, KeyError, TypeError):
            raise LinkError(f"verification on {self.where} gave no answer: {_tail(out)} {_tail(err)}") from None

    def kill(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._out.close()
        self._err.close()

    @staticmethod
    def _read(f: Any) -> bytes:
        f.seek(0)
        data = f.read()
        f.close()
        return data
