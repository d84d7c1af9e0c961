"""Run and watch hidden-state extractions on a GPU host provisioned by ``ansible-playbook site.yml``.

GPU_HOST: the host's name or address in the inventory (the shipped inventory's is the production host,
10.1.230.174: a command naming it acts on production).

    fab extract --host GPU_HOST --dataset data/chat.jsonl [--run NAME] [--limit N] [--max-tokens N] [--regenerate]
    fab extract --hosts [GROUP] --dataset data/chat.jsonl --run NAME      # a fleet: one shard a host
    fab extract --reassign DEAD_HOST --host OTHER --dataset data/chat.jsonl --run NAME
    fab status  --host GPU_HOST [--run NAME] [--once]
    fab status  --hosts [GROUP] --run NAME [--once]
    fab stop    --host GPU_HOST [--run NAME] [--server]
    fab stop    --hosts [GROUP] --run NAME [--server]
    fab ship    --host GPU_HOST [--run NAME]
    fab ship    --hosts [GROUP] --run NAME
    fab verify  --host GPU_HOST

The host and its settings come from the Ansible inventory, read by Ansible itself
(hs_patch/control/inventory.py): ``-i/--inventory FILE|DIR`` (default: $HS_INVENTORY,
ansible.cfg's, else inventory/), ``-e/--extra-vars`` as ansible-playbook takes them, vault
with ``--vault-password-file``/``--ask-vault-pass``. A non-root ``ansible_user`` becomes
root with sudo. SSH host keys are checked strictly against ``~/.ssh/known_hosts`` (or
``--known-hosts FILE``, or the inventory's UserKnownHostsFile). ``fab --help TASK`` (or
``fab TASK -h``) lists each task's options; an option has the same short flag in every task
(hs_patch/control/fab_options.py). Fleets (``--hosts``, ``--reassign``): docs/fleet.md.
"""

from __future__ import annotations

import functools
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable

from fabric import Connection, task

from hs_patch.control import dashboard, extraction, fleet, fleet_run, poll, remote
from hs_patch.control.fab_options import FabTask, suggest_nearest
from hs_patch.control.inventory import ConfigError, Inventory, Target, check_run_name, load
from hs_patch.control.shell import RemoteError, Shell

suggest_nearest()  # fab extrct: "No idea what 'extrct' is! Did you mean 'extract'?"

COMMON = {
    "host": "GPU host: its name or address in the inventory (required)",
    "inventory": "Ansible inventory: a hosts file or the directory holding it (default: $HS_INVENTORY, "
                 "ansible.cfg's inventory, else inventory/)",
    "extra-vars": "extra variables as ansible-playbook -e takes them (k=v, JSON, @file); repeatable",
    "vault-password-file": "vault password file for the inventory's encrypted values; repeatable",
    "ask-vault-pass": "ask for the vault password",
    "known-hosts": "known_hosts file for the host key check (default: the inventory's UserKnownHostsFile, "
                   "else ~/.ssh/known_hosts)",
    "run": "run name (default for status/stop/ship: the newest run on the host)",
}
ITERABLE = ["extra_vars", "vault_password_file"]
FLEET = {"hosts": f"an inventory group of GPU hosts sharing the run, one shard each (--hosts alone: "
                  f"{fleet.DEFAULT_GROUP}); docs/fleet.md"}
WATCH = {"interval": "dashboard refresh in seconds",
         "dead-after": f"end the dashboard when a host has not answered for this many seconds and nothing else is "
                       f"left to wait for (default {dashboard.DEAD_AFTER_S:.0f}; a host is shown unreachable after "
                       f"{poll.POLL_DEADLINE_S:.0f} s without an answer): exit 3 naming it (a fleet), 2 (one host)"}


