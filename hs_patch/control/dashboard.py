"""The live extraction dashboard of ``fab extract`` / ``fab status`` (rich).

It only reads: a snapshot (``hs_patch.host.driver.snapshot``) taken on the GPU host every few
seconds, each read bounded in time (:mod:`hs_patch.control.poll`): a host that stops answering
is shown so within ``poll.POLL_DEADLINE_S``, and after ``--dead-after`` seconds the command
ends saying how to reattach. Ctrl-C detaches; the job runs on as systemd units.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rich.console import Console, Group
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from hs_patch.control import verdict
from hs_patch.control.poll import Answer, Poller
from hs_patch.control.shell import StatusUnreadable, silence
from hs_patch.control.verdict import FINISHED
# a host that has not answered this long, with nothing else left to wait for, ends the foreground
# command (fab extract / fab status --dead-after); shown unreachable after poll.POLL_DEADLINE_S
DEAD_AFTER_S = 120.0


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
    outage = ship.get("outage") or {}
    ship_state = ("STORAGE REFUSES, fix it" if outage.get("refused") else "STORAGE UNREACHABLE, waiting") if outage \
        else ship.get("state", "-")
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
    if outage.get("refused"):
        problems.append(f"shipper: storage refuses ({outage.get('failures', 0)} tries; next in "
                        f"{outage.get('retry_in_s', 0):.0f}s): {str(outage.get('last_error', ''))[:160]}: waiting "
                        "cannot cure this; fix it and shipping resumes by itself")
    elif outage:
        problems.append(f"shipper: storage unreachable for {outage.get('seconds', 0):.0f}s ({outage.get('failures', 0)} "
                        f"tries; next in {outage.get('retry_in_s', 0):.0f}s): nothing is lost, shipping resumes by "
                        "itself"[:200])
    regen = d.get("regenerate") or {}
    if regen.get("answers_left_out"):   # the template rewrote earlier answers (hs_patch.host.driver.regenerate)
        problems.append(f"regenerate: {regen['answers_left_out']} of "
                        f"{regen['answers_left_out'] + regen.get('answers_kept', 0)} generated answers are not in "
                        "the samples done since the start (the template renders earlier turns otherwise than "
                        "generated, or truncation: docs/driver.md)")
    if (d.get("dataset") or {}).get("message"):  # changed since the run's last start (reconcile.py)
        problems.append(f"dataset: {d['dataset']['message']}"[:240])
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


@dataclass
class Ending:
    """How a followed run ends: fab's exit code and its last words (the last line sums it up)."""
    code: int
    lines: list[str]
    style: str = "red"


def follow(poller: Poller, draw: Callable[[dict[str, Answer], float], Any],
           end: Callable[[dict[str, Answer], float], Optional[Ending]], *, console: Console, interval: float,
           detached: str) -> int:
    """Redraw every ``interval`` seconds from each host's latest answer, never waiting for a host
    (:class:`hs_patch.control.poll.Poller`), until ``end`` says how the run ends: then its words and
    its code; Ctrl-C: ``detached`` and 2. The jobs go on where they run either way (both
    dashboards, one host or a fleet, follow with this)."""
    from rich.live import Live

    try:
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while True:
                now, answers = time.monotonic(), poller.latest()
                live.update(draw(answers, now))
                ending = end(answers, now)
                if ending is not None:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        console.print(f"\n[yellow]{detached}[/]")
        return 2
    finally:
        poller.close()
    console.print()
    for line in ending.lines:   # one line each, never wrapped: scripts read the last one
        console.print(line, style=ending.style, markup=False, highlight=False, soft_wrap=True)
    return ending.code


def watch(poller: Poller, host: str, run: str, *, interval: float = 2.0, once: bool = False,
          dead_after: float = DEAD_AFTER_S, console: Console | None = None) -> int:
    """Show the dashboard until the job ends: 0 when it holds every line, 1 naming those it does not
    (:func:`conclusion`); detach on Ctrl-C, or when the host has not answered for ``dead_after`` seconds (2)."""
    console = console or Console()
    reattach = f"fab status --host {host} --run {run}"
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(),
                        TimeRemainingColumn(), console=console)
    task = progress.add_task(run, total=None)
    name = poller.readers[0].name
    if once:
        a = poller.first()[name]
        poller.close()
        if not a.ok:
            console.print(f"{host}: unreachable ({a.value or 'no answer'})", style="red", markup=False)
            return 2
        console.print(render(a.value, host, progress, task))
        return 0
    seen: dict[str, Any] = {}

    def draw(answers: dict[str, Answer], now: float) -> Any:
        a = answers[name]
        if a.ok:
            seen["snap"] = a.value
        view: Any = render(seen["snap"], host, progress, task) if "snap" in seen else Text(f"reading {host} ...")
        down = a.down_for(now, poller.started)
        if down is None:
            return view
        return Group(view, Text(f"{host}: {silence(a.value, down)}; the job goes on there", style="red"))

    def end(answers: dict[str, Answer], now: float) -> Optional[Ending]:
        a = answers[name]
        down = a.down_for(now, poller.started)
        if down is not None and down >= dead_after:
            lost = "" if isinstance(a.value, StatusUnreadable) else "lost the connection to "
            return Ending(2, [f"{lost}{host}: {silence(a.value, down)}. The job goes on there; reattach with: "
                              f"{reattach}"], "yellow")
        return conclusion([(host, a.value)]) if a.ok and verdict.ended(a.value) else None

    return follow(poller, draw, end, console=console, interval=interval,
                  detached=f"detached; the job goes on on {host}. Reattach with: {reattach}")


def conclusion(ended: list[tuple[str, dict[str, Any]]]) -> Ending:
    """fab's last words on ended runs (label, snapshot): 0 when every line is held, else 1 naming each
    line that is not and why (:mod:`hs_patch.control.verdict`)."""
    problems = [f"{label}: {gap}" for label, snap in ended for gap in verdict.gaps(snap)]
    if problems:
        return Ending(1, problems + [verdict.summary([snap for _, snap in ended])])
    done = sum(((snap.get("driver") or {}).get("samples") or {}).get("done", 0) for _, snap in ended)
    shipped = all(f"hs-ship-{snap['run']}" in (snap.get("units") or {}) for _, snap in ended)
    if shipped:
        return Ending(0, [f"complete: every line is held ({done} samples, shipped and verified at the destination)"],
                      "green")
    where = ", ".join(f"{label}:{(snap.get('samples') or {}).get('path', '?')}" for label, snap in ended)
    return Ending(0, [f"complete: every line is held ({done} samples, not shipped: shipping is off), in {where}; "
                      "copy them off before a reboot where that is a tmpfs (/dev/shm: RAM)"], "green")
