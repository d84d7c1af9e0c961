#!/usr/bin/env python3
"""Shipper throughput against plain rsync of the same files over the same SSH link.

Each round writes FILES fresh samples (format v1, hidden 7168, four layers + the final
pre-norm state in bf16, random values: incompressible like real states) with
hs_patch.samples.store into a source directory, then runs both (which goes first alternates):

- plain:   ``rsync -a -e "ssh OPTS" FILE... HOST:DEST/plain/``, the same files (hard
           links), the same ssh options (key, port, known_hosts, cipher);
- shipper: ``python3 -m hs_patch.host.shipping.shipper ship --samples-dir SRC --state-dir ... --dest
           HOST:DEST/ship`` (rsync + sha256 on the destination + fsync + atomic manifest +
           local deletion), wall time of the whole command, start to exit.

The link is a private sshd on 127.0.0.1 (tests/lab/loopback_sshd.py), so both transfers
share this machine's CPUs with the receiving side: unlimited, it is a CPU-bound
comparison, the worst case for the shipper's extra hashing; --bwlimit makes the link
the bottleneck, as a real network is. Prints each round, the medians and the ratio. Run:

    python3 bench/ship.py                         # 200 x 8.4 MB, 4 rounds, everything in /dev/shm
    python3 bench/ship.py --bwlimit 50000          # both capped at 51 MB/s: a network-bound link
    python3 bench/ship.py --dest-root /var/tmp     # destinations on disk (the shipper fsyncs)
"""

from __future__ import annotations

import argparse
import json
import shlex
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

import torch  # noqa: E402

from lab import loopback_sshd  # noqa: E402
from hs_patch.host.shipping.link import SshOptions  # noqa: E402
from hs_patch.samples import reader, store  # noqa: E402

HIDDEN = 7168
PLANES = ["layer.2", "layer.30", "layer.58", "final.pre_norm"]


def write_samples(directory: Path, files: int, tokens: int, seed: int, *, ranged: bool = False) -> int:
    """FILES samples of TOKENS tokens (``ranged``: with the capture writer's sha256r64m: digests); returns the
    bytes written."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(tokens * len(PLANES) * 4, HIDDEN, generator=g).to(torch.bfloat16)
    manifest = store.Manifest(directory)
    total = 0
    for i in range(files):
        ids = torch.arange(tokens, dtype=torch.int64) + (seed * 1_000_000 + i) * tokens
        key = store.sample_key(ids)
        start = (i * 7 * tokens) % (pool.shape[0] - tokens * len(PLANES))  # distinct content per file
        tensors = [store.tensor_bytes("input_ids", ids)]
        tensors += [store.tensor_bytes(name, pool[start + j * tokens: start + (j + 1) * tokens])
                    for j, name in enumerate(PLANES)]
        meta = {"format": store.FORMAT, "key": key, "num_tokens": str(tokens), "planes": ",".join(PLANES),
                "hidden_size": str(HIDDEN), "dtype": "bfloat16"}
        w = (store.publish(store.write_temp(directory, key, tensors, meta, ranges=True), directory, replace=True)
             if ranged else store.write_sample(directory, key, tensors, meta))
        manifest.add(w, tokens=tokens)
        total += w.nbytes
    return total


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{shlex.join(argv[:6])} ... failed (exit {p.returncode}): {p.stderr[-2000:]}")
    return seconds


def run_plain(argv: list[str], dest: Path, files: int) -> float:
    seconds = timed(argv)
    arrived = len(list(dest.iterdir()))
    if arrived != files:
        raise SystemExit(f"plain rsync delivered {arrived} of {files} files")
    shutil.rmtree(dest)  # both runs start with the same free memory
    return seconds


def run_shipper(argv: list[str], src: Path, dest: Path, files: int) -> float:
    seconds = timed(argv)
    left = list(src.glob(f"*{store.SUFFIX}"))
    arrived = reader.check_dir(dest, deep=False)
    if left or len(arrived.ok) != files or not arrived.clean:
        raise SystemExit(f"the shipper left {len(left)} files, the destination has {len(arrived.ok)} of {files}")
    shutil.rmtree(dest)
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=146, help="tokens per sample (146: 8.4 MB)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--src-root", default="/dev/shm", help="where the samples are written")
    ap.add_argument("--dest-root", default="/dev/shm", help="where both destinations live")
    ap.add_argument("--ssh-option", action="append", default=[], help="extra ssh -o for both, e.g. Ciphers=...")
    ap.add_argument("--bwlimit", type=int, default=0, metavar="KBPS",
                    help="rsync --bwlimit for both: a link slower than this machine's CPUs (KiB/s)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="hs-bench-ship-", dir=args.src_root))
    dest_root = Path(tempfile.mkdtemp(prefix="hs-bench-ship-dest-", dir=args.dest_root))
    server = loopback_sshd.start(work / "sshd")
    rows = []
    try:
        ssh = SshOptions(str(server.key), server.port, str(server.known_hosts), args.ssh_option)
        for r in range(args.rounds):
            src, plain_src, state = work / f"src{r}", work / f"plain{r}", work / f"state{r}"
            nbytes = write_samples(src, args.files, args.tokens, seed=r)
            names = sorted(p.name for p in src.glob(f"*{store.SUFFIX}"))
            plain_src.mkdir()
            for n in names:  # hard links: the same inodes, kept when the shipper deletes its copies
                (plain_src / n).hardlink_to(src / n)
            (dest_root / "plain").mkdir()
            limit = [f"--bwlimit={args.bwlimit}"] if args.bwlimit else []
            plain_cmd = ["rsync", "-a", *limit, "-e", shlex.join(ssh.argv()), *(str(plain_src / n) for n in names),
                         f"{server.host}:{dest_root / 'plain'}/"]
            ship_cmd = [sys.executable, "-m", "hs_patch.host.shipping.shipper", "ship", "--samples-dir", str(src),
                        "--state-dir", str(state), "--dest", f"{server.host}:{dest_root / 'ship'}",
                        *server.ship_args(), *(f"--ssh-option={o}" for o in args.ssh_option), *limit]
            if r % 2 == 0:  # alternate which goes first
                plain = run_plain(plain_cmd, dest_root / "plain", args.files)
                shipped = run_shipper(ship_cmd, src, dest_root / "ship", args.files)
            else:
                shipped = run_shipper(ship_cmd, src, dest_root / "ship", args.files)
                plain = run_plain(plain_cmd, dest_root / "plain", args.files)
            row = {"round": r, "files": args.files, "bytes": nbytes, "plain_s": round(plain, 3),
                   "shipper_s": round(shipped, 3), "plain_MBps": round(nbytes / plain / 1e6, 1),
                   "shipper_MBps": round(nbytes / shipped / 1e6, 1), "ratio": round(plain / shipped, 3)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            for d in (src, plain_src, state):
                shutil.rmtree(d)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(dest_root, ignore_errors=True)
    summary = {k: round(statistics.median(r[k] for r in rows), 3) for k in ("plain_MBps", "shipper_MBps", "ratio")}
    summary.update(files=args.files, bytes_per_round=rows[0]["bytes"], rounds=args.rounds,
                   src_root=args.src_root, dest_root=args.dest_root, bwlimit_kbps=args.bwlimit)
    print(f"plain rsync {summary['plain_MBps']} MB/s, shipper {summary['shipper_MBps']} MB/s, "
          f"ratio {summary['ratio']} (median of {args.rounds})")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
