"""The live extraction dashboard of ``fab extract`` / ``fab status`` (rich).

It only reads: a snapshot (``hs_patch.host.driver.snapshot``) taken on the GPU host every few
seconds. Ctrl-C or a dropped connection detaches and says how to reattach; the job runs
on as systemd units.
"""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

FINISHED = ("inactive", "failed")
T = TypeVar("T")


def _gb(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _state(snap: dict[str, Any], unit: str) -> str:
    u = (snap.get("units") or {}).get(unit) or {}
    state = u.get("ActiveState", "?")
    if state in FINISHED and u.get("ExecMainStatus") not in (None, "", "0"):
        state += f" (exit {u['ExecMainStatus']})"
    return state


def render(snap: dict[str, Any], host: str, progress: Progress, task: Any) -> Group:
    run = snap["run"]
    d = snap.get("driver") or {}
    s = d.get("samples") or {}
    tok = d.get("tokens") or {}
    ship = snap.get("shipper") or {}
    hook = snap.get("hook") or {}
    total = s.get("total") or 0
    finished = s.get("done", 0) + s.get("rejected", 0) + s.get("duplicates", 0) + s.get("failed", 0)
    progress.update(task, total=total or None, completed=finished,
                    description=f"{run}: {s.get('done', 0)} done / {total}")

    stats = Table.grid(padding=(0, 2))
    stats.add_column(style="bold")
    stats.add_column()
    stats.add_column(style="bold")
    stats.add_column()
    dump, samples = snap.get("dump") or {}, snap.get("samples") or {}
    ship_state = "STORAGE UNREACHABLE, waiting" if ship.get("outage") else ship.get("state", "-")
    stats.add_row("driver", f"{d.get('state', '-')} [{_state(snap, f'hs-drive-{run}')}]",
                  "shipper", f"{ship_state} [{_state(snap, f'hs-ship-{run}')}]")
    stats.add_row("rejected", str(s.get("rejected", 0)), "duplicates", str(s.get("duplicates", 0)))
    stats.add_row("failed", str(s.get("failed", 0)), "in flight", str(s.get("in_flight", 0)))
    stats.add_row("tokens", f"{tok.get('done_now', 0):,}", "tokens/s", f"{tok.get('per_s', 0):,.0f}")
    shipped, pending = ship.get("shipped") or {}, ship.get("pending") or {}
    stats.add_row("written", _gb(d.get("bytes_written")), "shipped",
                  f"{shipped.get('count', 0)} ({_gb(shipped.get('bytes'))})")
    stats.add_row("to ship", f"{pending.get('count', 0)} ({_gb(pending.get('bytes'))})", "ship rate",
                  _gb(ship.get("throughput_bytes_per_s")) + "/s" if ship.get("throughput_bytes_per_s") else "-")
    paused = (d.get("dump") or {}).get("paused")
    stats.add_row("dump dir", f"{dump.get('used_pct', '-')}% used" + ("  PAUSED (high water)" if paused else ""),
                  "samples dir", f"{samples.get('used_pct', '-')}% used")
    stats.add_row("server", _state(snap, "sglang") if "sglang" in (snap.get("units") or {}) else "-",
                  "hook waits", f"{hook.get('waits', 0)} ({hook.get('wait_seconds', 0)} s)")
    fid = d.get("fidelity") or {}   # hs_patch.host.fidelity.policy.FidelityMonitor.status()
    if fid:
        stats.add_row("fidelity", f"{fid.get('passed', 0)}/{fid.get('checked', 0)} ok, {fid.get('ties', 0)} ties",
                      "fid. rejected", f"{fid.get('rejected', 0)} ({fid.get('consecutive_mismatches', 0)} in a row, "
                      f"stop at {fid.get('max_consecutive', '-')})")

    gpus = Table("GPU", "name", "util", "memory", box=None, padding=(0, 1))
    for g in snap.get("gpus") or []:
        mem = f"{(g['mem_used'] or 0) / 1024:.1f}/{(g['mem_total'] or 0) / 1024:.1f} GiB"
        gpus.add_row(g["index"], g["name"], f"{g['util'] or 0:.0f}%", mem)

    problems = []
    outage = ship.get("outage") or {}
    if outage:
        problems.append(f"shipper: storage unreachable for {outage.get('seconds', 0):.0f}s ({outage.get('failures', 0)} "
                        f"tries; next in {outage.get('retry_in_s', 0):.0f}s): nothing is lost, shipping resumes by "
                        "itself"[:200])
    for r in snap.get("rejects") or []:
        problems.append(f"reject {r.get('source', '')}:{r.get('line', '')} {r.get('reason', '')}"[:160])
    if fid.get("last_mismatch"):
        m = fid["last_mismatch"]
        why = (m.get("problems") or [f"{m.get('mismatches')} of {m.get('checked')} positions disagree with the "
                                     "server's own tokens"])[0]
        problems.append(f"fidelity: sample {m.get('key', '')[:12]} rejected: {why}"[:200])
    if fid.get("last_warning"):
        problems.append(f"fidelity warning ({fid.get('warnings')}): {fid['last_warning']}"[:200])
    for who, msg in (("driver", (d.get("errors") or {}).get("last")), ("shipper", ship.get("last_error")),
                     ("hook", hook.get("error"))):
        if msg:
            problems.append(f"{who}: {msg}"[:200])
    parts: list[Any] = [progress, stats]
    if snap.get("gpus"):
        parts.append(gpus)
    if problems:
        parts.append(Panel("\n".join(problems[-8:]), title="rejects and errors", border_style="yellow"))
    return Group(Panel(Group(*parts), title=f"hs-patch extraction on {host}", border_style="cyan"))


def stopped_short(snap: dict[str, Any]) -> bool:
    """The driver's unit ended without finishing its run (stopped or failed): nothing more comes
    until the same command runs again; the shipper, following, waits for that resume."""
    run = snap["run"]
    unit = ((snap.get("units") or {}).get(f"hs-drive-{run}") or {}).get("ActiveState")
    state = (snap.get("driver") or {}).get("state")
    return unit in FINISHED and state not in (None, "finished")


def done(snap: dict[str, Any]) -> bool:
    """Driver and shipper units both finished, or the driver stopped short (see ``stopped_short``)."""
    run = snap["run"]
    units = snap.get("units") or {}
    return stopped_short(snap) or all((units.get(u) or {}).get("ActiveState") in FINISHED
                                      for u in (f"hs-drive-{run}", f"hs-ship-{run}") if u in units)


def follow(fetch: Callable[[], T], draw: Callable[[T], Any], finished: Callable[[T], bool], *, console: Console,
           interval: float, gone: Callable[[str], str], detached: str,
           lost: Callable[[T], str] = lambda got: "") -> T | None:
    """Redraw what ``fetch`` returns every ``interval`` seconds until ``finished`` says so: then the last
    view. A fetch that raises, or whose view ``lost`` says reached nothing (the reason; "": it did),
    five times in a row: None after saying ``gone(reason)``; Ctrl-C: None after ``detached``. The
    job goes on where it runs either way (both dashboards, one host or a fleet, follow with this)."""
    from rich.live import Live

    misses = 0
    try:
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while True:
                try:
                    got: T | None = fetch()
                except Exception as e:  # noqa: BLE001 - a flaky link must not end the job
                    got, why = None, str(e)
                else:
                    live.update(draw(got))
                    why = lost(got)
                misses = misses + 1 if why else 0
                if misses >= 5:
                    live.stop()
                    console.print(f"[yellow]{gone(why)}[/]")
                    return None
                if got is not None and finished(got):
                    return got
                time.sleep(interval)
    except KeyboardInterrupt:
        console.print(f"\n[yellow]{detached}[/]")
        return None


def watch(fetch: Callable[[], dict[str, Any]], host: str, run: str, *, interval: float = 2.0,
          once: bool = False, console: Console | None = None) -> int:
    """Show the dashboard until the job finishes (0) or the driver stops short (1), or detach on
    Ctrl-C / lost link (2)."""
    console = console or Console()
    reattach = f"fab status --host {host} --run {run}"
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                        TimeRemainingColumn(), console=console)
    task = progress.add_task(run, total=None)
    if once:
        snap = fetch()
        console.print(render(snap, host, progress, task))
        return 0
    snap = follow(fetch, lambda s: render(s, host, progress, task), done, console=console, interval=interval,
                  gone=lambda why: f"lost the connection to {host} ({why}). The job goes on there; reattach with: "
                                   f"{reattach}",
                  detached=f"detached; the job goes on on {host}. Reattach with: {reattach}")
    if snap is None:
        return 2
    d = snap.get("driver") or {}
    console.print()
    if stopped_short(snap):
        console.print(f"[red]driver {d.get('state')}[/] after {((d.get('samples') or {}).get('done'))} samples: "
                      f"{d.get('message')}. The shipper keeps shipping what was made and waits for the rest; "
                      "run the same fab extract again to resume")
        return 1
    console.print(f"[green]finished[/]: driver {d.get('state')}, {((d.get('samples') or {}).get('done'))} samples; "
                  f"shipper {(snap.get('shipper') or {}).get('state')}")
    return 0
