"""The fleet's live dashboard (``fab extract --hosts`` / ``fab status --hosts``): one row a host, one total.

Per host and in total: samples done of its shard, tokens/s, GB written and shipped, what
waits to be shipped, back-pressure (the dump filesystem's use, PAUSED at the high-water
mark), errors, and an ETA from the samples finished since the dashboard started. It only
reads: each row is the same snapshot the single-host dashboard shows
(``hs_patch.host.driver.snapshot``), each host read in a thread of its own with every read
bounded in time (:mod:`hs_patch.control.poll`): a host that stops answering is shown
unreachable within ``poll.POLL_DEADLINE_S`` while the other rows go on. The command ends when
every host that answers is done and every one that does not has been silent ``--dead-after``
seconds (exit 3, naming each such host and how to give its shard to another). Ctrl-C
detaches; the jobs run on as systemd units.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table

from hs_patch.control.dashboard import DEAD_AFTER_S, Ending, _gb, _state, conclusion, follow
from hs_patch.control.verdict import ended
from hs_patch.control.poll import Answer, Poller
from hs_patch.control.shell import StatusUnreadable, silence


@dataclass
class Row:
    label: str         # what the operator calls it: the host, or "HOST (shard of DEAD)"
    host: str          # inventory name of the host it runs on
    run: str           # the run's name on that host
    shard: str = ""
    owner: str = ""    # the host the plan gave the shard to (another one's when reassigned)


@dataclass
class Unreachable:
    """A row not read for ``seconds`` (``why``: the last failure: its host's, or its own), with what it last showed."""
    seconds: float
    why: Any
    last: dict[str, Any] | None = None

    def __str__(self) -> str:
        return silence(self.why, self.seconds)

    def seen(self, shard: str) -> str:
        """What it last showed of its shard."""
        if not self.last:
            return f"never read, shard {shard}"
        return f"last seen {((self.last.get('driver') or {}).get('samples') or {}).get('done')} done of its shard {shard}"


def views(rows: list[Row], answers: dict[str, Answer], now: float, since: float,
          seen: dict[str, tuple[float, dict[str, Any]]]) -> dict[str, Any]:
    """Label -> its snapshot; :class:`Unreachable` when its host does not answer, or answers with an
    error for it; None before the first answer. ``seen`` keeps each row's last snapshot and when it
    came (shown for a row gone silent, and how long ago)."""
    out: dict[str, Any] = {}
    for r in rows:
        a = answers.get(r.host) or Answer()
        got = a.value.get(r.label) if a.ok and isinstance(a.value, dict) else a.value
        if isinstance(got, dict):
            seen[r.label] = (a.last_ok or now, got)
            out[r.label] = got
        elif got is None:
            out[r.label] = None
        else:
            at, last = seen.get(r.label, (since, None))
            out[r.label] = Unreachable(now - at, got, last)
    return out


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
            "outage": bool(ship.get("outage")), "refused": bool((ship.get("outage") or {}).get("refused"))}


def render(rows: list[Row], snaps: dict[str, Any], title: str, rates: Rates, now: float | None = None) -> Group:
    """The table for ``snaps`` (label -> snapshot, :class:`Unreachable`, the error its host gave, or None)."""
    now = time.time() if now is None else now
    table = Table("host", "shard", "driver", "shipper", "done", "tokens/s", "written", "shipped", "to ship",
                  "dump", "errors", "ETA", box=None, padding=(0, 1))
    total = dict.fromkeys(("done", "total", "per_s", "written", "shipped", "pending", "errors", "remaining"), 0)
    etas: list[float | None] = []
    problems = []
    for row in rows:
        snap = snaps.get(row.label)
        if not isinstance(snap, dict):
            last = _numbers(snap.last) if isinstance(snap, Unreachable) and snap.last else None
            state = (f"[red]unreachable {snap.seconds:.0f}s[/]" if isinstance(snap, Unreachable) else
                     "reading" if snap is None else "[red]error[/]")
            table.add_row(row.label, row.shard, state, "-", f"({last['done']}/{last['total']})" if last else "-",
                          "-", "-", "-", "-", "-", "-", "-")
            if snap is not None:
                problems.append(f"{row.label}: {snap}"[:200])
            etas.append(None)
            continue
        n = _numbers(snap)
        for k in total:
            total[k] += n[k]
        eta = rates.eta(row.label, n["finished"], n["remaining"], now)
        etas.append(eta)
        dump = f"{n['used'] if n['used'] is not None else '-'}%" + (" [yellow]PAUSED[/]" if n["paused"] else "")
        ship = "[red]STORAGE REFUSES[/]" if n["refused"] else "[red]STORAGE DOWN[/]" if n["outage"] else \
            _state(snap, f"hs-ship-{row.run}")
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


