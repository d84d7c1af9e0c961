"""What ``fab`` does on the GPU host over SSH: start, watch, stop (its checks first: :mod:`host_checks`).

Every function takes a :class:`~hs_patch.control.shell.Shell` (root on the host, through sudo when the
inventory's SSH user is not root; every argument quoted) and the host's :class:`~hs_patch.control.inventory.Target`.
The driver and the shipper run as transient systemd units (``hs-drive-<run>``, ``hs-ship-<run>``) under the
service user, sandboxed (:func:`unit_hardening`), so the job goes on when the SSH session drops; a killed one is
restarted (the driver ``Restart=on-abnormal``; the shipper ``Restart=on-failure`` except after exit 2, bad
configuration: it waits out storage outages itself), and both resume where they stopped.
"""

from __future__ import annotations

import json
import posixpath
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from hs_patch import names
from hs_patch.control import storage
from hs_patch.control.inventory import Target
from hs_patch.control.shell import RemoteError, Shell, StatusUnreadable, cmd
from hs_patch.control.storage import destination

__all__ = ["RemoteError", "prepare", "upload", "start_server", "check_kv_cache", "destination",
           "start_jobs", "unit_hardening", "snapshot", "runs", "stop", "all_stopped", "ship_now", "units"]
from hs_patch.engine import kv_cache
from hs_patch.samples.files import file_sha256


def units(run: str) -> tuple[str, str]:
    return f"hs-drive-{run}", f"hs-ship-{run}"


MAX_SAMPLE_TOKENS = 32768  # fab extract --max-tokens default, as hs-extract drive's


def as_service_user(t: Target, *argv: Any) -> list[Any]:
    """``argv`` run as the service user (sudo -u, its own HOME)."""
    return ["sudo", "-u", t.service_user, "-H", "--", *argv]


def last_json(text: str) -> dict[str, Any]:
    """The last line of ``text`` that is a JSON object ({} when none is)."""
    for line in reversed((text or "").strip().splitlines()):
        try:
            return json.loads(line)
        except ValueError:
            continue
    return {}


# --------------------------------------------------------------------------- starting


def prepare(c: Shell, t: Target, run: str) -> None:
    for d in (t.state_dir(run), t.samples_dir(run), f"{t.state_dir(run)}/data", t.dump_dir):
        c.run(["install", "-d", "-o", t.service_user, "-g", t.service_user, "-m", "0750", d], check=True)


def upload(c: Shell, t: Target, run: str, local: Path) -> str:
    """Copy a dataset to the run's state dir (skipped when the same bytes are there)."""
    remote = f"{t.state_dir(run)}/data/{local.name}"
    digest = file_sha256(local)[1]  # in blocks: a dataset of many GB is never read into memory whole
    r = c.run(["sha256sum", "--", remote])
    if not (r.ok and r.stdout.split()[:1] == [digest]):
        c.put(local, remote, owner=t.service_user)
    return remote


def start_server(c: Shell, t: Target, timeout: int, progress: Callable[[str], None]) -> None:
    """Start the server unit (no-op when running) and wait for /health_generate (no key needed there). The start
    does not block: the unit's pre-start checks (a JIT compile, an all-reduce over every GPU) take minutes on a cold
    host, and the loop below waits for them as for the load, up to ``timeout``."""
    unit = f"{t.service}.service"
    c.run(cmd("systemctl", "reset-failed", unit) + " 2>/dev/null; " + cmd("systemctl", "start", "--no-block", unit),
          check=True)
    url = f"http://127.0.0.1:{int(t.server_port)}/health_generate"
    probe = [t.bin("python"), "-c", "import sys, urllib.request; "
             "sys.exit(urllib.request.urlopen(sys.argv[1], timeout=30).status != 200)", url]
    t0 = time.time()
    while True:
        if c.run(probe, timeout=60).ok:
            return
        state = c.run(["systemctl", "is-active", unit]).stdout.strip()
        # inactive with its start job still queued (waiting for the units it starts after) is not a failure
        if state in ("failed", "inactive") and not c.run(["systemctl", "list-jobs", "--no-legend", unit]).stdout.strip():
            log = c.run(["journalctl", "-u", unit, "-n", "30", "--no-pager"]).stdout
            raise RemoteError(f"the server unit {t.service} is {state}:\n{log}\nfix it, then run fab extract again")
        waited = time.time() - t0
        if waited > timeout:
            raise RemoteError(f"the server was not healthy after {timeout}s (journalctl -u {t.service}); "
                              "raise --server-timeout if the model takes longer to load")
        progress(f"waiting for {url} ({waited:.0f}s, unit {state})")
        time.sleep(5)


