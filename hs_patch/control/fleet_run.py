"""``fab extract --hosts GROUP``, ``--reassign HOST`` and ``fab status --hosts GROUP``: the fleet's steps.

Preflight runs on every host before anything starts on any; then every host starts its
job (its shard of the dataset, shipping into its own directory at the destination); then
one dashboard shows them all. Everything per host runs on all hosts at once through
:class:`hs_patch.control.fleet.FleetGroup` (Fabric's ThreadingGroup). The plan and the
storage layout: :mod:`hs_patch.control.fleet`; the operator's guide: docs/fleet.md.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from hs_patch.control import extraction, fleet, fleet_dashboard, remote
from hs_patch.control.extraction import Job
from hs_patch.control.fleet import FleetGroup, Plan
from hs_patch.control.dashboard import DEAD_AFTER_S
from hs_patch.control.fleet_dashboard import Row
from hs_patch.control.poll import Poller
from hs_patch.control.inventory import ConfigError, Inventory, Target
from hs_patch.control.shell import RemoteError, Shell


def jobs_for(plan: Plan, targets: list[Target], dataset: str, remote_dataset: bool, limit: int,
             regenerate: bool, max_tokens: int = remote.MAX_SAMPLE_TOKENS,
             accept_changed_data: bool = False) -> dict[str, Job]:
    """Each planned host's job: the run under its own name, its shard, its own destination directory."""
    return {t.name: Job(plan.run, dataset, remote_dataset,
                        extraction.driver_args(limit, regenerate, plan.shard(t.name), accept_changed_data),
                        max_tokens=max_tokens, dest=remote.destination(t, plan.run, t.name), share=plan.count)
            for t in targets}


def run_jobs(targets: list[Target], jobs: dict[str, Job], server_timeout: int, say: Callable[[str], None],
             passed: Callable[[], None] | None = None, refused: str = "") -> FleetGroup:
    """Preflight every host, then (all passed) start every job; in parallel, host by host results.
    ``passed``: called once every preflight passed, before anything starts; ``refused``: what else a
    failed preflight left as it was."""
    group = FleetGroup.of(targets)
    say(f"preflight on {len(targets)} host(s): {', '.join(t.name for t in targets)}")
    # every host's report, one that cannot be reached among them (it hid the others' findings)
    checks = group.try_each(lambda c, t: extraction.preflight(c, t, jobs[t.name]))
    for name in sorted(checks):
        got = checks[name]
        print(f"{name} ({jobs[name].describe()}):\n" + (f"{name}: no preflight: {fleet.reason(got)}"
              if isinstance(got, BaseException) else extraction.report(name, got)), flush=True)
    bad = sorted(n for n, cs in checks.items() if isinstance(cs, BaseException) or not all(ch.ok for ch in cs))
    if bad:
        sys.exit(f"fab: preflight failed on {', '.join(bad)}; nothing was started on any host{refused}. Fix what "
                 "is listed above, then run the same fab extract again")
    if passed is not None:
        passed()
    say("starting the server units (each waits for /health_generate), then the driver and shipper units")
    started = group.try_each(lambda c, t: extraction.start(c, t, jobs[t.name], server_timeout,
                                                            lambda msg: say(f"{t.name}: {msg}")))
    for name, got in sorted(started.items()):
        say(f"{name}: NOT started: {fleet.reason(got)}" if isinstance(got, BaseException) else
            f"{name}: started {', '.join(got) or 'nothing new (already running)'}")
    failed = sorted(n for n, got in started.items() if isinstance(got, BaseException))
    if failed:  # the others' jobs run: said above, and how to see them (one failure hid that they had started)
        raise RemoteError(f"the start failed on {', '.join(failed)}; the jobs started on the other hosts go on (fab "
                          f"status shows them). Fix {', '.join(failed)}, then run the same fab extract again: it "
                          "starts what is not running and leaves running jobs alone")
    return group


def destination_of(t: Target, run: str) -> str | None:
    """Where ``run`` on ``t`` ships when it is a fleet run's part (``RUN/HOST``, or a reassigned
    shard ``RUN.DEAD`` into ``RUN/DEAD``); None for a single-host run (``RUN``)."""
    plan = fleet.load_plan(run)
    if plan is not None and t.name in plan.shards:
        return remote.destination(t, run, t.name)
    base, _, dead = run.rpartition(".")
    plan = fleet.load_plan(base) if base else None
    if plan is not None and dead in plan.shards:
        # the shard's part, RUN/DEAD, whoever runs it now: a host it was moved on from (or back from) still holds
        # samples of RUN.DEAD, and a stray STORAGE/RUN.DEAD/ is a directory no inspect or export of RUN reads
        return remote.destination(t, base, dead)
    return None


