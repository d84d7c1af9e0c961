"""``hs-extract fetch s3://BUCKET/PREFIX/RUN DIR``: a run shipped to a bucket, onto local disk, verified.

Trainers read local files: this brings a shipped run to a directory with the layout an rsync
destination has (``manifest.jsonl`` and ``samples/``, or one such part a host for a fleet run,
``RUN/HOST/``), so ``hs-patch inspect DIR`` and ``hs-extract export DIR ...`` read it as they read
any shipped run. Each object is streamed into a temporary file while its digest is computed (the
manifest's kind: ``sha256r64m:`` or plain sha256), fsynced, and renamed into place only if size and
digest match its manifest line; each part's manifest is written last. Run it again after any
interruption: files already here with their line's size and digest are kept, the rest fetched.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hs_patch.host.shipping import at_destination, bucket
from hs_patch.host.shipping.link import ConfigError, LinkError
from hs_patch.samples.files import file_digest, private_dirs, write_all, write_atomic

DESCRIPTION = __doc__.split("\n\n", 1)[1]


class Writer:
    """A file-like sink for :func:`bucket.digest_stream`'s reads: every chunk written, checked."""

    def __init__(self, body: Any, fd: int):
        self.body, self.fd = body, fd

    def read(self, n: int) -> bytes:
        chunk = self.body.read(n)
        if chunk:
            write_all(self.fd, chunk)
        return chunk


def parts(b: bucket.Bucket) -> list[tuple[str, bucket.Bucket, dict[str, dict[str, Any]]]]:
    """(name, its bucket view, manifest entries) of the run: itself, or each host's part of a fleet run."""
    entries, _ = b.read_manifest()
    if entries:
        return [("", b, entries)]
    out = []
    page = b.call("listing the run", b.s3.list_objects_v2, Bucket=b.dest.bucket, Prefix=b.dest.key(""), Delimiter="/")
    for common in page.get("CommonPrefixes") or []:
        part = b.under(common["Prefix"].rstrip("/").rsplit("/", 1)[-1])
        got, _ = part.read_manifest()
        if got:
            out.append((part.dest.prefix.rsplit("/", 1)[-1], part, got))
    return out


def fetch_one(b: bucket.Bucket, root: Path, e: dict[str, Any]) -> str | None:
    """Bring one sample here, verified; None if it is here, else why not."""
    rel = str(e.get("file") or "")
    if not rel.startswith(f"{bucket.SAMPLES}/") or "/" in rel[len(bucket.SAMPLES) + 1:] or ".." in rel:
        return f"{rel!r}: not a sample file of the run"
    path = root / rel
    want = (e.get("bytes"), e.get("sha256"))
    if path.is_file() and path.stat().st_size == want[0] and file_digest(path, want[1]) == want:
        return None
    key = b.dest.key(rel)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        r = b.call(f"GET {key}", b.s3.get_object, Bucket=b.dest.bucket, Key=key)
        got = bucket.digest_stream(Writer(r["Body"], fd), want[1])
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    if got != want:
        tmp.unlink()
        return f"{key}: size/digest {got[0]}/{got[1][:20]}... differ from its manifest line: damaged at the store"
    os.replace(tmp, path)
    return None


def fetch(b: bucket.Bucket, dest: Path, workers: int) -> int:
    found = parts(b)
    if not found:
        print(f"hs-fetch: {b.dest}: no manifest.jsonl there nor in any part below it: not a shipped run",
              file=sys.stderr)
        return 1
    failed, done, t0 = [], 0, time.monotonic()
    for prefix, part, entries in found:
        root = dest / prefix if prefix else dest
        private_dirs(root / bucket.SAMPLES)
        with ThreadPoolExecutor(workers) as pool:
            whys = list(pool.map(lambda e: fetch_one(part, root, e), entries.values()))
        failed += [w for w in whys if w]
        done += len(whys)
        good = {k: e for (k, e), w in zip(entries.items(), whys) if not w}
        write_atomic(root / at_destination.MANIFEST, at_destination.manifest_bytes(good))  # last, and only the good
        print(f"hs-fetch: {prefix or '.'}: {len(good)} of {len(entries)} samples here, verified", file=sys.stderr)
    for why in failed[:10]:
        print(f"hs-fetch: {why}", file=sys.stderr)
    print(f"hs-fetch: {'done' if not failed else f'{len(failed)} samples NOT fetched'}: {done - len(failed)} "
          f"samples in {time.monotonic() - t0:.0f}s into {dest}", file=sys.stderr)
    return 0 if not failed else 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="s3://BUCKET/PREFIX/RUN", help="a shipped run (or one host's part of it)")
    p.add_argument("dest", type=Path, metavar="DIR", help="local directory (created; a re-run resumes)")
    p.add_argument("--workers", type=int, default=8, metavar="N", help="objects fetched at once (default 8)")
    for name, kw in (("--s3-endpoint", {"metavar": "URL"}), ("--s3-region", {"metavar": "NAME"}),
                     ("--s3-addressing", {"choices": bucket.ADDRESSING, "default": "auto"}),
                     ("--s3-credentials", {"metavar": "FILE"}), ("--s3-ca-bundle", {"metavar": "FILE"})):
        p.add_argument(name, **kw, help="as hs-extract ship's (its --help)")


def run_args(args: argparse.Namespace) -> int:
    try:
        opts = bucket.S3Options(endpoint=args.s3_endpoint, region=args.s3_region, addressing=args.s3_addressing,
                                credentials=args.s3_credentials, ca_bundle=args.s3_ca_bundle,
                                concurrency=max(1, args.workers))
        opts.check()
        b = bucket.Bucket(bucket.parse_url(args.src), opts)
        b.check_bucket()
        return fetch(b, args.dest, max(1, args.workers))
    except ConfigError as e:
        print(f"hs-fetch: {e}", file=sys.stderr)
        return 2
    except (LinkError, OSError) as e:
        print(f"hs-fetch: {e}; run the same command again to go on (what is here verified is kept)",
              file=sys.stderr)
        return 1
