"""Where a run's samples go, as fab tells the GPU host's shipper: the storage host over rsync
(``hs_storage_*``), or an S3-compatible bucket (``hs_s3_url`` and its ``hs_s3_*`` knobs).

For a bucket, the shipper gets the endpoint, region, addressing and concurrency on its command
line, and its credentials never: the sample_shipping role writes them from the vault to
``sample_shipping_s3_credentials_file`` on the GPU host (root's, mode 0600), and systemd hands
that file to the shipper's unit alone (``LoadCredential=s3:FILE``: the unit reads it at
``$CREDENTIALS_DIRECTORY/s3``, under its own user; never on a command line). So a
foreground ship (``fab ship``) and the preflight's check run as transient units too
(``systemd-run --wait --pipe``), not with sudo. With no credentials file there (keys left empty
in the role) the shipper uses boto3's own chain on the host (an instance role, say).
"""

from __future__ import annotations

from typing import Any

from hs_patch.control.inventory import Target
from hs_patch.control.shell import Shell, cmd

CREDENTIAL = "s3"  # the name the shipper looks for in $CREDENTIALS_DIRECTORY (hs_patch.host.shipping.bucket)


def destination(t: Target, run: str, part: str = "") -> str:
    """Where ``run``'s samples go: ``STORAGE:DIR/RUN`` or ``s3://BUCKET/PREFIX/RUN``, or ``.../RUN/PART`` for
    one host of a fleet run (``hs_patch.control.fleet``)."""
    base = f"{t.s3_url.rstrip('/')}/{run}" if t.s3_url else f"{t.storage_alias}:{t.storage_dir}/{run}"
    return base + (f"/{part}" if part else "")


def ship_options(t: Target) -> list[str]:
    """The shipper's options beside ``--dest`` (the bucket's endpoint and so on; nothing for rsync, whose
    SSH alias the role wrote)."""
    if not t.s3_url:
        return []
    out = ["--s3-addressing", t.s3_addressing, "--s3-concurrency", str(int(t.s3_concurrency))]
    if t.s3_endpoint:
        out += ["--s3-endpoint", t.s3_endpoint]
    if t.s3_region:
        out += ["--s3-region", t.s3_region]
    return out


def credential_properties(c: Shell, t: Target) -> list[str]:
    """systemd-run properties handing the bucket's credentials file to a shipper unit (if the role wrote one)."""
    if not t.s3_url or not c.run(["test", "-f", t.s3_credentials_file]).ok:
        return []
    return [f"--property=LoadCredential={CREDENTIAL}:{t.s3_credentials_file}"]


def run_shipper_unit(c: Shell, t: Target, unit: str, properties: list[str], argv: list[Any],
                     timeout: float | None = None) -> tuple[int, str]:
    """Run the shipper in the foreground as a transient unit of the service user, with the follow unit's
    sandbox and credentials; its exit code and output."""
    c.run(cmd("systemctl", "reset-failed", f"{unit}.service") + " 2>/dev/null")
    r = c.run(["systemd-run", f"--unit={unit}", "--wait", "--pipe", "--quiet", "--collect",
               f"--uid={t.service_user}", f"--gid={t.service_user}", "--property=KillMode=mixed",
               *properties, "--", *argv], timeout=timeout)
    return r.exited, (r.stdout + r.stderr).strip()


def preflight_bucket(c: Shell, t: Target, properties: list[str]) -> tuple[bool, str]:
    """Reach the bucket from the GPU host as the shipper would (its credentials, its sandbox), change nothing."""
    code, out = run_shipper_unit(c, t, "hs-ship-check", properties,
                                 [t.bin("hs-extract"), "ship", "--check", "--dest", t.s3_url, *ship_options(t)],
                                 timeout=120)
    last = out.strip().splitlines()[-1] if out.strip() else f"exit {code}"
    return code == 0, last.removeprefix("hs-ship: ")

