"""The fleet's live dashboard (``fab extract --hosts`` / ``fab status --hosts``): one row a host, one total.

Per host and in total: samples done of its shard, tokens/s, GB written and shipped, what
waits to be shipped, back-pressure (the dump filesystem's use, PAUSED at the high-water
mark), errors, and an ETA from the samples finished since the dashboard started. It only
reads: each row is the same snapshot the single-host dashboard shows
(``hs_patch.host.driver.snapshot``), taken on every host at once through Fabric's group
execution. Ctrl-C detaches; the jobs run on as systemd units.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table

from hs_patch.control.dashboard import _gb, _state, done, follow, stopped_short


@dataclass
class Row:
    label: str         # what the operator calls it: the host, or "HOST (shard of DEAD)"
    host: str          # inventory name of the host it runs on
    run: str           # the run's name on that host
    shard: str = ""


class Rates:
    """Samples finished per second of each row, since the dashboard's first look at it."""

    def __init__(self) -> None:
        self.first: dict[str, tuple[float, int]] = {}

    def eta(self, label: str, finished: int, remaining: int, now: float) -> float | None:
        t0, n0 = self.first.setdefault(label, (now, finished))
        rate = (finished - n0) / (now - t0) if now > t0 else 0.0
        return remaining / rate if rate > 0 else (0.0 if remaining == 0 else None)


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _numbers(snap: dict[str, Any]) -> dict[str, Any]:
    d = snap.get("driver") or {}
    s = d.get("samples") or {}
    ship = snap.get("shipper") or {}
    finished = s.get("done", 0) + s.get("rejected", 0) + s.get("duplicates", 0) + s.get("failed", 0)
    return {"done": s.get("done", 0), "total": s.get("total", 0), "finished": finished,
            "remaining": max(0, (s.get("total") or 0) - finished),
            "per_s": (d.get("tokens") or {}).get("per_s", 0) or 0, "written": d.get("bytes_written") or 0,
            "shipped": (ship.get("shipped") or {}).get("bytes") or 0,
            "shipped_n": (ship.get("shipped") or {}).get("count") or 0,
            "pending": (ship.get("pending") or {}).get("bytes") or 0,
            "errors": (d.get("errors") or {}).get("count", 0) + s.get("failed", 0),
            "paused": bool((d.get("dump") or {}).get("paused")), "used": (snap.get("dump") or {}).get("used_pct"),
            "outage": bool(ship.get("outage"))}


def render(rows: list[Row], snaps: dict[str, Any], title: str, rates: Rates, now: float | None = None) -> Group:
    """The table for ``snaps`` (label -> snapshot, or the exception its host gave)."""
    now = time.time() if now is None else now
    table = Table("host", "shard", "driver", "shipper", "done", "tokens/s", "written", "shipped", "to ship",
                  "dump", "errors", "ETA", box=None, padding=(0, 1))
    total = dict.fromkeys(("done", "total", "per_s", "written", "shipped", "pending", "errors", "remaining"), 0)
    etas: list[float | None] = []
    problems = []
    for row in rows:
        snap = snaps.get(row.label)
        if not isinstance(snap, dict):
            table.add_row(row.label, row.shard, "[red]unreachable[/]", "-", "-", "-", "-", "-", "-", "-", "-", "-")
            problems.append(f"{row.label}: {snap}"[:200])
            etas.append(None)
            continue
        n = _numbers(snap)
        for k in total:
            total[k] += n[k]
        eta = rates.eta(row.label, n["finished"], n["remaining"], now)
        etas.append(eta)
        dump = f"{n['used'] if n['used'] is not None else '-'}%" + (" [yellow]PAUSED[/]" if n["paused"] else "")
        ship = "[red]STORAGE DOWN[/]" if n["outage"] else _state(snap, f"hs-ship-{row.run}")
        table.add_row(row.label, row.shard, f"{(snap.get('driver') or {}).get('state', '-')}",
                      ship, f"{n['done']}/{n['total']}", f"{n['per_s']:,.0f}", _gb(n["written"]),
                      f"{n['shipped_n']} ({_gb(n['shipped'])})", _gb(n["pending"]), dump,
                      str(n["errors"]), _eta(eta))
        last = ((snap.get("driver") or {}).get("errors") or {}).get("last") or (snap.get("shipper") or {}).get("last_error")
        if last:
            problems.append(f"{row.label}: {last}"[:200])
    known = [e for e in etas if e is not None]
    table.add_row("[bold]total[/]", f"{len(rows)} hosts", "", "", f"[bold]{total['done']}/{total['total']}[/]",
                  f"{total['per_s']:,.0f}", _gb(total["written"]), _gb(total["shipped"]), _gb(total["pending"]), "",
                  str(total["errors"]), _eta(max(known) if len(known) == len(etas) and known else None))
    parts: list[Any] = [table]
    if problems:
        parts.append(Panel("\n".join(problems[-8:]), title="errors", border_style="yellow"))
    return Group(Panel(Group(*parts), title=title, border_style="cyan"))


def finished(snaps: dict[str, Any]) -> bool:
    return bool(snaps) and all(isinstance(s, dict) and done(s) for s in snaps.values())


def watch(fetch: Callable[[], dict[str, Any]], rows: list[Row], run: str, reattach: str, *,
          interval: float = 2.0, once: bool = False, console: Console | None = None) -> int:
    """Show the fleet until every host's jobs finished (0) or ended with a driver stopped short
    (1, naming those hosts), or detach on Ctrl-C / lost hosts (2)."""
    console = console or Console()
    rates = Rates()
    title = f"hs-patch fleet extraction {run}"
    if once:
        console.print(render(rows, fetch(), title, rates))
        return 0
    snaps = follow(fetch, lambda s: render(rows, s, title, rates), finished, console=console, interval=interval,
                   lost=lambda s: "no host answers" if all(not isinstance(x, dict) for x in s.values()) else "",
                   gone=lambda why: f"{why}. The jobs go on there; reattach with: {reattach}",
                   detached=f"detached; the jobs go on. Reattach with: {reattach}")
    if snaps is None:
        return 2
    short = sorted(label for label, s in snaps.items() if stopped_short(s))
    if short:
        console.print(f"[red]stopped short on {', '.join(short)}[/]: "
                      + "; ".join(f"{k}: {(snaps[k].get('driver') or {}).get('message')}" for k in short)
                      + ". Their shippers keep shipping what was made; run the same fab extract again to resume")
        return 1
    console.print(f"[green]finished[/]: every host's driver and shipper are done ({reattach} --once shows it)")
    return 0
