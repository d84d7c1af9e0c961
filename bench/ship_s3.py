#!/usr/bin/env python3
"""Shipping to an S3 bucket against rsync to a storage host, over the same link (issue #37).

A network namespace holds both destinations behind one veth pair (tests/lab/seaweed.py): SeaweedFS
(``weed mini``, the real S3 server of the tests) and a private sshd (tests/lab/loopback_sshd.py),
both writing to /dev/shm. ``--rate`` limits the link with a token bucket filter on this side
(``tc ... tbf rate RATE``), so it is the bottleneck, as a network is; without it the comparison
is CPU-bound on this machine (both ends share its cores).

Each round writes FILES fresh samples the capture writer's way (hidden 7168, four layers and the
final pre-norm state in bf16, random: incompressible; ranged sha256r64m: digests, so samples over
64 MiB go as multipart uploads of 64 MiB parts), hard-links them into one samples directory per
contender, and runs the whole shipper command of each, start to exit, verified and deleted here:

- rsync:  ``hs-extract ship --dest root@ADDR:/dev/shm/.../rsync`` (rsync over SSH, sha256 at the
          destination, fsync, manifest);
- s3 cN:  ``hs-extract ship --dest s3://hs-runs/bench/... --s3-concurrency N`` for each N of
          ``--concurrency`` (SHA256 checksums checked by the store, a HEAD each, the manifest).

It prints each run, then per contender the median GB/s and its ratio to rsync's, side by side:

    sudo python3 bench/ship_s3.py --rate 1gbit                # a 1 Gbit/s link
    sudo python3 bench/ship_s3.py --rate 2500mbit --concurrency 1,4,8,16
    sudo python3 bench/ship_s3.py                            # no limit: this machine's CPUs decide
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hs_patch.samples import store  # noqa: E402
from lab import loopback_sshd, seaweed  # noqa: E402
from ship import write_samples  # noqa: E402  (bench/ship.py: the same samples)


def copy_of(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.is_file():
            (dst / p.name).hardlink_to(p) if p.suffix == store.SUFFIX else shutil.copy(p, dst / p.name)
    return dst


def timed(argv: list[str], samples: Path) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    left = list(samples.glob(f"*{store.SUFFIX}"))
    if p.returncode != 0 or left:
        raise SystemExit(f"{argv[5:9]} failed (exit {p.returncode}, {len(left)} files left): {p.stderr[-2000:]}")
    return seconds


SINK = ("import socket,sys\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind((sys.argv[1],5201));s.listen();print('up',flush=True);c,_=s.accept()\n"
        "b=bytearray(4<<20)\nwhile c.recv_into(b):pass\n")


def link_rate(server: seaweed.Seaweed, nbytes: int = 1 << 30) -> float:
    """GB/s of one raw TCP stream over the link (a sink in the namespace): the rate a transfer can reach."""
    import socket

    sink = subprocess.Popen(["ip", "netns", "exec", server.netns, sys.executable, "-c", SINK, server.address],
                            stdout=subprocess.PIPE, text=True)
    try:
        sink.stdout.readline()
        buf = memoryview(bytearray(os.urandom(4 << 20)))
        with socket.create_connection((server.address, 5201)) as c:
            t0 = time.perf_counter()
            for _ in range(nbytes // len(buf)):
                c.sendall(buf)
            c.shutdown(socket.SHUT_WR)
            sink.wait(60)
            return nbytes / (time.perf_counter() - t0) / 1e9
    finally:
        if sink.poll() is None:
            sink.kill()
        sink.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per sample (2048: 147 MB, three 64 MiB parts)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--rate", default="", help="the link's rate (tc's words: 1gbit, 2500mbit); none: unlimited")
    ap.add_argument("--concurrency", default="1,4,8,16", help="--s3-concurrency settings to run")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if why := seaweed.available():
        raise SystemExit(f"bench/ship_s3.py: {why}")
    settings = [int(x) for x in args.concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="hs-bench-s3-", dir="/dev/shm"))
    os.chmod(work, 0o755)
    server = seaweed.Seaweed(work / "s3").up()
    sshd = None
    rows = []
    try:
        sshd = loopback_sshd.start(work / "sshd", address=server.address, netns=server.netns)
        creds = server.credentials_file()
        if args.rate:
            server.shape(args.rate)
        raw = link_rate(server)
        print(f"raw TCP over the link: {raw:.3f} GB/s", flush=True)
        base = [sys.executable, "-m", "hs_patch.host.shipping.shipper", "ship"]
        for r in range(args.rounds):
            src = work / f"src{r}"
            nbytes = write_samples(src, args.files, args.tokens, seed=r, ranged=True)
            contenders = [("rsync", [f"--dest={sshd.host}:{work / 'dest' / f'r{r}'}", *sshd.ship_args()])]
            contenders += [(f"s3 c{c}", [f"--dest=s3://hs-runs/bench/r{r}-c{c}", *server.ship_args(creds),
                                         "--s3-concurrency", str(c)]) for c in settings]
            order = contenders if r % 2 == 0 else contenders[::-1]  # alternate who goes first
            for name, dest_args in order:
                samples = copy_of(src, work / f"{name.replace(' ', '-')}-{r}")
                seconds = timed([*base, "--samples-dir", str(samples), "--state-dir", str(samples) + ".state",
                                 *dest_args], samples)
                row = {"round": r, "contender": name, "bytes": nbytes, "seconds": round(seconds, 3),
                       "GBps": round(nbytes / seconds / 1e9, 3)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            shutil.rmtree(work / "dest", ignore_errors=True)
            shutil.rmtree(src)
    finally:
        if sshd is not None:
            sshd.stop()
        server.down()
        shutil.rmtree(work, ignore_errors=True)
    names = ["rsync"] + [f"s3 c{c}" for c in settings]
    median = {n: statistics.median(x["GBps"] for x in rows if x["contender"] == n) for n in names}
    print(f"link {args.rate or 'unlimited'}, {args.files} x {rows[0]['bytes'] / args.files / 1e6:.0f} MB a round, "
          f"median of {args.rounds} rounds:")
    for n in names:
        print(f"  {n:8s} {median[n]:.3f} GB/s   {median[n] / median['rsync']:.2f} x rsync   "
              f"{median[n] / raw:.2f} of the link's raw TCP {raw:.3f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "median_GBps": median, "rate": args.rate,
                                               "raw_tcp_GBps": raw}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
