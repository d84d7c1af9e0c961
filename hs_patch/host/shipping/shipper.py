"""The shipper: move completed samples to training storage, verified, resumable.

Run as ``hs-extract ship ...`` (``--help`` says everything an operator
needs). Library use: :func:`ship` with a :class:`ShipConfig`, or :func:`add_arguments` +
:func:`run_args` to mount it under another CLI.

For each batch of samples listed (``op: add``) in the samples directory's manifest and
not yet shipped: rsync them into the destination's ``.incoming/``, compute their sha256
on the destination and move the matching ones into ``samples/`` and the destination's
manifest (:mod:`hs_patch.host.shipping.link`, :mod:`hs_patch.host.shipping.at_destination`); then record each one
in ``<state-dir>/shipped.jsonl``, delete the local file and append ``op: remove`` with
``reason: shipped`` to the local manifest. Each step is safe to cut: a restart re-sends
what the destination lacks and re-verifies what it holds.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from hs_patch.host.shipping import bucket
from hs_patch.host.shipping.link import ConfigError, Link, LinkError, SshOptions, parse_dest
from hs_patch.host.shipping.batches import (DONE_MARKER, EXIT_ERROR, EXIT_OK, EXIT_UNVERIFIED, EXIT_USAGE, SHIPPED_LOG,
                                STATUS_FILE, ShipConfig, Shipper)
from hs_patch.samples import store

__all__ = ["ship", "ShipConfig", "main", "add_arguments", "run_args", "SHIPPED_LOG", "STATUS_FILE",
           "DONE_MARKER", "LOCK_FILE", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_UNVERIFIED"]

LOCK_FILE = "shipper.lock"


def ship(cfg: ShipConfig) -> int:
    """Ship until done (see the module doc and ``--help``); returns the exit code."""
    check_config(cfg)
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    with open(cfg.state_dir / LOCK_FILE, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # exit 1, not 2: a busy lock is no bad configuration, and the follow unit (Restart=on-failure,
            # RestartPreventExitStatus=2 3) must come back once a manual shipper is done, not stay down
            raise LinkError(f"another shipper holds {cfg.state_dir / LOCK_FILE}: one shipper per "
                            "state directory; stop it first (or wait for it)") from None
        shipper = Shipper(cfg)
        previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

        def on_signal(signum: int, frame: Any) -> None:
            if shipper.stop_requested:
                raise KeyboardInterrupt  # a second signal: stop now, mid-batch
            shipper.stop_requested = True
            print(f"hs-ship: {signal.Signals(signum).name}: finishing the current batch, then exiting "
                  "(send it again to stop at once)", file=sys.stderr)

        for s in previous:
            signal.signal(s, on_signal)
        state = "failed"
        try:
            shipper.write_status("starting")
            link = open_link(cfg)  # opened (and reopened) by the shipper
            try:
                code = shipper.run(link)
            finally:
                link.__exit__(None, None, None)
            state = "stopped" if shipper.stop_requested else {EXIT_OK: "done"}.get(code, "failed")
            return code
        except KeyboardInterrupt:
            state = "interrupted"
            raise
        except Exception as e:
            shipper.last_error = str(e)
            raise
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            shipper.write_status(state)


def open_link(cfg: ShipConfig) -> Any:
    """The link to the destination: rsync over SSH (or to a local directory), or an S3 bucket."""
    if isinstance(cfg.dest, bucket.BucketDest):
        from hs_patch.host.shipping.bucket_link import BucketLink
        return BucketLink(cfg.dest, cfg.s3 or bucket.S3Options(), cfg.state_dir)
    return Link(cfg.dest, cfg.ssh, bwlimit_kbps=cfg.bwlimit_kbps)


def check_config(cfg: ShipConfig) -> None:
    """Raise ConfigError saying what to fix."""
    if isinstance(cfg.dest, bucket.BucketDest):
        if cfg.ssh.key or cfg.ssh.port or cfg.ssh.known_hosts or cfg.ssh.options or cfg.bwlimit_kbps:
            raise ConfigError(f"--dest {cfg.dest} is an S3 bucket: the SSH options and --bwlimit mean nothing there "
                              "(--s3-concurrency sets how much is in flight)")
        (cfg.s3 or bucket.S3Options()).check()
    elif cfg.s3 is not None:
        raise ConfigError(f"--dest {cfg.dest} is not an s3:// URL, so the --s3-* options mean nothing")
    if cfg.follow and not cfg.samples_dir.exists():  # the driver, started alongside, has not made it yet
        cfg.samples_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.samples_dir.is_dir():
        raise ConfigError(f"--samples-dir {cfg.samples_dir} is not a directory (the driver's samples "
                          "directory, e.g. /dev/shm/hs-runs/RUN/samples)")
    if cfg.ssh.key and not os.access(cfg.ssh.key, os.R_OK):
        raise ConfigError(f"--ssh-key {cfg.ssh.key} is not a readable file")
    if cfg.ssh.known_hosts and not os.path.isfile(cfg.ssh.known_hosts):
        raise ConfigError(f"--known-hosts {cfg.ssh.known_hosts} does not exist (get the storage host's key "
                          "with ssh-keyscan, check its fingerprint, and save it there)")
    if not cfg.dest.host and (cfg.ssh.key or cfg.ssh.port or cfg.ssh.known_hosts or cfg.ssh.options):
        raise ConfigError(f"--dest {cfg.dest} is a local directory, so the SSH options mean nothing; "
                          "give --dest [user@]host:path")
    check_not_overlapping(cfg)
    for name in ("batch_files", "batch_bytes", "retries"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if cfg.until_file and not cfg.follow:
        raise ConfigError("--until-file only means something with --follow")
    # written so that nan fails too (it compares false both ways: --poll nan was a busy loop)
    if not all(0 < x < math.inf for x in (cfg.poll_seconds, cfg.backoff_max, cfg.refused_retry)) \
            or cfg.bwlimit_kbps < 0:
        raise ConfigError("--poll, --backoff-max and --refused-retry must be finite numbers > 0 and --bwlimit >= 0")


LOOPBACK = {"localhost", "127.0.0.1", "::1", "[::1]"}


def check_not_overlapping(cfg: ShipConfig) -> None:
    """A destination on this host that holds the samples directory, or lies in it, is refused: its
    DEST/samples/ may be the samples directory itself (then the verified "copy" is the local file the
    shipper deletes next) and DEST/manifest.jsonl the local manifest (rewritten by the verify step)."""
    if isinstance(cfg.dest, bucket.BucketDest):
        return
    host = (cfg.dest.host or "").rpartition("@")[2].lower()
    if cfg.dest.host and not (host in LOOPBACK or host.startswith("127.")):
        return
    dest, samples = Path(cfg.dest.path).expanduser().resolve(), cfg.samples_dir.resolve()
    if dest == samples or dest in samples.parents or samples in dest.parents:
        raise ConfigError(f"--dest {cfg.dest} and --samples-dir {cfg.samples_dir} overlap ({dest} and {samples}): "
                          "the destination keeps its samples in DEST/samples/ and its own DEST/manifest.jsonl, so "
                          "shipping there would delete the only copy; give a directory of its own (training storage)")


# ---------------------------------------------------------------------------- CLI

DESCRIPTION = """\
Ship completed hidden-state samples to training storage, verified, then delete them here.