def _errors(body: Callable[..., Any]) -> Callable[..., Any]:
    """Report a failed step or a missing option as one clear line instead of a traceback."""

    @functools.wraps(body)
    def wrapper(c: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("host") is True and "--host" in sys.argv[1:]:  # the option's value forgotten: not help
            sys.exit(f"fab {body.__name__}: --host needs a value: the GPU host's name or address in the inventory "
                     f"(--host NAME); fab --help {body.__name__} lists every option")
        if kwargs.get("host") is True:  # -h (--host) without a value: the task's help, as -h means elsewhere
            from fabric.main import program

            program.run(["fab", "--search-root", str(Path(__file__).resolve().parent), "--help", body.__name__],
                        exit=False)
            sys.exit(0)
        if not kwargs.get("host") and not kwargs.get("hosts"):
            group = " or --hosts GROUP" if "hosts" in kwargs else ""
            sys.exit(f"fab {body.__name__}: give --host NAME (the GPU host's name or address in the inventory)"
                     f"{group}; fab --help {body.__name__} lists every option")
        if kwargs.get("host") and kwargs.get("hosts"):  # one of them was silently not used
            sys.exit(f"fab {body.__name__}: give --host NAME (one host) or --hosts GROUP (a fleet), not both; "
                     f"fab --help {body.__name__} lists every option")
        try:
            return body(c, *args, **kwargs)
        except (RemoteError, ConfigError) as e:
            sys.exit(f"fab: {e}")
        except KeyboardInterrupt:  # a dashboard detaches on Ctrl-C itself; this is any other step (invoke said nothing)
            print(f"fab {body.__name__}: interrupted; what was already started on the host goes on (fab status "
                  "shows it); a driver not yet started was not: the same command again goes on from where it is",
                  file=sys.stderr)
            sys.exit(130)

    return wrapper


def _target(host: str, inventory: str | None, extra_vars: list[str] | None, vault_password_file: list[str] | None,
            ask_vault_pass: bool, known_hosts: str | None) -> Target:
    return load(host, inventory, extra_vars=extra_vars or (), vault_password_files=vault_password_file or (),
                ask_vault_pass=bool(ask_vault_pass), known_hosts=known_hosts)


def _inventory(inventory: str | None, extra_vars: list[str] | None, vault_password_file: list[str] | None,
               ask_vault_pass: bool, known_hosts: str | None) -> Inventory:
    inv = Inventory(inventory, extra_vars=extra_vars or (), vault_password_files=vault_password_file or (),
                    ask_vault_pass=bool(ask_vault_pass))
    inv.overrides["known_hosts"] = known_hosts
    return inv


def _group(hosts: Any) -> str:
    """--hosts GROUP, or --hosts alone: the GPU hosts group."""
    return fleet.DEFAULT_GROUP if hosts is True else str(hosts)


MIN_INTERVAL_S = 0.2  # --interval: each host is read this often at most


def _check_numbers(task_name: str, **values: Any) -> None:
    """Refuse a dashboard period under 0.2 s (it reads every host that often) or a dead-after that is not a
    positive finite number of seconds, a negative --limit and a --max-tokens below 1, before anything connects or
    starts (time.sleep(-1) failed after the units started)."""
    wholes = {"limit": (0, "a whole number >= 0 (0: all lines)"), "max_tokens": (1, "a whole number >= 1")}
    for name, value in values.items():
        v = float(value)
        if name in wholes:
            ok, what = v >= wholes[name][0], wholes[name][1]
        elif name == "interval":
            ok, what = MIN_INTERVAL_S <= v < math.inf, f"a number of seconds >= {MIN_INTERVAL_S}"
        else:
            ok, what = 0 < v < math.inf, "a number of seconds > 0"
        if not ok:
            sys.exit(f"fab {task_name}: --{name.replace('_', '-')} {value!r} must be {what}")


def default_run_name(stem: str) -> str:
    """A run name from the dataset's file name and the time (no --run): what a run name cannot hold made '-', cut
    to fit the name's 64 characters."""
    when = time.strftime("%Y%m%d-%H%M%S")
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).replace("..", "-").strip(".-_")[:64 - len(when) - 1]
    return f"{base or 'run'}-{when}"


def _connect(t: Target) -> Shell:
    c = fleet.connection(t, Connection)
    fleet.open_connection(c, t)  # a failure is a RemoteError saying what to check
    return Shell(c, t)


