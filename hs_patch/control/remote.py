"""What ``fab`` does on the GPU host over SSH: preflight, start, watch, stop.

Every function takes a :class:`~hs_patch.control.shell.Shell` (root on the host, through sudo when the
inventory's SSH user is not root; every argument quoted) and the host's :class:`~hs_patch.control.inventory.Target`.
The driver and the shipper run as transient systemd units (``hs-drive-<run>``, ``hs-ship-<run>``) under the
service user, sandboxed (:func:`unit_hardening`), so the job goes on when the SSH session drops; a killed one is
restarted (the driver ``Restart=on-abnormal``; the shipper ``Restart=on-failure`` except after exit 2, bad
configuration: it waits out storage outages itself), and both resume where they stopped.
"""

from __future__ import annotations

import ipaddress
import json
import posixpath
import shlex
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Callable

from hs_patch.control import storage
from hs_patch.control.inventory import Target
from hs_patch.control.shell import RemoteError, Shell, cmd
from hs_patch.control.storage import destination

__all__ = ["RemoteError", "Check", "preflight", "prepare", "upload", "start_server", "check_kv_cache", "destination",
           "start_jobs", "unit_hardening", "snapshot", "runs", "stop", "all_stopped", "ship_now", "units"]
from hs_patch.engine import kv_cache
from hs_patch.engine.flags import args_violations
from hs_patch.samples.files import file_sha256


# A preflight finding. The readiness scripts on the host print the same fields as JSON and carry their
# own Check: they run there alone, and the control node imports no host code.
@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def units(run: str) -> tuple[str, str]:
    return f"hs-drive-{run}", f"hs-ship-{run}"


# --------------------------------------------------------------------------- preflight


MAX_SAMPLE_TOKENS = 32768  # fab extract --max-tokens default, as hs-extract drive's


def _as_service_user(t: Target, *argv: Any) -> list[Any]:
    return ["sudo", "-u", t.service_user, "-H", "--", *argv]


