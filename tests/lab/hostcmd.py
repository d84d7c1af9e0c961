"""Commands, processes and mounts on this machine, as the test-host lab runs and watches them.

Processes are known by pid AND start time (a reused pid is not ours); nothing is found or killed
by name.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class LabError(RuntimeError):
    """Raised with a message that says what to do."""


def tools_of_this_python() -> None:
    """Put this Python's scripts directory first on PATH, for this process and what it starts: the tools run
    by name (fab, ansible-playbook, molecule, hs-extract, python3 in the playbooks' local steps) are then the
    ones installed with it, as in an activated venv (the README runs .venv/bin/python without activating)."""
    here = str(Path(sys.executable).parent)  # not resolved: a venv's python is a link to the base one
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != here:
        os.environ["PATH"] = here + (os.pathsep + path if path else "")


def run(cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("text", True)
    proc = subprocess.run(cmd, check=False, **kw)
    if check and proc.returncode != 0:
        raise LabError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr or ''}{proc.stdout or ''}")
    return proc


@contextlib.contextmanager
def umask(mask: int):
    """Run the block under ``mask``, restoring the caller's umask after."""
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@contextlib.contextmanager
def file_locked(lock_file: Path):
    """Hold an exclusive flock on ``lock_file`` (made with its directory): one builder of a shared
    cache at a time, across processes (the suite's two workers, another checkout's CI)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def log(msg: str) -> None:
    print(f"testhosts: {msg}", file=sys.stderr, flush=True)


def proc_start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int | None, start: str | None) -> bool:
    """True if ``pid`` still is the process we started (pid reuse guarded by start time)."""
    if not pid:
        return False
    now = proc_start_time(pid)
    if now is None:
        return False
    if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return start is None or now == start


def wait_gone(pid: int, start: str | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    for _ in range(int(timeout * 10) + 1):
        if not alive(pid, start):
            return True
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return not alive(pid, start)


def is_mount(path: Path) -> bool:
    target = str(path.resolve())
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == target for line in f)


def remove_host(host: dict, stop_timeout_s: int) -> None:
    """Stop one lab host's systemd-nspawn (by recorded pid and start), unmount its overlay, delete its netns and veth."""
    pid = host.get("pid")
    if pid and alive(pid, host.get("pid_start")):
        # boot_loop passes SIGTERM to nspawn, which powers the guest off in order (down() sent it already).
        os.kill(pid, signal.SIGTERM)
        if not wait_gone(pid, host.get("pid_start"), stop_timeout_s):
            log(f"{host['name']}: no clean shutdown in {stop_timeout_s}s, killing pid {pid} and its process group")
            # the recorded pid leads its group (boot_loop.py and the systemd-nspawn it runs)
            os.killpg(pid, signal.SIGKILL) if os.getpgid(pid) == pid else os.kill(pid, signal.SIGKILL)
            if not wait_gone(pid, host.get("pid_start"), 10):
                raise LabError(f"systemd-nspawn pid {pid} did not exit")
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG) if pid else None
    merged = Path(host["dir"]) / "merged"
    if host.get("mounted") and is_mount(merged):
        for _ in range(10):
            if run(["umount", str(merged)], check=False).returncode == 0:
                break
            time.sleep(0.5)
        else:
            raise LabError(f"could not unmount {merged}")
    if host.get("netns_created"):
        for _ in range(10):
            if not Path("/run/netns", host["netns"]).exists():
                break
            if run(["ip", "netns", "del", host["netns"]], check=False).returncode == 0:
                break
            time.sleep(0.5)
        else:
            raise LabError(f"could not delete network namespace {host['netns']}")
        if run(["ip", "link", "show", host["veth"]], check=False).returncode == 0:
            run(["ip", "link", "del", host["veth"]], check=False)
    propagate = Path("/run/systemd/nspawn/propagate", host.get("machine", ""))
    if host.get("machine") and propagate.is_dir():
        with contextlib.suppress(OSError):
            propagate.rmdir()