# Reads the running server's /server_info with its API key (as root, on the host; the server listens on loopback).
SERVER_INFO = ("import json, sys, urllib.request; key = open(sys.argv[2]).read().strip(); "
               "r = urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer ' + key}); "
               "print(json.dumps(json.load(urllib.request.urlopen(r, timeout=60))))")


def check_kv_cache(c: Shell, t: Target, max_tokens: int = MAX_SAMPLE_TOKENS) -> None:
    """Refuse a started server whose KV cache cannot hold the longest sample the driver sends
    (:func:`hs_patch.engine.kv_cache.shortfall`), before the driver starts."""
    url = f"http://127.0.0.1:{int(t.server_port)}/server_info"
    r = c.run([t.bin("python"), "-c", SERVER_INFO, url, t.api_key_file], timeout=120)
    info = last_json(r.stdout) if r.ok else {}
    if not info:
        said = ((r.stderr or r.stdout).strip().splitlines() or ["no answer"])[-1][-300:]  # the error, not the traceback
        raise RemoteError(f"on {t.host}: could not read {url}: {said}; the server unit {t.service} should answer it "
                          f"(journalctl -u {t.service})")
    short = kv_cache.shortfall(info, max_tokens, shorter="fab extract --max-tokens", service=t.service)
    if short:
        raise RemoteError(f"on {t.host}: {short}")


RUNNING = ("active", "activating", "reloading")  # a unit in these states runs (or is about to): not started again


def unit_state(c: Shell, unit: str) -> str:
    return c.run(["systemctl", "show", "-p", "ActiveState", "--value", f"{unit}.service"]).stdout.strip() or "unknown"


# systemd sandboxing of the driver and shipper units (docs/security.md: each setting and why).
# Neither needs a device, privileges, the kernel's knobs or another user's processes; both
# write only their run's directories. Not set: RemoveIPC (it would delete the service
# user's files in /dev/shm: the capture and samples dirs).
SANDBOX = ("NoNewPrivileges=yes", "ProtectSystem=strict", "ProtectHome=read-only", "PrivateTmp=yes",
           "PrivateMounts=yes", "PrivateUsers=yes",
           "PrivateDevices=yes", "PrivateIPC=yes", "ProtectKernelTunables=yes", "ProtectKernelModules=yes",
           "ProtectKernelLogs=yes", "ProtectControlGroups=yes", "ProtectClock=yes", "ProtectHostname=yes",
           "ProtectProc=invisible", "ProcSubset=pid", "RestrictNamespaces=yes", "RestrictRealtime=yes",
           "RestrictSUIDSGID=yes", "LockPersonality=yes", "MemoryDenyWriteExecute=yes",
           "SystemCallArchitectures=native", "SystemCallFilter=@system-service",
           "SystemCallFilter=~@privileged @resources", "SystemCallErrorNumber=EPERM", "CapabilityBoundingSet=",
           "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6", "UMask=0077")


DRIVER_DONE = "driver.done"  # the driver's end marker in its state dir (runstate.DONE): a following shipper ends on it
HIGH_WATER_PCT = 80  # the driver's default --high-water: it pauses sending once its filesystem is this much used

APART_FIX = ("set hs_dump_dir and hs_runs_samples_root under one directory at least two levels deep (both under "
             "/dev/shm by default): the driver moves each sample from one to the other inside its sandbox")