def _pick_run(c: Shell, t: Target, run: str | None) -> str:
    """--run NAME if the host has that run, else the newest run there; refused saying which runs there are."""
    found = remote.runs(c, t)
    if run and check_run_name(run) not in found:
        there = f"its runs, newest first: {', '.join(found[:10])}" if found else "none yet; start one with fab extract"
        sys.exit(f"fab: no run {run!r} on {t.host} (under {t.state_root}); {there}")
    if not (run or found):
        sys.exit(f"fab: no run on {t.host} under {t.state_root}; start one with fab extract")
    return run or found[0]


def _say(msg: str) -> None:
    print(f"[fab] {msg}", flush=True)


@task(klass=FabTask, iterable=ITERABLE, optional=["host", "hosts"], help={
    **COMMON, **FLEET, "dataset": "JSONL dataset on this machine (copied to the host), or an absolute path on the host "
                                  "with --remote-dataset (required)",
    "reassign": "with --host OTHER: OTHER finishes the shard of this (dead or removed) host of a fleet run, shipping "
                "into its directory at the destination; nothing there is redone (moved on again once the host that "
                "took it is dead or its job there stopped; --reassign HOST --host HOST: HOST, back, takes its own "
                "shard back)",
    "remote-dataset": "--dataset is a path on the GPU host", "limit": "only the first N lines (0: all)",
    "max-tokens": f"longest sample in tokens (default {remote.MAX_SAMPLE_TOKENS}); the server's KV cache must hold "
                  "it (checked once the server runs); a run resumes only with the same value (the driver's "
                  "--max-tokens)",
    "regenerate": "let the served model write the assistant turns first (not captured), then capture the whole "
                  "conversation",
    "accept-changed-data": "resume over a changed dataset the driver refuses without it: lines whose samples a "
                           "shard holds now in other shards (lines inserted or removed before them), or none of the "
                           "run's lines left (another file?); appended, removed and changed lines need nothing "
                           "(docs/driver.md)",
    "server-timeout": "seconds to wait for the server to become healthy (default 3600, the services role's health wait: "
                      "a ~600 GB load and a first start's JIT compiles)", **WATCH,
    "detach": "start and return without the dashboard"})
