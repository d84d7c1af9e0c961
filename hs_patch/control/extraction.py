"""One host's part of ``fab extract``: its preflight and its start, for a single host or a fleet.

A :class:`Job` says what one GPU host runs: the local run name (its state dir and units),
the dataset, the driver's extra arguments (``--shard``, ``--limit`` ...) and where its
shipper sends. ``fab extract --host`` runs one; ``fab extract --hosts GROUP`` runs one per
host through :class:`hs_patch.control.fleet.FleetGroup` (preflight on every host first,
then the starts, all in parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hs_patch.control import host_checks, remote, sizing
from hs_patch.control.inventory import Target
from hs_patch.control.host_checks import Check
from hs_patch.control.shell import RemoteError, Shell


@dataclass
class Job:
    run: str                               # the run's name on the host (state dir, samples dir, units)
    dataset: str                           # a file here, or on the host with remote_dataset
    remote_dataset: bool = False
    driver_args: list[str] = field(default_factory=list)   # --limit, --regenerate, --shard ...
    max_tokens: int = remote.MAX_SAMPLE_TOKENS              # the driver's --max-tokens; the KV cache must hold it
    dest: str | None = None                # the shipper's destination (default remote.destination(t, run))
    share: int = 1                         # hosts sharing the dataset (scales the space estimate)
    sync_first: bool = False               # list what the destination holds before the driver starts

    def describe(self) -> str:
        shard = next((self.driver_args[i + 1] for i, a in enumerate(self.driver_args[:-1]) if a == "--shard"), "")
        return f"run {self.run}" + (f", shard {shard}" if shard else "")


def preflight(c: Shell, t: Target, job: Job) -> list[Check]:
    """host_checks.preflight for what the job still has to extract and ship (:func:`sizing.still_to_ship`)."""
    estimated, per_token = sizing.still_to_ship(c, t, dataset=job.dataset, remote_dataset=job.remote_dataset,
                                                share=job.share, driver_args=job.driver_args, run=job.run)
    return host_checks.preflight(c, t, estimated_bytes=estimated, bytes_per_token=per_token, max_tokens=job.max_tokens)


def report(host: str, checks: list[Check]) -> str:
    """The preflight as the operator reads it: one line a check, the fix under a failure."""
    return "\n".join(f"  {host:12} {'ok  ' if ch.ok else 'FAIL'} {ch.name:14} {ch.detail}"
                     + ("" if ch.ok else f"\n{'':19}-> {ch.fix}") for ch in checks)


def start(c: Shell, t: Target, job: Job, server_timeout: int, progress: Callable[[str], None]) -> list[str]:
    """Prepare the run's dirs, copy the dataset, start the server and wait for it, start the
    driver and shipper units. Returns the units started (running ones are left alone)."""
    remote.prepare(c, t, job.run)
    data = job.dataset if job.remote_dataset else remote.upload(c, t, job.run, Path(job.dataset))
    remote.start_server(c, t, server_timeout, progress)
    remote.check_kv_cache(c, t, job.max_tokens)  # before the driver: a KV cache smaller than a sample is a refusal
    args = ["--data", data, "--model", t.model_path, "--host-name", t.name or t.host,
            "--max-tokens", str(job.max_tokens), *job.driver_args]
    if t.trust_remote_code:
        args.append("--trust-remote-code")
    if job.sync_first and t.ship_enabled:
        # before the driver reads what is done: every sample the destination already holds is
        # recorded in the run's shipped.jsonl, so none of them is extracted or sent again
        code, out = remote.ship_now(c, t, job.run, dest=job.dest)
        if code:
            raise RemoteError(f"on {t.host}: listing the destination {job.dest} failed (exit {code}): {out[-600:]}; "
                              "fix storage (fab ship shows the same), then run the same fab extract again")
    return remote.start_jobs(c, t, job.run, args, dest=job.dest)


def drain(c: Shell, t: Target, run: str, *, dest: str | None = None) -> tuple[int, str]:
    """``fab ship``: :func:`remote.ship_now` (which stops the follow shipper first), then, if the run's driver is
    still running, its follow shipper started again (without it the samples piled up until the driver paused)."""
    code, out = remote.ship_now(c, t, run, dest=dest)
    drive, ship = remote.units(run)
    if t.ship_enabled and remote.unit_state(c, drive) in remote.RUNNING:
        remote.start_jobs(c, t, run, [], dest=dest, ship_only=True)
        out += f"\n{ship} started again: {drive} is still running, and the shipper follows it"
    return code, out


def driver_args(limit: int, regenerate: bool, shard: str = "", accept_changed_data: bool = False) -> list[str]:
    args = ["--limit", str(int(limit))] if int(limit) else []
    if regenerate:
        args.append("--regenerate")
    if accept_changed_data:  # the driver's refusals of a changed dataset (hs_patch/host/driver/reconcile.py)
        args.append("--accept-changed-data")
    if shard:  # a fleet's job: queued while another of the host's runs holds its capture dir (a reassigned shard)
        args += ["--shard", shard, "--queue"]
    return args