Reads   SAMPLES_DIR/manifest.jsonl and the *.safetensors files it lists (op: add) -
        nothing else: never an unlisted file, never .tmp/.
Sends   with rsync over ssh (one multiplexed connection) into DEST/.incoming/, then
        computes each file's sha256 ON THE DESTINATION (python3 there, nothing of ours
        installed) and moves the files that match the manifest into DEST/samples/;
        DEST/manifest.jsonl is rewritten atomically with one op: add line per sample
        (file: samples/<key>.safetensors, bytes, sha256). A file that does not match is
        sent again, --retries times at most; its local copy is never deleted.
Records every verified file in STATE_DIR/shipped.jsonl
        ({"op": "shipped", "key", "file", "bytes", "sha256", "t"}), then deletes the local
        file and appends op: remove, reason: shipped, to SAMPLES_DIR/manifest.jsonl.
Status  STATE_DIR/shipper_status.json (shipped, pending, throughput, failed, last error,
        outage: since when the destination is unreachable, failures, next try).
Outages of the destination, of any length, are waited out (capped exponential backoff,
        --backoff-max); nothing is deleted meanwhile and shipping resumes by itself.
Refused  host key, authentication, unknown host, the storage host's gate or verify step
        refusing: waiting cannot cure these. Without --follow: exit 1. With --follow: tried
        again every --refused-retry seconds (status state refused_by_destination, outage.refused),
        so a fix there is picked up by itself; nothing is deleted meanwhile.