def rows_for(plan: Plan, targets: list[Target], *, every: bool = False) -> list[Row]:
    """Dashboard rows: each planned host of ``targets`` running its own shard, and each
    reassigned shard on the host that runs it. ``every``: also the own job of a host whose
    shard was reassigned (still there when it comes back: fab stop/ship --hosts reach it)."""
    here = {t.name for t in targets}
    rows = [Row(n, n, plan.run, plan.shard(n), n) for n in sorted(plan.shards, key=plan.shards.get)
            if n in here and (every or n not in plan.reassigned)]
    rows += [Row(f"{to} (shard of {dead})", to, fleet.reassign_run(plan.run, dead), plan.shard(dead), dead)
             for dead, to in sorted(plan.reassigned.items())]
    return rows


def group_rows(inv: Inventory, plan: Plan, group: str, *, every: bool = False) -> list[Row]:
    """:func:`rows_for` the hosts of ``group``; ConfigError when none of them has a job in the run (a dashboard of
    no rows read 'complete: every line is held (0 samples)')."""
    rows = rows_for(plan, inv.group(group), every=every)
    if not rows:
        raise ConfigError(f"no host of {group} has a job in run {plan.run} (fleet plan {fleet.plan_path(plan.run)}): "
                          f"give the group the run was started on (the plan's hosts: {', '.join(sorted(plan.shards))})")
    known = set(inv.host_names())
    for r in rows:
        if r.host not in known:  # a reassigned shard's host, since dropped from the inventory
            raise ConfigError(f"{r.owner}'s shard of run {plan.run} runs on {r.host}, which is not in the inventory "
                              f"now (fleet plan {fleet.plan_path(plan.run)}): put {r.host} back in it, or move the "
                              f"shard: fab extract --reassign {r.owner} --host OTHER --run {plan.run} --dataset DATASET")
    return rows


def watch(inv: Inventory, plan: Plan, rows: list[Row], reattach: str, *, interval: float, once: bool = False,
          dead_after: float = DEAD_AFTER_S) -> int:
    """The fleet dashboard over ``rows``: each host read in its own thread (:mod:`hs_patch.control.poll`)."""
    def snaps(c: Shell, t: Target) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for r in rows:
            if r.host == t.name:
                try:
                    out[r.label] = remote.snapshot(c, t, r.run)
                except RemoteError as e:  # the host answered: this row's read failed (its link did not)
                    out[r.label] = e
        return out

    poller = Poller.of([inv.target(h) for h in sorted({r.host for r in rows})], snaps, interval=interval)
    return fleet_dashboard.watch(poller, rows, plan.run, reattach, interval=interval, once=once,
                                 dead_after=dead_after)


def extract(inv: Inventory, group: str | None, host: str | None, run: str, dataset: str, remote_dataset: bool,
            limit: int, regenerate: bool, server_timeout: int, interval: float, detach: bool,
            say: Callable[[str], None], dead_after: float = DEAD_AFTER_S,
            max_tokens: int = remote.MAX_SAMPLE_TOKENS, accept_changed_data: bool = False) -> int:
    """``fab extract --hosts GROUP`` (or ``--host H`` of a run that has a fleet plan)."""
    new = False
    if group:
        targets = inv.group(group)
        new = fleet.load_plan(run) is None  # planned below, saved once every preflight passed
        plan, notes = fleet.plan_for(run, [t.name for t in targets], save=False)
        notes += [take_back(plan, t.name) for t in targets if t.name in plan.reassigned]
    else:
        plan, notes = fleet.load_plan(run), []
        targets = [inv.target(host or "")]
        if plan is None or targets[0].name not in plan.shards:
            raise ConfigError(f"{host} has no shard in fleet run {run} (fleet plan {fleet.plan_path(run)})")
        if targets[0].name in plan.reassigned:
            raise ConfigError(take_back(plan, targets[0].name))
    for note in notes:
        say(note)
    active = [t for t in targets if t.name in plan.shards and t.name not in plan.reassigned]
    if not active:
        raise ConfigError(f"no host of {group or host} has a shard of run {run} to run (fleet plan "
                          f"{fleet.plan_path(run)}: {', '.join(sorted(plan.shards))})")
    say(f"fleet run {run}: {plan.count} shard(s); plan {fleet.plan_path(run)}"
        + (" (saved once every preflight passed)" if new else ""))
    run_jobs(active, jobs_for(plan, active, dataset, remote_dataset, limit, regenerate, max_tokens,
                              accept_changed_data), server_timeout, say,
             passed=(lambda: fleet.save_plan(plan)) if new else None,
             refused=f" and run {run} is not planned: the next start plans it with the group as it is then"
             if new else "")
    reattach = f"fab status --hosts {group} --run {run}" if group else f"fab status --host {host} --run {run}"
    if detach:
        say(f"watch with: {reattach}")
        return 0
    return watch(inv, plan, rows_for(plan, targets), reattach, interval=interval, dead_after=dead_after)