def shared_dir(t: Target) -> str | None:
    """The one writable path through which the driver reaches both the capture dir and the samples root.

    The driver adopts a sample by rename(2) from the capture dir into the samples dir, and
    rename fails with EXDEV between two ``ReadWritePaths=`` entries (each is a mount of its
    own inside the sandbox) even on one filesystem: both must be reached through one. None
    when they share less than two levels (``/`` or ``/dev``: too wide to make writable).
    """
    common = posixpath.commonpath([posixpath.normpath(t.dump_dir), posixpath.normpath(t.samples_root)])
    return common if len(PurePosixPath(common).parts) >= 3 else None


def unit_hardening(t: Target, run: str, job: str) -> list[str]:
    """systemd-run ``--property`` options sandboxing ``job`` (``drive`` or ``ship``) of ``run``."""
    if job == "drive" and shared_dir(t) is None:
        raise RemoteError(f"the capture dir {t.dump_dir} and the samples root {t.samples_root} are apart: {APART_FIX}")
    rw = [t.state_dir(run), str(shared_dir(t)) if job == "drive" else f"{t.samples_root}/{run}"]
    props = [*SANDBOX, "ReadWritePaths=" + " ".join(rw)]
    if job == "drive":  # talks to the local server only
        props += ["IPAddressDeny=any", "IPAddressAllow=localhost"]
    return [f"--property={p}" for p in props]


def start_jobs(c: Shell, t: Target, run: str, driver_args: list[str], *, dest: str | None = None,
               ship_only: bool = False) -> list[str]:
    """Start the driver (not with ``ship_only``) and (if shipping) the shipper units; leave running ones alone.
    ``dest``: where the shipper sends (default :func:`destination` of ``run``)."""
    drive, ship = units(run)
    started = []
    common = [f"--uid={t.service_user}", f"--gid={t.service_user}", "--property=RestartSec=5", "--property=TimeoutStopSec=180", "--property=KillMode=mixed",
              "--setenv=PYTHONUNBUFFERED=1", f"--working-directory={t.state_dir(run)}"]
    # the driver exits 130 when it stops on SIGTERM (fab stop): a clean stop, not a failure;
    # a tokenizer's own code (trust_remote_code) and the class AutoTokenizer picked (driver/tokenizer.py) are cached
    # in the run's state dir (the home is read-only): a resume or a restart of the unit loads the tokenizer sooner
    jobs = [] if ship_only else [(drive, ["--property=Restart=on-abnormal", "--property=SuccessExitStatus=130",
                                          f"--setenv=HF_MODULES_CACHE={t.state_dir(run)}/hf_modules",
                                          f"--setenv=HS_PATCH_CACHE_DIR={t.state_dir(run)}/cache",
                     *unit_hardening(t, run, "drive"), "--",
                     t.bin("hs-extract"), "drive", "--run", run, "--server", f"http://127.0.0.1:{int(t.server_port)}",
                     "--api-key-file", t.api_key_file, "--capture-dir", t.dump_dir, "--state-dir", t.state_dir(run),
                     "--samples-dir", t.samples_dir(run), *driver_args])]
    if t.ship_enabled:
        # the shipper waits out storage outages itself; exit 2 is bad configuration, exit 3 samples it could not
        # verify after its own retries (kept here) or lost at the destination: no restart (a restart tried the same
        # files again for ever, and fab's foreground never ended); fab names them, fab ship sends them
        jobs.append((ship, ["--property=Restart=on-failure", "--property=RestartPreventExitStatus=2 3",
                            *unit_hardening(t, run, "ship"), *storage.credential_properties(c, t), "--",
                            t.bin("hs-extract"), "ship", "--samples-dir", t.samples_dir(run),
                            "--state-dir", t.state_dir(run), "--dest", dest or destination(t, run),
                            *storage.ship_options(t), "--follow"]))
    for unit, argv in jobs:
        # systemd expands $NAME in a unit's command line at start: never let a path do that
        if any("$" in str(a) for a in argv):
            raise RemoteError(f"refusing to start {unit}: an argument holds '$' (systemd would expand it): "
                              f"{[a for a in argv if '$' in str(a)]}")
        if unit_state(c, unit) in RUNNING:
            continue
        c.run(cmd("systemctl", "reset-failed", f"{unit}.service") + " 2>/dev/null; "
              + cmd("systemctl", "stop", f"{unit}.service") + " 2>/dev/null")
        if unit == drive:  # an earlier driver's end marker: the shipper started next would take it for this one's
            c.run(["rm", "-f", "--", f"{t.state_dir(run)}/{DRIVER_DONE}"], check=True)
        c.run(["systemd-run", f"--unit={unit}", f"--description=hs-patch {unit}", *common, *argv], check=True)
        started.append(unit)
    return started