def ending(rows: list[Row], snaps: dict[str, Any], run: str, reattach: str, dead_after: float) -> Ending | None:
    """How the fleet's run ends, once every row is done or its host silent for ``dead_after`` seconds."""
    dead = [r for r in rows if isinstance(snaps.get(r.label), Unreachable)]
    if any(not (isinstance(snaps.get(r.label), dict) and ended(snaps[r.label])) for r in rows if r not in dead) \
            or any(snaps[r.label].seconds < dead_after for r in dead):
        return None
    if dead and len(dead) == len(rows) and not any(isinstance(snaps[r.label].why, StatusUnreadable) for r in dead):
        return Ending(2, [f"no host answers (for {min(snaps[r.label].seconds for r in dead):.0f} s or more): is this "
                          f"machine's network up? The jobs go on there; reattach with: {reattach}"], "yellow")
    if dead:
        lines = [f"{r.label}: {snaps[r.label]}; {snaps[r.label].seen(r.shard)}" for r in dead]
        unreadable = [r for r in dead if isinstance(snaps[r.label].why, StatusUnreadable)]
        silent = [r for r in dead if r not in unreadable]
        if silent:
            owners = " ".join(sorted({r.owner or r.host for r in silent}))
            lines.append(f"unreachable: {', '.join(r.label for r in silent)}: their shards are not being extracted; "
                         f"when a host is back: {reattach}; to finish a shard on a host that is done: fab extract "
                         f"--reassign HOST --host OTHER --run {run} --dataset DATASET (HOST: {owners})")
        if unreadable:
            lines.append(f"no status from: {', '.join(r.label for r in unreadable)}: their hosts answer, but the run's "
                         f"status cannot be read there (fab verify --host HOST checks the install); then: {reattach}")
        return Ending(3, lines)
    return conclusion([(r.label, snaps[r.label]) for r in rows])


def watch(poller: Poller, rows: list[Row], run: str, reattach: str, *, interval: float = 2.0, once: bool = False,
          dead_after: float = DEAD_AFTER_S, console: Console | None = None) -> int:
    """Show the fleet until every host's jobs ended: 0 when they hold every line, 1 naming those they do not
    (``dashboard.conclusion``), 3 when some hosts stayed silent ``dead_after`` seconds (naming them); detach
    on Ctrl-C or when no host answers (2). ``once``: one snapshot, 0, or 2 / 3 when none / some hosts answered."""
    console = console or Console()
    rates = Rates()
    title = f"hs-patch fleet extraction {run}"
    seen: dict[str, tuple[float, dict[str, Any]]] = {}
    if once:  # 0, or as a single host's --once: 2 when no host answered, 3 when some did not (named in the table)
        answers = poller.first()
        poller.close()
        snaps = views(rows, answers, time.monotonic(), poller.started, seen)
        console.print(render(rows, snaps, title, rates))
        dead = [r for r in rows if isinstance(snaps.get(r.label), Unreachable)]
        return 0 if not dead else 2 if len(dead) == len(rows) else 3
    return follow(poller, lambda a, now: render(rows, views(rows, a, now, poller.started, seen), title, rates),
                  lambda a, now: ending(rows, views(rows, a, now, poller.started, seen), run, reattach, dead_after),
                  console=console, interval=interval, detached=f"detached; the jobs go on. Reattach with: {reattach}")