def take_back(plan: Plan, host: str) -> str:
    """Where ``host``'s reassigned shard runs, and the command that gives it back to ``host``."""
    return (f"{host}'s shard {plan.shard(host)} runs on {plan.reassigned[host]} (fleet plan "
            f"{fleet.plan_path(plan.run)}); to take it back: fab extract --reassign {host} --host {host} --run "
            f"{plan.run} --dataset DATASET")


def driver_state(t: Target, run: str) -> str:
    """The state of ``run``'s driver unit on ``t`` (RemoteError when ``t`` does not answer)."""
    drive, _ = remote.units(run)
    group = FleetGroup.of([t])
    try:
        return str(group.each(lambda c, tt: remote.unit_state(c, drive))[t.name])
    finally:
        group.close()


def holder_state(inv: Inventory, host: str, run: str) -> str:
    """:func:`driver_state` on a host that may be gone: ``not in the inventory``, or
    ``unreachable: WHY`` when it does not answer (a dead host's job extracts nothing)."""
    try:
        return driver_state(inv.target(host), run)
    except ConfigError:
        return "not in the inventory"
    except RemoteError as e:
        return f"unreachable: {e}"


def reassign(inv: Inventory, dead: str, host: str, run: str, dataset: str, remote_dataset: bool, limit: int,
             regenerate: bool, server_timeout: int, interval: float, detach: bool, say: Callable[[str], None],
             dead_after: float = DEAD_AFTER_S, max_tokens: int = remote.MAX_SAMPLE_TOKENS,
             accept_changed_data: bool = False) -> int:
    """``fab extract --reassign DEAD --host TARGET``: TARGET finishes DEAD's shard, shipping into
    DEAD's directory at the destination (what is there already is never redone nor resent).
    TARGET = DEAD, a host back after its shard moved: it takes its own shard back (run RUN again)."""
    plan = fleet.load_plan(run)
    if plan is None:
        raise ConfigError(f"run {run} has no fleet plan ({fleet.plan_path(run)}): --reassign moves a shard of a "
                          "run started with fab extract --hosts GROUP")
    if dead not in plan.shards:
        raise ConfigError(f"{dead} has no shard in run {run} (shards: {', '.join(sorted(plan.shards))})")
    t = inv.target(host)
    back = t.name == dead and dead in plan.reassigned
    if t.name == dead and not back:
        raise ConfigError(f"--reassign {dead} --host {host}: give another host (to resume {dead} itself: "
                          f"fab extract --host {dead} --run {run})")
    was = plan.reassigned.get(dead, t.name)
    if was != t.name:  # moved before: again only once its driver there has ended (or that host is gone)
        moved = fleet.reassign_run(run, dead)
        there = holder_state(inv, was, moved)
        if there in remote.RUNNING:
            raise ConfigError(f"the shard of {dead} runs on {was} (run {moved}: {there}); stop it there first "
                              f"(fab stop --host {was} --run {moved}), then run this again")
        say(f"the shard of {dead} was given to {was}, whose driver of it is not running ({there}): it moves to "
            f"{t.name}" + (f"; if {was} comes back, stop it there: fab stop --host {was} --run {moved}"
                           if there.startswith(("unreachable", "not in")) else ""))
    elif not back:  # the first move: DEAD's own driver of RUN must have ended, or DEAD be gone
        there = holder_state(inv, dead, run)
        if there in remote.RUNNING:
            raise ConfigError(f"{dead}'s driver of run {run} is {there}: that host is extracting its shard; stop it "
                              f"first (fab stop --host {dead} --run {run}) or let it finish, then run this again")
        if there.startswith(("unreachable", "not in")):
            say(f"{dead} does not answer ({there}): if it comes back, stop its run there before it extracts and "
                f"ships more of this shard: fab stop --host {dead} --run {run}")
    own, _ = remote.units(run)
    state = "" if back else driver_state(t, run)
    job = Job(run if back else fleet.reassign_run(run, dead), dataset, remote_dataset,
              extraction.driver_args(limit, regenerate, plan.shard(dead), accept_changed_data), max_tokens=max_tokens,
              dest=remote.destination(t, run, dead), share=plan.count, sync_first=True)
    say((f"{dead} takes its shard {plan.shard(dead)} back as run {run}, shipping into {job.dest} (what {was} "
         "shipped there counts as done)" if back else
         f"{t.name} takes the shard {plan.shard(dead)} of {dead} as run {job.run}, shipping into {job.dest}")
        + (f"; queued behind {own} ({state} there: one server, one capture dir, one driver at a time): it starts "
           "when that one ends" if state in remote.RUNNING else ""))

    def record() -> None:  # after OTHER's preflight passed (a refused one moves nothing), before the start:
        if back:  # a half-started reassignment is still on record
            del plan.reassigned[dead]
        else:
            plan.reassigned[dead] = t.name
        fleet.save_plan(plan)

    run_jobs([t], {t.name: job}, server_timeout, say, passed=record)
    rows = [r for r in rows_for(plan, [t]) if r.host == t.name and r.run == job.run]
    reattach = f"fab status --host {t.name} --run {job.run}"
    if detach:
        say(f"watch with: {reattach}")
        return 0
    return watch(inv, plan, rows, reattach, interval=interval, dead_after=dead_after)


