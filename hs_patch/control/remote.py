"""What ``fab`` does on the GPU host over SSH: preflight, start, watch, stop.

Every function takes a fabric ``Connection`` (as root, like Ansible) and the host's
:class:`~hs_patch.control.inventory.Target`. The driver and the shipper run as transient systemd
units (``hs-drive-<run>``, ``hs-ship-<run>``) under the service user, so the job goes on
when the SSH session drops; a killed one is restarted (the driver ``Restart=on-abnormal``;
the shipper ``Restart=on-failure`` except after exit 2, bad configuration: it waits out
storage outages itself and exits 1 only on what waiting cannot cure), and both resume
where they stopped.
"""

from __future__ import annotations

import hashlib
import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hs_patch.control.inventory import Target
from hs_patch.flags import args_violations

# Installed by the services role (sglang_service_check_dir): hs_patch/host/gpu_ready.py with the
# server unit's user and environment, the same check the role and the unit's ExecStartPre run.
GPU_READY = "/usr/local/lib/hs-patch/gpu-ready"



class RemoteError(RuntimeError):
    """A remote step failed; the message says what to do."""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def sh(c: Any, cmd: str, *, check: bool = False, timeout: int | None = 120) -> Any:
    """Run ``cmd`` on the host (hidden output); ``check`` raises RemoteError on failure."""
    r = c.run(cmd, hide=True, warn=True, in_stream=False, timeout=timeout)
    if check and r.failed:
        raise RemoteError(f"on {c.host}: `{cmd}` failed ({r.exited}): {(r.stderr or r.stdout).strip()[-800:]}")
    return r


def units(run: str) -> tuple[str, str]:
    return f"hs-drive-{run}", f"hs-ship-{run}"


# --------------------------------------------------------------------------- preflight


MAX_SAMPLE_TOKENS = 32768  # hs-extract drive --max-tokens default


def preflight(c: Any, t: Target, *, estimated_bytes: int | None, bytes_per_token: int,
              need_gpus: bool = True) -> list[Check]:
    """Check the host can run an extraction; each failed check says what to do."""
    checks: list[Check] = []
    r = sh(c, "true")
    checks.append(Check("ssh", r.ok, f"{t.user}@{t.host}:{t.port}", "check the inventory's ansible_user/port/key"))
    if not r.ok:
        return checks
    r = sh(c, f"{t.bin('hs-patch')} verify --json")
    res = _last_json(r.stdout)
    checks.append(Check("patch", r.ok, res.get("message") or res.get("error") or r.stderr.strip(),
                        "run ansible-playbook site.yml (it installs SGLang and applies the patch)"))
    if need_gpus:
        r = sh(c, "nvidia-smi --query-gpu=name --format=csv,noheader")
        names = [x.strip() for x in r.stdout.splitlines() if x.strip()] if r.ok else []
        good = [n for n in names if t.gpu_model in n]  # hs_gpu_model: a part of the name nvidia-smi prints
        checks.append(Check("gpus", r.ok and len(good) == t.gpu_count == len(names),
                            f"{len(names)} GPU(s): {', '.join(sorted(set(names))) or r.stderr.strip() or 'none'}",
                            f"expected {t.gpu_count} x {t.gpu_model}: check the driver (nvidia-smi) or hs_gpu_count/"
                            "hs_gpu_model in the inventory"))
        checks.append(_gpu_ready(c, t))
    checks.append(_server_flags(c, t))
    r = sh(c, f"cd / && sudo -u {t.service_user} find {shlex.quote(t.model_path)} -maxdepth 1 ! -readable")
    unreadable = r.stdout.split()
    checks.append(Check("model", r.ok and not unreadable and sh(c, f"test -f {shlex.quote(t.model_path)}/config.json").ok,
                        f"{t.model_path} readable by {t.service_user}" if r.ok and not unreadable else
                        f"{t.model_path}: not readable by {t.service_user}: {' '.join(unreadable)[:200] or r.stderr.strip()}",
                        f"put the model there and let {t.service_user} read it (chmod -R a+rX {t.model_path})"))
    # room for the run, or at least for its largest possible sample (the driver pauses
    # sending at 80% use and the shipper frees space as it goes)
    need = max(64 << 20, min(estimated_bytes or 0, bytes_per_token * MAX_SAMPLE_TOKENS))
    for label, path in (("dump space", t.dump_dir), ("samples space", t.samples_root)):
        free = _free_bytes(c, path)
        checks.append(Check(label, free is not None and free >= need, f"{_gb(free)} free for {path}",
                            f"free at least {_gb(need)} there (one sample of {MAX_SAMPLE_TOKENS} tokens)"))
    if t.ship_enabled:
        cmd = f"sudo -u {t.service_user} -H ssh -o BatchMode=yes {t.storage_alias} df -Pk {shlex.quote(t.storage_dir)}"
        r = sh(c, cmd, timeout=60)
        free = int(r.stdout.splitlines()[-1].split()[3]) * 1024 if r.ok and r.stdout.strip() else None
        ok = free is not None and (estimated_bytes is None or free >= estimated_bytes)
        checks.append(Check("storage", ok, f"{t.storage_alias}:{t.storage_dir}: {_gb(free)} free, "
                            f"{_gb(estimated_bytes)} estimated for this run" if r.ok else (r.stderr.strip() or r.stdout.strip())[-300:],
                            "fix the storage target (ansible-playbook site.yml configures it) or free space there"))
    return checks


