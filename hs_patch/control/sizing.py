"""What a run will store, estimated before it starts: fab's space checks (``host_checks.preflight``) take it.

The estimate is the dataset's bytes at ~4 bytes of JSON a token, times the bytes a token's states
take (the captured planes x the model's hidden size x 2, + 9 for the id and the loss mask), for what
the run still has to make and ship: its share of a fleet's dataset, its ``--limit`` lines, less what
an earlier start of the same run shipped (the run's ``status.json`` on the host).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hs_patch.control.inventory import Target
from hs_patch.control.shell import RemoteError, Shell, cmd


def still_to_ship(c: Shell, t: Target, *, dataset: str, remote_dataset: bool, share: int, driver_args: list[str],
                  run: str) -> tuple[int, int]:
    """(bytes the run still stores and ships, bytes a token): the dataset's share, its ``--limit`` lines of it,
    less what an earlier start of the same run has shipped."""
    size = remote_size(c, dataset) if remote_dataset else Path(dataset).stat().st_size
    estimated, per_token = estimate_bytes(c, t, size // max(1, share))
    limit = limit_of(driver_args)
    if limit:
        lines = remote_lines(c, dataset) if remote_dataset else count_lines(Path(dataset))
        estimated = estimated * min(limit, lines) // max(1, lines)
    status = run_status(c, t, run)
    total, shipped = (status.get("samples") or {}).get("total"), (status.get("shipping") or {}).get("shipped")
    if isinstance(total, int) and isinstance(shipped, int) and total > 0:  # a resumed run
        estimated = estimated * max(0, total - shipped) // total
    return estimated, per_token


def estimate_bytes(c: Shell, t: Target, dataset_bytes: int) -> tuple[int, int]:
    """(stored bytes for a dataset, bytes per token): ~4 bytes of JSON per token, planes x
    hidden x 2 (+ 9 for the id and the loss mask) per token."""
    r = c.run(["cat", f"{t.model_path}/config.json"])
    try:
        cfg = json.loads(r.stdout) if r.ok else {}
    except ValueError:
        cfg = {}
    hidden = int((cfg.get("text_config") or cfg).get("hidden_size", 7168))
    planes = len(t.capture_layers) + {"pre": 1, "post": 1, "both": 2}.get(t.capture_final, 0)
    per_token = planes * hidden * 2 + 9
    return dataset_bytes // 4 * per_token, per_token


def limit_of(driver_args: list[str]) -> int:
    """The driver's ``--limit`` among its arguments (0: every line)."""
    return next((int(driver_args[i + 1]) for i, a in enumerate(driver_args[:-1]) if a == "--limit"), 0)


def count_lines(path: Path) -> int:
    """Lines of a local file (a last one without a newline counted), read in blocks."""
    n, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(8 << 20):
            n, last = n + block.count(b"\n"), block[-1:]
    return n + (last != b"\n")


def remote_size(c: Shell, path: str) -> int:
    """Bytes of a file on the host (a --remote-dataset)."""
    r = c.run(["stat", "-c", "%s", "--", path])
    if not r.ok or not r.stdout.strip().isdigit():
        raise RemoteError(f"on {c.host}: no dataset file {path}: {(r.stderr or r.stdout).strip()[-300:]}")
    return int(r.stdout)


def remote_lines(c: Shell, path: str) -> int:
    """Lines of a file on the host (a --remote-dataset with --limit)."""
    r = c.run(cmd("wc", "-l", "--", path))
    if not r.ok or not r.stdout.split()[:1] or not r.stdout.split()[0].isdigit():
        raise RemoteError(f"on {c.host}: could not count the lines of {path}: {(r.stderr or r.stdout).strip()[-300:]}")
    return int(r.stdout.split()[0])


def run_status(c: Shell, t: Target, run: str) -> dict[str, Any]:
    """The run's status.json on the host ({} for a run not started there yet)."""
    r = c.run(["cat", f"{t.state_dir(run)}/status.json"])
    try:
        status = json.loads(r.stdout) if r.ok and r.stdout.strip() else {}
    except ValueError:
        return {}
    return status if isinstance(status, dict) else {}
