"""Run and watch hidden-state extractions on a GPU host provisioned by ``ansible-playbook site.yml``.

    fab extract --host 10.1.230.174 --dataset data/chat.jsonl [--run NAME] [--limit N] [--regenerate]
    fab status  --host 10.1.230.174 [--run NAME] [--once]
    fab stop    --host 10.1.230.174 [--run NAME] [--server]
    fab ship    --host 10.1.230.174 [--run NAME]
    fab verify  --host 10.1.230.174

The host and its settings come from the Ansible inventory (``inventory/``, or
``--inventory DIR`` / ``HS_INVENTORY``). SSH host keys are checked strictly against
``~/.ssh/known_hosts`` (or ``--known-hosts FILE``). ``fab --help TASK`` lists each
task's options.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import paramiko
from fabric import Connection, task

from hs_patch.control import dashboard, remote
from hs_patch.control.inventory import ConfigError, Target, check_run_name, load


def _errors(body):
    """Report a failed remote step as one clear line instead of a traceback."""
    import functools

    @functools.wraps(body)
    def wrapper(*args, **kwargs):
        try:
            return body(*args, **kwargs)
        except (remote.RemoteError, ConfigError) as e:
            sys.exit(f"fab: {e}")

    return wrapper

COMMON = {
    "host": "GPU host: its name or address in the inventory",
    "inventory": "Ansible inventory directory (default: inventory/ or $HS_INVENTORY)",
    "known-hosts": "known_hosts file for the host key check (default: ~/.ssh/known_hosts)",
    "run": "run name (default for status/stop/ship: the newest run on the host)",
}


def _connect(host: str, inventory: str | None, known_hosts: str | None) -> tuple[Connection, Target]:
    try:
        t = load(host, inventory, known_hosts=known_hosts)
    except ConfigError as e:
        sys.exit(f"fab: {e}")
    kwargs = {"key_filename": t.key_file} if t.key_file else {}
    c = Connection(t.host, user=t.user, port=t.port, connect_kwargs=kwargs)
    c.client.set_missing_host_key_policy(paramiko.RejectPolicy())  # never trust an unknown host key
    known = Path(t.known_hosts or Path.home() / ".ssh" / "known_hosts").expanduser()
    if known.exists():
        c.client.load_host_keys(str(known))
    try:
        c.open()
    except paramiko.SSHException as e:
        sys.exit(f"fab: cannot connect to {t.user}@{t.host}:{t.port}: {e}. Is the host key in {known}? "
                 f"(ssh-keyscan -p {t.port} {t.host} >> {known} after checking it)")
    except OSError as e:
        sys.exit(f"fab: cannot reach {t.host}:{t.port}: {e}")
    return c, t


def _pick_run(c: Connection, t: Target, run: str | None) -> str:
    run = run or remote.latest_run(c, t)
    if not run:
        sys.exit(f"fab: no run on {t.host} under {t.state_root}; start one with fab extract")
    return check_run_name(run)


def _say(msg: str) -> None:
    print(f"[fab] {msg}", flush=True)


@task(help={**COMMON, "dataset": "JSONL dataset on this machine (copied to the host), or on the host with "
                                  "--remote-dataset", "remote-dataset": "--dataset is a path on the GPU host",
            "limit": "only the first N lines (0: all)", "regenerate": "let the served model write the assistant "
            "turns first (not captured), then capture the whole conversation",
            "server-timeout": "seconds to wait for the server to become healthy (default 1800)",
            "interval": "dashboard refresh in seconds", "detach": "start and return without the dashboard"})
@_errors
def extract(c, host, dataset, run=None, limit=0, regenerate=False, remote_dataset=False, inventory=None,
            known_hosts=None, server_timeout=1800, interval=2, detach=False):
    """Preflight, start the server, run the driver and the shipper as systemd units, watch them live."""
    conn, t = _connect(host, inventory, known_hosts)
    local = Path(dataset)
    if not remote_dataset and not local.is_file():
        sys.exit(f"fab: dataset {dataset} not found here (use --remote-dataset for a path on the host)")
    run = check_run_name(run or f"{local.stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    data_bytes = local.stat().st_size if not remote_dataset else \
        int(remote.sh(conn, f"stat -c %s {dataset}", check=True).stdout)
    _say(f"preflight on {t.host} (run {run})")
    estimated, per_token = remote.estimate_bytes(conn, t, data_bytes)
    checks = remote.preflight(conn, t, estimated_bytes=estimated, bytes_per_token=per_token)
    for ch in checks:
        print(f"  {'ok  ' if ch.ok else 'FAIL'} {ch.name:14} {ch.detail}" + ("" if ch.ok else f"\n       -> {ch.fix}"))
    if not all(ch.ok for ch in checks):
        sys.exit("fab: preflight failed; nothing was started")
    remote.prepare(conn, t, run)
    data = dataset if remote_dataset else remote.upload(conn, t, run, local)
    _say(f"starting the server unit {t.service} (waits for /health_generate)")
    remote.start_server(conn, t, int(server_timeout), _say)
    args = ["--data", data, "--model", t.model_path]
    if int(limit):
        args += ["--limit", str(int(limit))]
    if regenerate:
        args.append("--regenerate")
    if t.trust_remote_code:
        args.append("--trust-remote-code")
    started = remote.start_jobs(conn, t, run, args)
    _say(f"started {', '.join(started) or 'nothing new (already running)'}; the job survives this session")
    if detach:
        _say(f"watch with: fab status --host {host} --run {run}")
        return
    sys.exit(dashboard.watch(lambda: remote.snapshot(conn, t, run), host, run, interval=float(interval)))


@task(help={**COMMON, "once": "print one snapshot and exit", "interval": "refresh in seconds"})
@_errors
def status(c, host, run=None, once=False, inventory=None, known_hosts=None, interval=2):
    """Reattach to a run's live dashboard (or print it once)."""
    conn, t = _connect(host, inventory, known_hosts)
    run = _pick_run(conn, t, run)
    sys.exit(dashboard.watch(lambda: remote.snapshot(conn, t, run), host, run, interval=float(interval),
                             once=bool(once)))


@task(help={**COMMON, "server": "stop the SGLang server unit too"})
@_errors
def stop(c, host, run=None, server=False, inventory=None, known_hosts=None):
    """Stop a run cleanly: the driver, then the shipper finish what is in flight (resume with fab extract)."""
    conn, t = _connect(host, inventory, known_hosts)
    run = _pick_run(conn, t, run)
    states = remote.stop(conn, t, run, server=bool(server))
    _say(f"stopped: {states}; resume with the same fab extract --run {run}, drain with fab ship")


@task(help=COMMON)
@_errors
def ship(c, host, run=None, inventory=None, known_hosts=None):
    """Ship every finished sample of a run now, verified at the destination, and wait for it."""
    conn, t = _connect(host, inventory, known_hosts)
    run = _pick_run(conn, t, run)
    code, out = remote.ship_now(conn, t, run)
    print(out)
    sys.exit(code)


@task(help={k: v for k, v in COMMON.items() if k != "run"})
@_errors
def verify(c, host, inventory=None, known_hosts=None):
    """Run hs-patch verify on the host: exit 0 only if the patch is present and intact."""
    conn, t = _connect(host, inventory, known_hosts)
    r = remote.sh(conn, f"{t.bin('hs-patch')} verify")
    print((r.stdout + r.stderr).strip())
    sys.exit(r.exited)