def on_each_host(inv: Inventory, plan: Plan, group: str, step: Callable[[Shell, Target, Row], Any],
                 after: Callable[[Shell, Target], Any] | None = None) -> dict[str, Any]:
    """``step`` for every job of the run on the hosts of ``group`` (a host's own shard, and a shard
    reassigned to it), then ``after`` once a host, every host at once; host -> {row label: result, and
    "<host> (after)": after's result or the RemoteError it raised}, or the exception that host gave
    (a dead host fails alone: the others' results stand)."""
    rows = group_rows(inv, plan, group, every=True)
    fg = FleetGroup.of([inv.target(h) for h in sorted({r.host for r in rows})])

    def each(c: Shell, t: Target) -> dict[str, Any]:
        out: dict[str, Any] = {r.label: step(c, t, r) for r in rows if r.host == t.name}
        if after is not None:
            try:  # the jobs' results stand when only this fails
                out[f"{t.name} (after)"] = after(c, t)
            except RemoteError as e:
                out[f"{t.name} (after)"] = e
        return out

    try:
        return fg.try_each(each)
    finally:
        fg.close()


def stop_all(inv: Inventory, plan: Plan, group: str, server: bool, say: Callable[[str], None]) -> int:
    """``fab stop --hosts GROUP --run R``: every job of the run stopped cleanly (each driver, then
    its shipper, finish what is in flight), the servers too with ``server``. 1 if a host failed."""
    res = on_each_host(inv, plan, group, lambda c, t, r: remote.stop(c, t, r.run),
                       (lambda c, t: {t.service: remote.stop_server(c, t)}) if server else None)
    for host, got in sorted(res.items()):
        if isinstance(got, BaseException):
            say(f"{host}: NOT stopped: {fleet.reason(got)}; when it answers: fab stop --host {host} --run "
                f"{plan.run}" + (" --server" if server else ""))
            continue
        for label, states in got.items():
            label = label.replace(" (after)", " (server)")
            say(f"{label}: NOT stopped: {fleet.reason(states)}; fab stop --host {host} --run {plan.run} --server "
                "tries again" if isinstance(states, BaseException)
                else f"{label}: {remote.in_words(states)}")
    bad = sorted(h for h, got in res.items() if isinstance(got, BaseException)
                 or not all(not isinstance(states, BaseException) and remote.all_stopped(states)
                            for states in got.values()))
    say(f"resume with the same fab extract --hosts {group} --run {plan.run}; drain with fab ship --hosts {group} "
        f"--run {plan.run}" + (f"; not stopped: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


def ship_all(inv: Inventory, plan: Plan, group: str, say: Callable[[str], None]) -> int:
    """``fab ship --hosts GROUP --run R``: every job's finished samples shipped now into its part of the
    run at the destination, verified there, each host at once. 1 if anything was not shipped."""
    res = on_each_host(inv, plan, group, lambda c, t, r: extraction.drain(c, t, r.run, dest=destination_of(t, r.run)))
    failed = []
    for host, got in sorted(res.items()):
        if isinstance(got, BaseException):
            failed.append(host)
            say(f"{host}: NOT shipped: {fleet.reason(got)}; when it answers: fab ship --hosts {group} --run {plan.run}")
            continue
        for label, (code, out) in got.items():
            last = out.strip().splitlines()[-1] if out.strip() else ""
            say(f"{label}: {'shipped' if code == 0 else f'FAILED (exit {code})'}: {last}")
            if code:
                failed.append(label)
                print(out[-3000:], flush=True)
    say("every job's samples are at the destination, verified" if not failed else
        f"not all shipped: {', '.join(failed)}")
    return 1 if failed else 0