Start   checks what the destination holds against DEST/manifest.jsonl: each file's size and
        mtime as recorded when it was verified (cheap: a stat each), or with --verify-deep
        its digest computed again there. A file that fails is moved to DEST/.damaged/ and
        dropped from the manifest; if it was shipped from here (its local copy deleted) it
        is recorded lost in shipped.jsonl, the run's next start extracts it again, and this
        run exits 3 naming it. Then the samples listed there count as shipped (recorded in
        shipped.jsonl with their sample ids), so a host whose /dev/shm was emptied by a
        reboot neither redoes nor replaces them; a redo that reaches the destination with
        other bytes is dropped, the destination's verified copy is kept.

Without --follow it ships what the manifest lists and exits. With --follow it polls the
manifest every --poll seconds until the driver's marker (--until-file, default
STATE_DIR/driver.done) exists and everything listed is shipped, or until SIGTERM/SIGINT:
it then finishes the current batch and exits (a second signal stops at once).
"""

EPILOG = """\
resume:
  Run the same command again, after any interruption (kill -9, reboot, lost link): files the
  destination already holds are verified there and not re-sent, partial transfers resume
  from DEST/.incoming/.rsync-partial/, nothing is shipped twice or deleted unverified.
  Every start checks what the destination holds (size and mtime of each file; a flipped bit
  that left both alone only --verify-deep finds, at the cost of reading everything there).

ssh:
  StrictHostKeyChecking=yes and BatchMode=yes by default: the storage host's key must be in
  known_hosts (yours, or --known-hosts). ~/.ssh/config applies (an alias as host works);
  --ssh-option values take precedence over the defaults, except that options skipping the
  host key check are refused unless --allow-unverified-host-key (never in production: a
  changed host key then ships samples to whoever answers). Under systemd use KillMode=mixed
  so that SIGTERM reaches the shipper alone and the batch can finish.