def preflight(c: Shell, t: Target, *, estimated_bytes: int | None, bytes_per_token: int,
              need_gpus: bool = True, max_tokens: int = MAX_SAMPLE_TOKENS) -> list[Check]:
    """Check the host can run an extraction; each failed check says what to do."""
    checks: list[Check] = []
    r = c.run(["true"])
    checks.append(Check("ssh", r.ok, f"{t.user}@{t.host}:{t.port}" + (" (sudo to root)" if t.become else ""),
                        "check the inventory's ansible_user/port/key (and sudo for a non-root user)"))
    if not r.ok:
        return checks
    r = c.run([t.bin("hs-patch"), "verify", "--json"])
    res = _last_json(r.stdout)
    checks.append(Check("patch", r.ok, res.get("message") or res.get("error") or r.stderr.strip(),
                        "run ansible-playbook site.yml (it installs SGLang and applies the patch)"))
    if need_gpus:
        r = c.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
        names = [x.strip() for x in r.stdout.splitlines() if x.strip()] if r.ok else []
        good = [n for n in names if t.gpu_model in n]  # hs_gpu_model: a part of the name nvidia-smi prints
        checks.append(Check("gpus", r.ok and len(good) == t.gpu_count == len(names),
                            f"{len(names)} GPU(s): {', '.join(sorted(set(names))) or r.stderr.strip() or 'none'}",
                            f"expected {t.gpu_count} x {t.gpu_model}: check the driver (nvidia-smi) or hs_gpu_count/"
                            "hs_gpu_model in the inventory"))
        checks.append(_gpu_ready(c, t))
    checks.append(_server_flags(c, t))
    checks.append(_api_key(c, t))
    r = c.run("cd / && " + cmd(*_as_service_user(t, "find", t.model_path, "-maxdepth", "1", "!", "-readable")))
    unreadable = r.stdout.split()
    has_config = c.run(["test", "-f", f"{t.model_path}/config.json"]).ok
    checks.append(Check("model", r.ok and not unreadable and has_config,
                        f"{t.model_path} readable by {t.service_user}" if r.ok and not unreadable else
                        f"{t.model_path}: not readable by {t.service_user}: {' '.join(unreadable)[:200] or r.stderr.strip()}",
                        f"put the model there and let {t.service_user} read it (chmod -R a+rX {t.model_path})"))
    # room for the run, or at least for its largest possible sample (the driver pauses
    # sending at 80% use and the shipper frees space as it goes)
    need = max(64 << 20, min(estimated_bytes or 0, bytes_per_token * max_tokens))
    shared = shared_dir(t)
    checks.append(Check("dirs", shared is not None, f"capture dir {t.dump_dir} and samples root {t.samples_root}"
                        + (f" both under {shared}" if shared else " apart"), APART_FIX))
    for label, path in (("dump space", t.dump_dir), ("samples space", t.samples_root)):
        space = _space(c, path)
        free = space[1] if space else None
        if label == "samples space" and not t.ship_enabled and estimated_bytes:
            # nothing ships the samples away: the whole run stays there, and the driver pauses for good once the
            # filesystem is HIGH_WATER_PCT used
            room = None if space is None else space[1] - space[0] * (100 - HIGH_WATER_PCT) // 100
            checks.append(Check(label, room is not None and room >= estimated_bytes,
                                f"{_gb(room)} for {path} below the driver's high water ({HIGH_WATER_PCT}% used), "
                                f"{_gb(estimated_bytes)} estimated for the run, which stays there (shipping is off)",
                                f"shipping is off (hs_ship_enabled: false): free {_gb(estimated_bytes - (room or 0))} "
                                "more there, run fewer lines (--limit), or ship to training storage (hs_storage_host "
                                "or hs_s3_url, then ansible-playbook site.yml --tags shipping)"))
            continue
        checks.append(Check(label, free is not None and free >= need, f"{_gb(free)} free for {path}",
                            f"free at least {_gb(need)} there (one sample of {max_tokens} tokens)"))
    if t.ship_enabled and t.s3_url:
        ok, said = storage.preflight_bucket(c, t, [f"--property={p}" for p in SANDBOX]
                                            + storage.credential_properties(c, t))
        checks.append(Check("storage", ok, said, "fix the bucket, its endpoint or the credentials (hs_s3_* in the "
                            "inventory and the vault; ansible-playbook site.yml --tags shipping installs them)"))
    elif t.ship_enabled:
        # ssh joins its arguments into one line the far shell reads: hand it one quoted line
        r = c.run(_as_service_user(t, "ssh", "-o", "BatchMode=yes", "--", t.storage_alias,
                                   cmd("df", "-Pk", t.storage_dir)), timeout=60)
        free = int(r.stdout.splitlines()[-1].split()[3]) * 1024 if r.ok and r.stdout.strip() else None
        ok = free is not None and (estimated_bytes is None or free >= estimated_bytes)
        checks.append(Check("storage", ok, f"{t.storage_alias}:{t.storage_dir}: {_gb(free)} free, "
                            f"{_gb(estimated_bytes)} estimated for what this run still ships" if r.ok else (r.stderr.strip() or r.stdout.strip())[-300:],
                            "fix the storage target (ansible-playbook site.yml configures it) or free space there"))
    return checks


