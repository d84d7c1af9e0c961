"""Many GPU hosts, one dataset: the fleet plan and Fabric's group execution (``fab extract --hosts``).

**The plan** (one JSON file a run on the control node: ``$HS_FLEET_DIR/RUN.json``, default
``~/.local/state/hs-patch/fleet/``) is made at a run's first start (saved once every host's
preflight passed: a refused start leaves the name free, the group may change before the next
try): the group's hosts,
sorted by inventory name, get shards ``0/N`` .. ``N-1/N`` (``hs_patch.shard``). Every later
``fab extract``/``fab status`` of the run reads it, so shards never move: a host added to
the group later gets none (fab says so), a host removed or dead keeps its shard until
``--reassign HOST --host TARGET`` gives it to another host, recorded in the plan (and
``--reassign HOST --host HOST``, the host back, takes it back).

**Storage**: each host ships into its own directory of the run at the destination,
``STORAGE_DIR/RUN/HOST/`` (its own ``samples/`` and ``manifest.jsonl``); a reassigned shard
goes on shipping into the dead host's directory, so what is already there counts as done
(the shipper's start-up listing) and is never sent twice. ``hs-patch inspect STORAGE_DIR/RUN``
checks the merged view (each sample id in one place only).

**Parallelism** is Fabric's own: :class:`FleetGroup` is a ``fabric.ThreadingGroup`` of
:class:`FleetConnection`, whose :meth:`FleetConnection.step` runs one per-host step (the
commands differ per host: shard, paths); Fabric runs it on every member at once and gathers
results and exceptions per connection (``GroupResult``/``GroupException``).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import paramiko
from fabric import Connection, ThreadingGroup
from fabric.exceptions import GroupException

from hs_patch import names
from hs_patch.control.inventory import ConfigError, Target
from hs_patch.control.shell import RemoteError, Shell
from hs_patch.samples.files import write_text_atomic

DEFAULT_GROUP = "gpu_hosts"
CONNECT_TIMEOUT_S = 30  # the TCP connect of a new connection (a dead host of a fleet fails it in this long)
# the wait for a session channel on an open connection (paramiko's default: an hour). The dashboards'
# reads are bounded by hs_patch.control.poll, whatever paramiko waits for
CHANNEL_TIMEOUT_S = 30


# --------------------------------------------------------------------------- the plan


@dataclass
class Plan:
    run: str
    shards: dict[str, int]                                  # inventory host name -> shard index
    reassigned: dict[str, str] = field(default_factory=dict)  # host whose shard moved -> host running it
    created: float = 0.0

    @property
    def count(self) -> int:
        return len(self.shards)

    def shard(self, host: str) -> str:
        return f"{self.shards[host]}/{self.count}"


def plan_dir() -> Path:
    return Path(os.environ.get("HS_FLEET_DIR") or Path.home() / ".local" / "state" / "hs-patch" / "fleet")


def plan_path(run: str) -> Path:
    return plan_dir() / f"{names.check_run_name(run)}.json"


def load_plan(run: str) -> Plan | None:
    p = plan_path(run)
    if not p.exists():
        return None
    try:
        doc = json.loads(p.read_text())
        return Plan(run=doc["run"], shards={str(k): int(v) for k, v in doc["shards"].items()},
                    reassigned=dict(doc.get("reassigned") or {}), created=float(doc.get("created") or 0))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"fleet plan {p} is unreadable ({e}); restore it from a backup, or start a new run "
                          "with another --run NAME") from None


def save_plan(plan: Plan) -> Path:
    p = plan_path(plan.run)
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_text_atomic(p, json.dumps(asdict(plan), indent=2, sort_keys=True) + "\n", fsync=True, mode=0o600)
    return p


def check_host_name(name: str) -> str:
    """An inventory name that can name a directory at the destination (the gate's rule)."""
    try:
        return names.check_run_name(name)
    except names.RunNameError:
        raise ConfigError(f"inventory host name {name!r} cannot name its directory at the destination: use "
                          "letters, digits, '.', '_' and '-' (an alias in the inventory, ansible_host for the "
                          "address)") from None


def plan_for(run: str, hosts: Sequence[str], *, save: bool = True) -> tuple[Plan, list[str]]:
    """The run's plan (made now from ``hosts`` if it has none; saved unless ``save`` is False, then the caller
    saves it once the run starts: ``fab extract --hosts`` after every preflight passed) and notes for the
    operator: hosts of the group that are not in the plan, planned hosts missing from the group."""
    plan = load_plan(run)
    if plan is None:
        if not hosts:  # a plan of no shards would hold the run's name for ever, every later host "joined after"
            raise ConfigError(f"the group has no hosts: run {run} is not planned; give --hosts a group of the "
                              "inventory with GPU hosts in it (ansible-inventory --graph lists them)")
        for h in hosts:
            check_host_name(h)
        plan = Plan(run=run, shards={h: i for i, h in enumerate(sorted(hosts))}, created=time.time())
        if save:
            save_plan(plan)
        return plan, []
    notes = [f"{h} joined the group after run {run} started: it takes no shard (every sample already has a "
             "host; start a new run to use it)" for h in hosts if h not in plan.shards]
    for h in sorted(set(plan.shards) - set(hosts)):
        if h in plan.reassigned:
            notes.append(f"{h} is not in the group; its shard {plan.shard(h)} runs on {plan.reassigned[h]}")
        else:
            notes.append(f"{h} is not in the group: its shard {plan.shard(h)} is not being extracted; give it to "
                         f"another host with fab extract --reassign {h} --host OTHER --run {run}")
    return plan, notes


def reassign_run(run: str, dead: str) -> str:
    """The local run name of a reassigned shard on its new host (its own state dir and units)."""
    return names.check_run_name(f"{run}.{dead}")


# --------------------------------------------------------------------------- connections


def connection(t: Target, cls: type = Connection) -> Any:
    """A Fabric connection to ``t`` that refuses unknown host keys (not opened yet)."""
    kwargs: dict[str, Any] = {"channel_timeout": CHANNEL_TIMEOUT_S}
    if t.key_file:
        kwargs["key_filename"] = t.key_file
    c = cls(t.host, user=t.user, port=t.port, connect_kwargs=kwargs, connect_timeout=CONNECT_TIMEOUT_S)
    c.client.set_missing_host_key_policy(paramiko.RejectPolicy())  # never trust an unknown host key
    known = known_hosts(t)
    if known.exists():
        c.client.load_host_keys(str(known))
    return c


def known_hosts(t: Target) -> Path:
    return Path(t.known_hosts or Path.home() / ".ssh" / "known_hosts").expanduser()


def open_connection(c: Any, t: Target) -> None:
    """Open ``c``; a failure raises RemoteError saying what to check."""
    key = t.key_file and Path(t.key_file).expanduser()
    if key and not key.is_file():
        raise RemoteError(f"the SSH key {t.key_file} for {t.host} is not on this machine (the inventory's "
                          "ansible_ssh_private_key_file): put it there or correct the inventory")
    try:
        c.open()
    except paramiko.PasswordRequiredException:
        raise RemoteError(f"cannot log in to {t.user}@{t.host}:{t.port}: the SSH key {t.key_file or ''} needs its "
                          "passphrase: load it into ssh-agent (ssh-add KEY), then run the same command again") from None
    except paramiko.AuthenticationException as e:
        raise RemoteError(f"cannot log in to {t.user}@{t.host}:{t.port} ({e}): check ansible_user and the key "
                          "(ansible_ssh_private_key_file, or the keys in ssh-agent) in the inventory") from None
    except paramiko.SSHException as e:
        known = known_hosts(t)
        raise RemoteError(f"cannot connect to {t.user}@{t.host}:{t.port}: {e}. Is the host key in {known}? "
                          f"(ssh-keyscan -p {t.port} {t.host} >> {known} after checking it)") from None
    except OSError as e:
        raise RemoteError(f"cannot reach {t.host}:{t.port}: {e}") from None


class FleetConnection(Connection):
    """A Connection that knows its inventory host, for :class:`FleetGroup` steps."""

    # class attributes, so that setting them sets attributes (invoke's DataProxy turns
    # unknown attribute sets into config values)
    target: Target = None  # type: ignore[assignment]
    shell: Shell = None  # type: ignore[assignment]

    def step(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(shell, target, *args)`` on this host (opening the connection first)."""
        if not self.is_connected:
            open_connection(self, self.target)
        return fn(self.shell, self.target, *args)


class FleetGroup(ThreadingGroup):
    """The hosts of a fleet run; :meth:`each` runs a step on all of them at once (Fabric's threads)."""

    @classmethod
    def of(cls, targets: Sequence[Target]) -> "FleetGroup":
        conns = []
        for t in targets:
            c = connection(t, FleetConnection)
            c.target, c.shell = t, Shell(c, t)
            conns.append(c)
        return cls.from_connections(conns)

    def each(self, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
        """Inventory name -> ``fn(shell, target, *args)``, run on every host in parallel. A step
        that fails on some hosts raises RemoteError naming each of them (after all finished)."""
        try:
            results = self._do("step", fn, *args)
        except GroupException as e:
            failed = {c.target.name: r for c, r in e.result.items() if isinstance(r, BaseException)}
            raise RemoteError("; ".join(f"{h}: {reason(r)}" for h, r in sorted(failed.items()))) from None
        return {c.target.name: r for c, r in results.items()}

    def try_each(self, fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
        """Like :meth:`each`, but a host's exception is its result (the dashboard shows it)."""
        try:
            results = self._do("step", fn, *args)
        except GroupException as e:
            results = e.result
        return {c.target.name: r for c, r in results.items()}


def reason(e: BaseException) -> str:
    """What a host's failed step says."""
    if isinstance(e, SystemExit):
        return str(e.code)
    return str(e) or type(e).__name__