@_errors
def extract(c, host=None, inventory=None, extra_vars=None, known_hosts=None, vault_password_file=None,
            ask_vault_pass=False, dataset=None, run=None, limit=0, regenerate=False, remote_dataset=False,
            server_timeout=3600, interval=2.0, detach=False, hosts=None, reassign=None,
            dead_after=dashboard.DEAD_AFTER_S, max_tokens=remote.MAX_SAMPLE_TOKENS, accept_changed_data=False):
    """Preflight, start the server, run the driver and the shipper as systemd units, watch them live."""
    _check_numbers("extract", interval=interval, dead_after=dead_after, limit=limit, max_tokens=max_tokens,
                   server_timeout=server_timeout)
    if not dataset:
        sys.exit("fab extract: give --dataset FILE (a JSONL file here, or on the host with --remote-dataset)")
    local = Path(dataset)
    # the driver's unit gets the path on its command line, where systemd expands $NAME: refused there, after the
    # upload and the server's start; here, before anything
    if "$" in (dataset if remote_dataset else local.name):
        sys.exit(f"fab extract: dataset {dataset!r}: a '$' in its {'path' if remote_dataset else 'name'} would be "
                 "expanded by systemd in the driver's command line: rename it")
    if remote_dataset:
        if not dataset.startswith("/"):
            sys.exit(f"fab extract: --remote-dataset {dataset!r} must be an absolute path on the host")
    elif not local.is_file():
        why = "is a directory" if local.is_dir() else "not found here"
        sys.exit(f"fab extract: dataset {dataset} {why} (give a JSONL file; --remote-dataset for a path on the host)")
    elif not os.access(local, os.R_OK):
        sys.exit(f"fab extract: dataset {dataset} is not readable by this user (its mode, or a parent directory's)")
    if (hosts or reassign) and not run:
        sys.exit("fab extract: a fleet run needs --run NAME (every host, a later resume and --reassign use it)")
    run = check_run_name(run or default_run_name(local.stem))
    opts = dict(run=run, dataset=dataset, remote_dataset=bool(remote_dataset), limit=int(limit),
                regenerate=bool(regenerate), server_timeout=int(server_timeout), interval=float(interval),
                detach=bool(detach), say=_say, dead_after=float(dead_after), max_tokens=int(max_tokens),
                accept_changed_data=bool(accept_changed_data))
    if reassign:
        if not host or hosts:
            sys.exit("fab extract: --reassign DEAD_HOST takes --host OTHER (the host that finishes its shard)")
        inv = _inventory(inventory, extra_vars, vault_password_file, ask_vault_pass, known_hosts)
        sys.exit(fleet_run.reassign(inv, reassign, host, **opts))
    if hosts or fleet.load_plan(run):  # --host H of a fleet run runs H's shard
        inv = _inventory(inventory, extra_vars, vault_password_file, ask_vault_pass, known_hosts)
        sys.exit(fleet_run.extract(inv, _group(hosts) if hosts else None, host,
                                   **opts))
    t = _target(host, inventory, extra_vars, vault_password_file, ask_vault_pass, known_hosts)
    conn = _connect(t)
    job = extraction.Job(run, dataset, bool(remote_dataset),
                         extraction.driver_args(limit, regenerate, accept_changed_data=bool(accept_changed_data)),
                         max_tokens=int(max_tokens))
    _say(f"preflight on {t.host} (run {run})")
    checks = extraction.preflight(conn, t, job)
    print(extraction.report(t.name or t.host, checks))
    if not all(ch.ok for ch in checks):
        sys.exit("fab: preflight failed; nothing was started")
    _say(f"starting the server unit {t.service} (waits for /health_generate)")
    started = extraction.start(conn, t, job, int(server_timeout), _say)
    _say(f"started {', '.join(started) or 'nothing new (already running)'}; the job survives this session")
    if detach:
        _say(f"watch with: fab status --host {host} --run {run}")
        return
    sys.exit(_watch(t, run, float(interval), float(dead_after)))


def _watch(t: Target, run: str, interval: float, dead_after: float, once: bool = False) -> int:
    """One host's dashboard, its reads bounded in time (hs_patch.control.poll)."""
    poller = poll.Poller.of([t], lambda c, tt: remote.snapshot(c, tt, run), interval=interval)
    return dashboard.watch(poller, t.name or t.host, run, interval=interval, once=once, dead_after=dead_after)


@task(klass=FabTask, iterable=ITERABLE, optional=["host", "hosts"], help={
    **COMMON, **FLEET, **WATCH, "once": "print one snapshot and exit"})
@_errors
def status(c, host=None, inventory=None, extra_vars=None, known_hosts=None, vault_password_file=None,
           ask_vault_pass=False, run=None, once=False, interval=2.0, hosts=None, dead_after=dashboard.DEAD_AFTER_S):
    """Reattach to a run's live dashboard, or print it once (--hosts GROUP: the fleet's)."""
    _check_numbers("status", interval=interval, dead_after=dead_after)
    if run:
        check_run_name(run)  # before connecting: a name no host can have is refused here
    if hosts:
        inv, plan = _fleet(hosts, run, "status", inventory, extra_vars, vault_password_file, ask_vault_pass,
                           known_hosts)
        rows = fleet_run.group_rows(inv, plan, _group(hosts))
        sys.exit(fleet_run.watch(inv, plan, rows, f"fab status --hosts {_group(hosts)} --run {run}",
                                 interval=float(interval), once=bool(once), dead_after=float(dead_after)))
    t = _target(host, inventory, extra_vars, vault_password_file, ask_vault_pass, known_hosts)
    conn = _connect(t)
    run = _pick_run(conn, t, run)
    conn.conn.close()
    sys.exit(_watch(t, run, float(interval), float(dead_after), once=bool(once)))