def _gpu_ready(c: Any, t: Target) -> Check:
    """The JIT toolchain and the all-GPU NCCL all-reduce (skipped while the server holds the GPUs)."""
    if sh(c, f"systemctl is-active --quiet {t.service}.service").ok:
        return Check("gpu ready", True, f"{t.service} is running (its own start checked the GPUs)")
    r = sh(c, f"{GPU_READY} jit nccl --json", timeout=900)
    found = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if not found:
        return Check("gpu ready", False, (r.stderr or r.stdout).strip()[-300:] or f"{GPU_READY} gave nothing",
                     "run ansible-playbook site.yml (the services role installs the check)")
    bad = [x for x in found if not x["ok"] and not x.get("warn")]
    return Check("gpu ready", not bad, "; ".join(f"{x['name']}: {x['detail']}" for x in (bad or found))[-900:],
                 bad[0]["fix"] if bad else "")


def _server_flags(c: Any, t: Target) -> Check:
    r = sh(c, f"systemctl cat {t.service}.service")
    if not r.ok:
        return Check("server unit", False, r.stderr.strip(), "run ansible-playbook site.yml (services role)")
    unit = r.stdout
    status = _last_json(sh(c, f"{t.bin('hs-patch')} status --json").stdout)
    exec_line = next((x for x in unit.splitlines() if x.startswith("ExecStart=")), "")
    problems = args_violations(shlex.split(exec_line.partition("=")[2]), status.get("release"))
    env_ok = "HS_CAPTURE=1" in unit and f"HS_CAPTURE_DIR={t.dump_dir}" in unit
    ok = not problems and env_ok
    detail = "capture on, flags compatible" if ok else \
        f"{'; '.join(problems) or 'flags ok'}; capture env {'ok' if env_ok else 'missing'}"
    return Check("server flags", ok, detail, f"set them in the services role (sglang_service_*) and re-run site.yml;"
                                             f" HS_CAPTURE_DIR must be {t.dump_dir}")


def _free_bytes(c: Any, path: str) -> int | None:
    r = sh(c, f"df -Pk {shlex.quote(path)} 2>/dev/null || df -Pk {shlex.quote(str(Path(path).parent))}")
    try:
        return int(r.stdout.splitlines()[-1].split()[3]) * 1024
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


def estimate_bytes(c: Any, t: Target, dataset_bytes: int) -> tuple[int, int]:
    """(stored bytes for a dataset, bytes per token): ~4 bytes of JSON per token, planes x
    hidden x 2 (+ 9 for the id and the loss mask) per token."""
    r = sh(c, f"cat {shlex.quote(t.model_path)}/config.json")
    cfg = json.loads(r.stdout) if r.ok else {}
    hidden = int((cfg.get("text_config") or cfg).get("hidden_size", 7168))
    planes = len(t.capture_layers) + {"pre": 1, "post": 1, "both": 2}.get(t.capture_final, 0)
    per_token = planes * hidden * 2 + 9
    return dataset_bytes // 4 * per_token, per_token


# --------------------------------------------------------------------------- starting


def prepare(c: Any, t: Target, run: str) -> None:
    for d in (t.state_dir(run), t.samples_dir(run), f"{t.state_dir(run)}/data"):
        sh(c, f"install -d -o {t.service_user} -g {t.service_user} -m 0750 {shlex.quote(d)}", check=True)
    sh(c, f"install -d -o {t.service_user} -g {t.service_user} -m 0750 {shlex.quote(t.dump_dir)}", check=True)


def upload(c: Any, t: Target, run: str, local: Path) -> str:
    """Copy a dataset to the run's state dir (skipped when the same bytes are there)."""
    remote = f"{t.state_dir(run)}/data/{local.name}"
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    r = sh(c, f"sha256sum {shlex.quote(remote)}")
    if not (r.ok and r.stdout.split()[0] == digest):
        c.put(str(local), remote)
        sh(c, f"chown {t.service_user}: {shlex.quote(remote)}", check=True)
    return remote


