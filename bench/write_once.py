#!/usr/bin/env python3
"""Each byte of states written once and hashed once, and the driver's share per GB, on the CPU.

Part 1 (write amplification): the real capture hook and writer get prompts of TOKENS
tokens prefilled in 1, 2, 8 and 16 chunks (each chunk one pass, with SGLang's
``orig_seq_lens``), with the driver's intents in place. Measured from the process's own
I/O counters (/proc/self/io: ``wchar`` = bytes handed to write/pwrite, ``rchar`` = bytes
read) and from the sha256 calls: bytes written, bytes hashed and bytes read back, each
divided by the bytes of states (planes x hidden x 2 per token). Target: written 1.00. A chunked
prompt's one hashing read maps its file (issue #22: one GIL hand-over per 256 MiB), so ``rchar``
no longer counts it: it is in the hashed bytes (1.00 per file byte, whatever the chunks).

Part 2 (driver CPU per GB): samples of Kimi-K2.5 width (hidden 7168) written by the hook
with intents, then adopted by the driver's real code (``CaptureWatcher`` + ``adopt``: a
header read, a rename, two manifest lines), side by side with what format 1's finalize did
to the same samples (read and verify the sha256, add the loss mask, write and hash again).
Prints CPU seconds per GB of states for both.

    python3 bench/write_once.py                           # hidden 1024 (part 1), 7168 (part 2)
    python3 bench/write_once.py --tokens 16384 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hs_patch.host.driver.adopt import adopt  # noqa: E402
from hs_patch.host.driver.capture_dir import CaptureWatcher  # noqa: E402
from hs_patch.samples import files, intent, reader, store  # noqa: E402
from hs_patch.server import config, hook, inplace  # noqa: E402


class _Mode:
    name = "EXTEND"


class _Batch:
    def __init__(self, n: int, prefix: int, full: int):
        self.forward_mode = _Mode()
        self.extend_seq_lens_cpu, self.extend_prefix_lens_cpu, self.orig_seq_lens = [n], [prefix], [full]


def io() -> dict[str, int]:
    return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}


class HashCounter:
    """Counts the bytes fed to sha256 by the store (inline while writing, and file hashes)."""

    def __init__(self) -> None:
        self.n = 0
        real_write, real_file = store._write_hashed, files.file_sha256

        def write_hashed(fd, buffers, digest):
            self.n += sum(len(memoryview(b).cast("B")) for b in buffers)
            return real_write(fd, buffers, digest)

        def file_sha(path, **kw):
            size, digest = real_file(path, **kw)
            self.n += size
            return size, digest

        store._write_hashed, store.file_sha256 = write_hashed, file_sha
        inplace.file_sha256 = file_sha  # a chunked prompt's one hashing read


def make_hook(directory: Path, planes: int, hidden: int, slot: int) -> hook.CaptureHook:
    cfg = config.CaptureConfig(enabled=True, directory=str(directory), layers=tuple(range(planes - 1)), final="pre",
                               slots=3, slot_tokens=slot, writers=4)
    return hook.CaptureHook(cfg, hidden_size=hidden, metadata={"sglang_release": "bench", "hidden_size": str(hidden)})


def feed(h: hook.CaptureHook, ids: torch.Tensor, data: list[torch.Tensor], chunks: int) -> None:
    n = ids.shape[0]
    step = -(-n // chunks)
    for start in range(0, n, step):
        end = min(n, start + step)
        p = h.begin(_Batch(end - start, start, n), ids[start:end])
        for i in range(len(data) - 1):
            tee = p.collector(i, None)
            tee.append(data[i][start:end])
            tee.hs_attn_input(data[i][start:end])  # what the layer's attention reads: fingerprinted only
        p.final_prenorm(data[-1][start:end], owned=True)
        p.finish(data[-1][start:end])


def part1(base: Path, prompts: int, tokens: int, hidden: int, planes: int, counter: HashCounter) -> list[dict]:
    rows = []
    data = [torch.randn(tokens, hidden).to(torch.bfloat16) for _ in range(planes)]
    for chunks in (1, 2, 8, 16):
        d = base / f"c{chunks}"
        h = make_hook(d, planes, hidden, -(-tokens // chunks))
        all_ids = [torch.arange(tokens, dtype=torch.int64) + k * tokens + chunks * 10_000_000 for k in range(prompts)]
        for ids in all_ids:
            intent.write(d, store.sample_key(ids), [1] * tokens, {"sample_id": f"bench:{ids[0]}", "run": "bench"})
        before, hashed = io(), counter.n
        for ids in all_ids:
            feed(h, ids, data, chunks)
        h.close(600)
        after = io()
        states = prompts * tokens * planes * hidden * 2
        entries = store.read_manifest(d)
        assert len(entries) == prompts and all(e.get("sample_id") for e in entries.values()), "every prompt whole"
        rows.append({"chunks": chunks, "prompts": prompts, "tokens": tokens, "hidden": hidden, "planes": planes,
                     "GB_states": round(states / 1e9, 3),
                     "written_per_state_byte": round((after["wchar"] - before["wchar"]) / states, 4),
                     # the files hold the states and the small tensors: ids, mask, fingerprints (8 fp32 a row of
                     # each stream), header; each of those bytes is written once too
                     "file_bytes_per_state_byte": round(sum(e["bytes"] for e in entries.values()) / states, 4),
                     "written_per_file_byte": round((after["wchar"] - before["wchar"])
                                                    / sum(e["bytes"] for e in entries.values()), 4),
                     "hashed_per_state_byte": round((counter.n - hashed) / states, 4),
                     "read_per_state_byte": round((after["rchar"] - before["rchar"]) / states, 4)})
        print(json.dumps(rows[-1]), flush=True)
        shutil.rmtree(d)
    return rows


def part2(base: Path, samples: int, tokens: int, hidden: int, planes: int) -> dict:
    cap, final, old = base / "capture", base / "samples", base / "v1"
    h = make_hook(cap, planes, hidden, tokens)
    data = [torch.randn(tokens, hidden).to(torch.bfloat16) for _ in range(planes)]
    mask = [0] * (tokens // 4) + [1] * (tokens - tokens // 4)
    for k in range(samples):
        ids = torch.arange(tokens, dtype=torch.int64) + k * tokens
        intent.write(cap, store.sample_key(ids), mask, {"sample_id": f"s{k}", "run": "bench"})
        feed(h, ids, data, 1)
    h.close(600)
    entries = list(store.read_manifest(cap).values())
    nbytes = sum(e["bytes"] for e in entries)

    # what format 1's finalize did: read + verify, add the mask, write + hash again
    t0 = time.process_time()
    for e in entries:
        s = reader.read_sample(cap / e["file"], entry=e)
        tensors = dict(s.tensors, loss_mask=torch.tensor(mask, dtype=torch.uint8))
        store.write_tensors(old, s.key, tensors, dict(s.metadata))
    v1_cpu = time.process_time() - t0
    shutil.rmtree(old)

    watcher = CaptureWatcher(cap)
    final.mkdir()
    t0 = time.process_time()
    for e in entries:
        adopt(watcher, e, final, sample_id=e["sample_id"], run="bench")
    adopt_cpu = time.process_time() - t0
    watcher.close()
    gb = nbytes / 1e9
    row = {"samples": samples, "tokens": tokens, "hidden": hidden, "planes": planes, "GB_states": round(gb, 3),
           "adopt_cpu_s_per_GB": round(adopt_cpu / gb, 4), "v1_finalize_cpu_s_per_GB": round(v1_cpu / gb, 3),
           "v1_over_adopt": round(v1_cpu / max(adopt_cpu, 1e-9), 1)}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="/dev/shm", help="where the temporary dirs go (default: %(default)s)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per chunk count (part 1)")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per prompt (part 1)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (part 1)")
    ap.add_argument("--planes", type=int, default=5, help="captured planes (layers + final)")
    ap.add_argument("--adopt-samples", type=int, default=8, help="samples (part 2)")
    ap.add_argument("--adopt-tokens", type=int, default=2048, help="tokens per sample (part 2)")
    ap.add_argument("--adopt-hidden", type=int, default=7168, help="hidden size (part 2; Kimi-K2.5's)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    torch.set_num_threads(1)
    counter = HashCounter()
    with tempfile.TemporaryDirectory(prefix="hs-bench-write-once-", dir=a.dir, ignore_cleanup_errors=True) as tmp:
        base = Path(tmp)
        res = {"cpu_count": os.cpu_count(),
               "write_amplification": part1(base, a.prompts, a.tokens, a.hidden, a.planes, counter),
               "driver_cpu": part2(base, a.adopt_samples, a.adopt_tokens, a.adopt_hidden, a.planes)}
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