exit codes:
  0  everything listed is shipped and verified (or stopped by a signal after its batch)
  1  error that waiting cannot cure (host key, authentication, unknown host, a refusal by
     the storage host's forced command, a listed file gone), or another shipper holds
     STATE_DIR/shipper.lock: fix and run again (an unreachable destination is waited for, not an error)
  2  bad arguments or configuration: the message says what to fix
  3  some files still fail verification after --retries transfers: they are kept here
     and named in the status file; run again to retry them. Or the start's check found
     samples shipped earlier damaged or missing at the destination: named in the status
     file (damaged), recorded lost; the run's next start extracts them again

example:
  hs-extract ship --follow --samples-dir /dev/shm/hs-runs/RUN/samples \\
      --state-dir /var/lib/hs-patch/runs/RUN --dest hs-storage:/srv/hs-samples/RUN
"""


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if text[-1:].upper() in units:
            return int(float(text[:-1]) * units[text[-1].upper()])
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes, or a number with K, M or G") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``ship`` options (for mounting under another CLI with :func:`run_args`)."""
    p.add_argument("--samples-dir", type=Path, metavar="DIR",
                   help="the driver's samples directory (*.safetensors + manifest.jsonl); required but with --check")
    p.add_argument("--state-dir", type=Path, metavar="DIR",
                   help="where shipped.jsonl, shipper_status.json and the lock live (created); required but with "
                   "--check")
    p.add_argument("--check", action="store_true",
                   help="only reach the destination (SSH and the verify step there, or the bucket with these "
                   "credentials) and say how many samples its manifest lists; change nothing (exit 0 or 1)")
    p.add_argument("--dest", "--to", required=True, metavar="[USER@]HOST:PATH|s3://BUCKET/PREFIX",
                   help="training storage: a host over SSH (an alias works; a local directory for tests), or an "
                   "S3-compatible bucket and prefix")
    p.add_argument("--follow", action="store_true", help="keep shipping new samples until the driver is done")
    p.add_argument("--until-file", type=Path, metavar="PATH",
                   help=f"with --follow: stop once this exists and all is shipped (default STATE_DIR/{DONE_MARKER})")
    p.add_argument("--poll", type=float, default=2.0, metavar="SECONDS",
                   help="with --follow: how often to re-read the manifest when idle (default 2)")
    p.add_argument("--batch-files", type=int, default=200, metavar="N", help="most files per rsync (default 200)")
    p.add_argument("--batch-bytes", type=_size, default=512 << 20, metavar="SIZE",
                   help="most bytes per rsync, e.g. 1G (default 512M)")
    p.add_argument("--retries", type=int, default=3, metavar="N",
                   help="transfers of a file that fails verification before giving up on it (default 3)")
    p.add_argument("--bwlimit", type=int, default=0, metavar="KBPS", help="rsync bandwidth limit, KiB/s (0: none)")
    p.add_argument("--verify-deep", action="store_true",
                   help="at start, compute the digest of every sample the destination holds again (reads all of "
                   "them there); without it each is checked by size and mtime (rsync) or size and ETag (s3)")
    p.add_argument("--backoff-max", type=float, default=60.0, metavar="SECONDS",
                   help="longest wait between two tries of an unreachable destination (default 60)")
    p.add_argument("--refused-retry", type=float, default=300.0, metavar="SECONDS",
                   help="with --follow, how long to wait before trying again a destination that refuses in a way "
                   "waiting cannot cure (host key, authentication, the storage host's gate); without --follow "
                   "such a refusal exits 1 (default 300)")
    s3 = p.add_argument_group("s3:// destinations")
    s3.add_argument("--s3-endpoint", metavar="URL", help="the store's endpoint, e.g. https://s3.example.com:9000 "
                    "(default: boto3's: AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, else AWS S3)")
    s3.add_argument("--s3-region", metavar="NAME", help="region (default: AWS_REGION, ~/.aws/config, else us-east-1)")
    s3.add_argument("--s3-addressing", choices=bucket.ADDRESSING, default="auto",
                    help="path: https://HOST/BUCKET/KEY; virtual: https://BUCKET.HOST/KEY (default auto: boto3's "
                    "choice, virtual where the bucket name allows it)")
    s3.add_argument("--s3-credentials", metavar="FILE",
                    help="an AWS shared-credentials file ([default] aws_access_key_id, aws_secret_access_key); "
                    f"default $CREDENTIALS_DIRECTORY/{bucket.CREDENTIALS_NAME} (systemd's LoadCredential=, how fab starts "
                    "the shipper), else boto3's chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, ~/.aws, an instance "
                    "role). Never printed")
    s3.add_argument("--s3-ca-bundle", metavar="FILE", help="CA certificates for an endpoint with a private CA")
    s3.add_argument("--s3-concurrency", type=int, default=8, metavar="N",
                    help="parts and objects in flight at once, each up to 64 MiB in memory here (default 8)")
    p.add_argument("--ssh-key", metavar="FILE", help="identity file (default: ssh's, or ~/.ssh/config)")
    p.add_argument("--ssh-port", type=int, metavar="PORT", help="SSH port (default 22 or ~/.ssh/config)")
    p.add_argument("--known-hosts", metavar="FILE", help="known_hosts file holding the storage host's key")
    p.add_argument("--ssh-option", action="append", default=[], metavar="NAME=VALUE",
                   help="extra ssh -o option, repeatable (e.g. Ciphers=aes128-gcm@openssh.com); options that "
                   "skip the host key check (StrictHostKeyChecking=no/off/accept-new, UserKnownHostsFile=/dev/null, "
                   "KnownHostsCommand, ...) are refused")
    p.add_argument("--allow-unverified-host-key", action="store_true",
                   help="DANGER: accept those options, i.e. ship to a storage host whose SSH key nobody checked "
                   "(samples of a proprietary model may go to whoever answers at that address); test setups only")


def check_only(cfg: ShipConfig) -> int:
    """``--check``: reach the destination and count what its manifest lists; nothing changes there or here."""
    if isinstance(cfg.dest, bucket.BucketDest):
        b = bucket.Bucket(cfg.dest, cfg.s3 or bucket.S3Options())
        b.check_bucket()
        held = len(b.read_manifest()[0])
    else:
        with Link(cfg.dest, cfg.ssh) as link:
            held = len(link.start_commit([], list_entries=True).wait(answer="entries"))
    print(f"hs-ship: {cfg.dest}: reachable, {held} samples listed in its manifest")
    return EXIT_OK


def run_args(args: argparse.Namespace) -> int:
    if not args.check and not (args.samples_dir and args.state_dir):
        print("hs-ship: give --samples-dir and --state-dir (only --check goes without them)", file=sys.stderr)
        return EXIT_USAGE
    try:
        is_s3 = args.dest.startswith(bucket.SCHEME)
        s3 = bucket.S3Options(endpoint=args.s3_endpoint, region=args.s3_region, addressing=args.s3_addressing,
                              credentials=args.s3_credentials or (bucket.default_credentials() if is_s3 else None),
                              concurrency=args.s3_concurrency, ca_bundle=args.s3_ca_bundle)
        cfg = ShipConfig(
            samples_dir=args.samples_dir, state_dir=args.state_dir,
            dest=bucket.parse_url(args.dest) if is_s3 else parse_dest(args.dest),
            s3=s3 if is_s3 or s3 != bucket.S3Options() else None,
            ssh=SshOptions(args.ssh_key, args.ssh_port, args.known_hosts, args.ssh_option,
                           allow_unverified_host_key=args.allow_unverified_host_key),
            follow=args.follow, until_file=args.until_file, poll_seconds=args.poll,
            batch_files=args.batch_files, batch_bytes=args.batch_bytes, retries=args.retries,
            bwlimit_kbps=args.bwlimit, backoff_max=args.backoff_max, verify_deep=args.verify_deep,
            refused_retry=args.refused_retry)
        if args.check:
            if cfg.s3 is not None:
                cfg.s3.check()
            return check_only(cfg)
        code = ship(cfg)
    except ConfigError as e:
        print(f"hs-ship: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (LinkError, OSError, store.SampleError) as e:
        print(f"hs-ship: {e}" + ("" if args.check else "\nhs-ship: nothing unverified was deleted; fix the cause "
                                 "and run the same command again to resume"), file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("hs-ship: stopped mid-batch; run the same command again to resume", file=sys.stderr)
        return EXIT_ERROR
    status = f"{cfg.state_dir / STATUS_FILE}"
    try:
        st = json.loads((cfg.state_dir / STATUS_FILE).read_text())
    except (OSError, ValueError):
        st = {}
    left = (st.get("pending") or {}).get("count") or 0
    if code == EXIT_OK and st.get("state") == "stopped" and left:
        print(f"hs-ship: stopped by a signal with {left} samples still to ship (kept here); run the same "
              "command again to ship them", file=sys.stderr)
        return code
    lost = [d["file"] for d in st.get("damaged") or [] if d.get("lost")]
    checked = st.get("checked") or {}
    messages = {EXIT_OK: "done", EXIT_UNVERIFIED: f"some files failed verification and are kept; see {status}",
                EXIT_ERROR: f"see {status}"}
    if lost:
        messages[EXIT_UNVERIFIED] = (f"{len(lost)} samples shipped earlier are damaged or missing at the destination "
                                     f"({', '.join(lost[:3])}{', ...' if len(lost) > 3 else ''}): dropped from its "
                                     "manifest and recorded lost; the run's next start (the same fab extract) "
                                     f"extracts them again; see {status}"
                                     + ("" if not st.get("failed") else "; and some files failed verification"))
    if code == EXIT_OK and checked:
        how = "digest computed again" if checked.get("deep") else "size and mtime/ETag as verified; --verify-deep " \
            "computes each digest again"
        messages[EXIT_OK] = f"done ({checked.get('files', 0)} files at the destination checked: {how})"
    print(f"hs-ship: {messages[code]}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    os.umask(0o077)  # as hs-extract: owner-only files
    parser = argparse.ArgumentParser(prog="hs-extract",
                                     description="Ship hidden-state samples to training storage.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("ship", help="ship samples (verified at the destination), then delete them here",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