# --------------------------------------------------------------------------- watching and stopping


def snapshot(c: Shell, t: Target, run: str) -> dict[str, Any]:
    r = c.run([t.bin("hs-extract"), "snapshot", "--run", run, "--state-dir", t.state_dir(run),
               "--samples-dir", t.samples_dir(run), "--capture-dir", t.dump_dir, "--service", t.service], timeout=60)
    try:
        if r.ok:
            return json.loads(r.stdout)
    except ValueError:
        pass
    raise StatusUnreadable(f"cannot read the run's status on {t.host}: {(r.stderr or r.stdout).strip()[-300:]}; "
                           f"fab verify --host {t.name or t.host} checks the install there")


def runs(c: Shell, t: Target) -> list[str]:
    """The runs on the host (their state dirs under ``state_root``), newest first: directories with a run's
    name only (not a filesystem's lost+found, not a file left there)."""
    listed = c.run(cmd("ls", "-t", "-p", "-L", "--", t.state_root) + " 2>/dev/null").stdout.splitlines()
    return [n[:-1] for n in listed if n.endswith("/") and names.is_run_name(n[:-1])]


def stop(c: Shell, t: Target, run: str, *, server: bool = False) -> dict[str, str]:
    """Stop the driver, then the shipper (each finishes what is in flight), optionally the server."""
    drive, ship = units(run)
    for unit in (drive, ship):
        c.run(["systemctl", "stop", f"{unit}.service"], timeout=300)
    states = {u: unit_state(c, u) for u in (drive, ship)}
    if server:
        states[t.service] = stop_server(c, t)
    return states


def all_stopped(states: dict[str, str]) -> bool:
    """Whether every unit of a stop's ``states`` is down (inactive, or failed before or by the stop)."""
    return all(s in ("inactive", "failed") for s in states.values())


def in_words(states: dict[str, str]) -> str:
    """Units' states after a stop, as the operator reads them: 'hs-drive-r1 stopped, hs-ship-r1 stopped'."""
    words = {"inactive": "stopped", "failed": "stopped (it had failed: journalctl -u {u} says why)",
             "deactivating": "still stopping (systemctl status {u})", "active": "STILL RUNNING (systemctl status {u})",
             "unknown": "in an unknown state (systemctl status {u})"}
    return ", ".join(f"{u} {words.get(s, s).format(u=u)}" for u, s in states.items())


def stop_server(c: Shell, t: Target) -> str:
    """Stop the SGLang server unit (after the run's jobs); its state."""
    c.run(["systemctl", "stop", f"{t.service}.service"], timeout=300)
    return unit_state(c, t.service)


def ship_now(c: Shell, t: Target, run: str, *, dest: str | None = None) -> tuple[int, str]:
    """Drain shipping in the foreground (the follow unit is stopped first); it also records
    in the run's shipped.jsonl every sample the destination already holds."""
    _, ship = units(run)
    c.run(["systemctl", "stop", f"{ship}.service"], timeout=300)  # the unit's TimeoutStopSec is 180
    argv = [t.bin("hs-extract"), "ship", "--samples-dir", t.samples_dir(run), "--state-dir", t.state_dir(run),
            "--dest", dest or destination(t, run), *storage.ship_options(t)]
    if t.s3_url:  # its credentials reach only a unit (storage's module doc): the follow unit's sandbox, in front
        return storage.run_shipper_unit(c, t, ship, unit_hardening(t, run, "ship") + storage.credential_properties(c, t),
                                        argv)
    r = c.run(as_service_user(t, *argv), timeout=None)
    return r.exited, (r.stdout + r.stderr).strip()
