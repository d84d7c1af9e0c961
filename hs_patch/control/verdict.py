"""What a run holds when its jobs have ended, said in fab's last words (one host or a fleet).

A run is complete when every non-blank line of its input (a fleet host: of its shard) is held:
extracted, or a duplicate of a line that is (the same tokens, sent once), and with shipping
on, every sample shipped and verified at the destination. Anything less ends ``fab
extract``/``fab status`` non-zero, naming the lines missing and why from the driver's own
account (``status.json["missing"]``, :mod:`hs_patch.host.driver.missing`): rejected lines,
failed samples (and whether running again can extract them), lines not attempted because the
driver stopped, and samples not at the destination.
"""

from __future__ import annotations

from typing import Any

FINISHED = ("inactive", "failed")


def _unit(snap: dict[str, Any], unit: str) -> dict[str, str]:
    return (snap.get("units") or {}).get(unit) or {}


def ended(snap: dict[str, Any]) -> bool:
    """The driver's unit has ended and, unless the driver stopped short (its shipper then waits for
    a resume, following), the shipper's unit too."""
    run = snap["run"]
    drive, ship = _unit(snap, f"hs-drive-{run}"), _unit(snap, f"hs-ship-{run}")
    if drive.get("ActiveState") not in FINISHED:
        return False
    return (snap.get("driver") or {}).get("state") != "finished" or not ship or ship.get("ActiveState") in FINISHED


def gaps(snap: dict[str, Any]) -> list[str]:
    """Why an ended run does not hold every line, a reason a line; [] when it holds them all."""
    run = snap["run"]
    d = snap.get("driver") or {}
    s = d.get("samples") or {}
    out = []
    if d.get("state") != "finished":
        code = _unit(snap, f"hs-drive-{run}").get("ExecMainStatus")
        out.append(f"the driver {d.get('state') or 'ended without a status'}"
                   f"{f' (exit {code})' if code not in (None, '', '0') else ''}: {d.get('message') or '-'}")
    m = missing(snap)
    for e in m.get("shown") or []:
        out.append(f"{e['sample_id']} {e['why']}" + ("" if e.get("retry", True) else
                                                     "; it can never be extracted as it is"))
    more = m["rejected"] + m["failed"] - len(m.get("shown") or [])
    if more > 0:
        out.append(f"{more} more line(s) rejected or failed: missing.jsonl in the run's state dir names each")
    if m["not_attempted"]:
        out.append(f"{m['not_attempted']} line(s) not attempted: the driver stopped before them")
    ship = _unit(snap, f"hs-ship-{run}")
    sh = snap.get("shipper") or {}
    pending = (sh.get("pending") or {}).get("count", 0)
    # the samples dir itself, not only the shipper's count: a shipper that ended on an earlier driver's end marker
    # counted nothing pending while this driver's samples were still there
    left = snap.get("samples_left") or 0
    if ship and d.get("state") == "finished" and (pending or left or ship.get("ExecMainStatus") not in (None, "", "0")):
        out.append(f"{max(pending, left)} extracted sample(s) not at the destination (shipper "
                   f"{ship.get('ActiveState')}, exit {ship.get('ExecMainStatus') or '?'}"
                   f"{': ' + str(sh['last_error']) if sh.get('last_error') else ''}); fab ship sends them")
    return out


def missing(snap: dict[str, Any]) -> dict[str, Any]:
    """The driver's account of the lines it does not hold (from its counts for a driver older than that)."""
    d = snap.get("driver") or {}
    s = d.get("samples") or {}
    if d.get("missing"):
        return d["missing"]
    rejected, failed, left = s.get("rejected", 0), s.get("failed", 0), s.get("remaining", 0)
    return {"lines": rejected + failed + left, "rejected": rejected, "failed": failed, "not_attempted": left,
            "never": rejected, "shown": []}


def summary(snaps: list[dict[str, Any]]) -> str:
    """fab's last line for ended runs (one host's, or a fleet's rows) that do not hold every line."""
    lines = sum(((s.get("driver") or {}).get("samples") or {}).get("total", 0) for s in snaps)
    ms = [missing(s) for s in snaps]
    count = {k: sum(m[k] for m in ms) for k in ("lines", "rejected", "failed", "not_attempted", "never")}
    unshipped = sum(((s.get("shipper") or {}).get("pending") or {}).get("count", 0) for s in snaps
                    if (s.get("driver") or {}).get("state") == "finished")
    parts = [f"{count[k]} {w}" for k, w in (("rejected", "rejected"), ("failed", "failed"),
                                             ("not_attempted", "not attempted")) if count[k]]
    held = f"{count['lines']} of {lines} line(s) not held ({', '.join(parts)})" if count["lines"] else ""
    if unshipped:
        held += ("; " if held else "") + f"{unshipped} extracted sample(s) not at the destination"
    stopped = any((s.get("driver") or {}).get("state") != "finished" for s in snaps)
    if count["never"] and count["never"] == count["lines"] and not unshipped and not stopped:
        todo = "running it again will not extract them: change those lines (missing.jsonl says why)"
    else:
        todo = (f"{count['never']} can never be extracted as they are; " if count["never"] else "") + \
            "run the same fab extract again for the rest"
    return f"incomplete: {held or 'the driver did not finish'}; {todo}"