def _gpu_ready(c: Shell, t: Target) -> Check:
    """The JIT toolchain and the all-GPU NCCL all-reduce (skipped while the server holds the GPUs), through the
    services role's gpu-ready wrapper in ``sglang_service_check_dir`` (hs_patch/host/readiness/gpu_ready.py with
    the server unit's user and environment: the same check the role and the unit's ExecStartPre run)."""
    if c.run(["systemctl", "is-active", "--quiet", f"{t.service}.service"]).ok:
        return Check("gpu ready", True, f"{t.service} is running (its own start checked the GPUs)")
    gpu_ready = f"{t.check_dir}/gpu-ready"
    r = c.run([gpu_ready, "caches", "jit", "nccl", "--json"], timeout=900)
    found = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if not found:
        return Check("gpu ready", False, (r.stderr or r.stdout).strip()[-300:] or f"{gpu_ready} gave nothing",
                     "run ansible-playbook site.yml (the services role installs the check)")
    bad = [x for x in found if not x["ok"] and not x.get("warn")]
    return Check("gpu ready", not bad, "; ".join(f"{x['name']}: {x['detail']}" for x in (bad or found))[-900:],
                 bad[0]["fix"] if bad else "")


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _server_flags(c: Shell, t: Target) -> Check:
    r = c.run(["systemctl", "cat", f"{t.service}.service"])
    if not r.ok:
        return Check("server unit", False, r.stderr.strip(), "run ansible-playbook site.yml (services role)")
    unit = r.stdout
    status = _last_json(c.run([t.bin("hs-patch"), "status", "--json"]).stdout)
    words = shlex.split(next((x for x in unit.splitlines() if x.startswith("ExecStart=")), "").partition("=")[2])
    problems = args_violations(words, status.get("release"))
    listen = words[words.index("--host") + 1] if "--host" in words[:-1] else "127.0.0.1"
    exposed = not _is_loopback(listen)
    env_ok = "HS_CAPTURE=1" in unit and f"HS_CAPTURE_DIR={t.dump_dir}" in unit
    ok = not problems and env_ok and not exposed
    detail = f"capture on, flags compatible, listening on {listen}" if ok else \
        (f"{'; '.join(problems) or 'flags ok'}; capture env {'ok' if env_ok else 'missing'}, "
         f"listening on {listen}{' (not loopback)' if exposed else ''}")
    return Check("server flags", ok, detail, f"set them in the services role (sglang_service_*) and re-run site.yml;"
                                             f" HS_CAPTURE_DIR must be {t.dump_dir}; the server listens on loopback "
                                             "only (sglang_service_host)")


def _api_key(c: Shell, t: Target) -> Check:
    """The server's API key file, readable by the service user (the driver sends the key)."""
    r = c.run(_as_service_user(t, "test", "-r", t.api_key_file))
    mode = c.run(["stat", "-c", "%a %U", t.api_key_file]).stdout.strip()
    ok = r.ok and mode.split()[:1] in (["600"], ["400"])
    return Check("api key", ok, f"{t.api_key_file} ({mode or 'missing'})",
                 f"run ansible-playbook site.yml (the services role writes the key, mode 0600, owner "
                 f"{t.service_user}; hs_server_api_key_file must name it)")


def _space(c: Shell, path: str) -> tuple[int, int] | None:
    """(size, available) bytes of the filesystem holding ``path`` (or its parent, before it exists)."""
    r = c.run(cmd("df", "-Pk", path) + " 2>/dev/null || " + cmd("df", "-Pk", str(Path(path).parent)))
    try:
        fields = r.stdout.splitlines()[-1].split()
        return int(fields[1]) * 1024, int(fields[3]) * 1024
    except (IndexError, ValueError):
        return None


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _last_json(text: str) -> dict[str, Any]:
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
    info = _last_json(r.stdout) if r.ok else {}
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
    # a tokenizer's own code (trust_remote_code) is cached in the run's state dir (the home is read-only)
    jobs = [] if ship_only else [(drive, ["--property=Restart=on-abnormal", "--property=SuccessExitStatus=130", f"--setenv=HF_MODULES_CACHE={t.state_dir(run)}/hf_modules",
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
    if not r.ok:
        raise RemoteError(f"cannot read the run's status on {t.host}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


def runs(c: Shell, t: Target) -> list[str]:
    """The runs on the host (their state dirs under ``state_root``), newest first."""
    return c.run(cmd("ls", "-t", "--", t.state_root) + " 2>/dev/null").stdout.split()


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
    r = c.run(_as_service_user(t, *argv), timeout=None)
    return r.exited, (r.stdout + r.stderr).strip()