@task(klass=FabTask, iterable=ITERABLE, optional=["host", "hosts"],
      help={**COMMON, **FLEET, "server": "stop the SGLang server unit too"})
@_errors
def stop(c, host=None, inventory=None, extra_vars=None, known_hosts=None, vault_password_file=None,
         ask_vault_pass=False, run=None, server=False, hosts=None):
    """Stop a run cleanly; the same fab extract resumes it.

    The driver, then the shipper, finish what is in flight; --hosts GROUP: every job of the fleet run on the
    group's hosts."""
    if hosts:
        inv, plan = _fleet(hosts, run, "stop", inventory, extra_vars, vault_password_file, ask_vault_pass, known_hosts)
        sys.exit(fleet_run.stop_all(inv, plan, _group(hosts), bool(server), _say))
    if run:
        check_run_name(run)  # before connecting: a name no host can have is refused here
    t = _target(host, inventory, extra_vars, vault_password_file, ask_vault_pass, known_hosts)
    conn = _connect(t)
    run = _pick_run(conn, t, run)
    states = remote.stop(conn, t, run, server=bool(server))
    _say(f"{remote.in_words(states)}; resume with the same fab extract --run {run}, drain with fab ship --host "
         f"{host} --run {run}")
    if not remote.all_stopped(states):
        sys.exit(1)


@task(klass=FabTask, iterable=ITERABLE, optional=["host", "hosts"], help={**COMMON, **FLEET})
@_errors
def ship(c, host=None, inventory=None, extra_vars=None, known_hosts=None, vault_password_file=None,
         ask_vault_pass=False, run=None, hosts=None):
    """Ship every finished sample of a run now and wait until the destination has verified it.

    The follow shipper is stopped meanwhile, and started again if the run's driver is still running.

    --hosts GROUP: every job of the fleet run on the group's hosts, each into its part of the run at the
    destination."""
    if hosts:
        inv, plan = _fleet(hosts, run, "ship", inventory, extra_vars, vault_password_file, ask_vault_pass, known_hosts)
        sys.exit(fleet_run.ship_all(inv, plan, _group(hosts), _say))
    if run:
        check_run_name(run)  # before connecting: a name no host can have is refused here
    t = _target(host, inventory, extra_vars, vault_password_file, ask_vault_pass, known_hosts)
    conn = _connect(t)
    run = _pick_run(conn, t, run)
    code, out = extraction.drain(conn, t, run, dest=fleet_run.destination_of(t, run))  # a fleet's: RUN/HOST
    print(out)
    sys.exit(code)


def _fleet(hosts: Any, run: str | None, task_name: str, inventory: str | None, extra_vars: list[str] | None,
           vault_password_file: list[str] | None, ask_vault_pass: bool,
           known_hosts: str | None) -> tuple[Inventory, fleet.Plan]:
    """The inventory and the plan of a fleet run named by --run (refused saying what to give)."""
    if not run:
        sys.exit(f"fab {task_name} --hosts: give --run NAME (the fleet run)")
    plan = fleet.load_plan(check_run_name(run))
    if plan is None:
        sys.exit(f"fab {task_name}: run {run} has no fleet plan ({fleet.plan_path(run)}); for one host: "
                 f"fab {task_name} --host H --run NAME")
    return _inventory(inventory, extra_vars, vault_password_file, ask_vault_pass, known_hosts), plan


@task(klass=FabTask, iterable=ITERABLE, optional=["host"], help={k: v for k, v in COMMON.items() if k != "run"})
@_errors
def verify(c, host=None, inventory=None, extra_vars=None, known_hosts=None, vault_password_file=None,
           ask_vault_pass=False):
    """Run hs-patch verify on the host: exit 0 only if the patch is present and intact."""
    t = _target(host, inventory, extra_vars, vault_password_file, ask_vault_pass, known_hosts)
    conn = _connect(t)
    r = conn.run([t.bin("hs-patch"), "verify"])
    print((r.stdout + r.stderr).strip())
    sys.exit(r.exited)