def start_server(c: Any, t: Target, timeout: int, progress: Callable[[str], None]) -> None:
    """Start the server unit (no-op when running) and wait for /health_generate."""
    sh(c, f"systemctl reset-failed {t.service}.service 2>/dev/null; systemctl start {t.service}.service", check=True)
    url = f"http://127.0.0.1:{t.server_port}/health_generate"
    probe = (f"{t.bin('python')} -c \"import sys,urllib.request;"
             f"sys.exit(urllib.request.urlopen('{url}', timeout=30).status != 200)\"")
    t0 = time.time()
    while True:
        if sh(c, probe, timeout=60).ok:
            return
        state = sh(c, f"systemctl is-active {t.service}.service").stdout.strip()
        if state in ("failed", "inactive"):
            log = sh(c, f"journalctl -u {t.service}.service -n 30 --no-pager").stdout
            raise RemoteError(f"the server unit {t.service} is {state}:\n{log}\nfix it, then run fab extract again")
        waited = time.time() - t0
        if waited > timeout:
            raise RemoteError(f"the server was not healthy after {timeout}s (journalctl -u {t.service}); "
                              "raise --server-timeout if the model takes longer to load")
        progress(f"waiting for {url} ({waited:.0f}s, unit {state})")
        time.sleep(5)


def unit_state(c: Any, unit: str) -> str:
    return sh(c, f"systemctl show -p ActiveState --value {unit}.service").stdout.strip() or "unknown"


def start_jobs(c: Any, t: Target, run: str, driver_args: list[str]) -> list[str]:
    """Start the driver and (if shipping) the shipper units; leave running ones alone."""
    drive, ship = units(run)
    started = []
    common = (f"--uid={t.service_user} --gid={t.service_user} "
              f"--property=RestartSec=5 --property=TimeoutStopSec=180 --property=KillMode=mixed "
              f"--setenv=PYTHONUNBUFFERED=1 --working-directory={shlex.quote(t.state_dir(run))}")
    # the driver exits 130 when it stops on SIGTERM (fab stop): a clean stop, not a failure
    jobs = [(drive, ["--property=Restart=on-abnormal", "--property=SuccessExitStatus=130", "--",
                     t.bin("hs-extract"), "drive", "--run", run, "--server", f"http://127.0.0.1:{t.server_port}",
                     "--capture-dir", t.dump_dir, "--state-dir", t.state_dir(run),
                     "--samples-dir", t.samples_dir(run), *driver_args])]
    if t.ship_enabled:
        jobs.append((ship, ["--property=Restart=on-failure", "--property=RestartPreventExitStatus=2", "--",
                            t.bin("hs-extract"), "ship", "--samples-dir", t.samples_dir(run),
                            "--state-dir", t.state_dir(run), "--dest", f"{t.storage_alias}:{t.storage_dir}/{run}",
                            "--follow"]))
    for unit, argv in jobs:
        if unit_state(c, unit) in ("active", "activating", "reloading"):
            continue
        sh(c, f"systemctl reset-failed {unit}.service 2>/dev/null; systemctl stop {unit}.service 2>/dev/null")
        cmd = f"systemd-run --unit={unit} --description='hs-patch {unit}' {common} " + shlex.join(argv)
        sh(c, cmd, check=True)
        started.append(unit)
    return started


# --------------------------------------------------------------------------- watching and stopping


def snapshot(c: Any, t: Target, run: str) -> dict[str, Any]:
    cmd = (f"{t.bin('hs-extract')} snapshot --run {run} --state-dir {shlex.quote(t.state_dir(run))} "
           f"--samples-dir {shlex.quote(t.samples_dir(run))} --capture-dir {shlex.quote(t.dump_dir)} "
           f"--service {t.service}")
    r = sh(c, cmd, timeout=60)
    if not r.ok:
        raise RemoteError(f"cannot read the run's status on {t.host}: {r.stderr.strip()[-300:]}")
    return json.loads(r.stdout)


def latest_run(c: Any, t: Target) -> str | None:
    r = sh(c, f"ls -t {shlex.quote(t.state_root)} 2>/dev/null | head -1")
    return r.stdout.strip() or None


def stop(c: Any, t: Target, run: str, *, server: bool = False) -> dict[str, str]:
    """Stop the driver, then the shipper (each finishes what is in flight), optionally the server."""
    drive, ship = units(run)
    for unit in (drive, ship) + ((t.service,) if server else ()):
        sh(c, f"systemctl stop {unit}.service", timeout=300)
    return {u: unit_state(c, u) for u in (drive, ship)}


def ship_now(c: Any, t: Target, run: str) -> tuple[int, str]:
    """Drain shipping in the foreground (the follow unit is stopped first)."""
    _, ship = units(run)
    sh(c, f"systemctl stop {ship}.service")
    cmd = (f"sudo -u {t.service_user} -H {t.bin('hs-extract')} ship --samples-dir "
           f"{shlex.quote(t.samples_dir(run))} --state-dir {shlex.quote(t.state_dir(run))} "
           f"--dest {t.storage_alias}:{t.storage_dir}/{run}")
    r = sh(c, cmd, timeout=None)
    return r.exited, (r.stdout + r.stderr).strip()
