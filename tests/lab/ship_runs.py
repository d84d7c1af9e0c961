"""Shipper runs for the tests: samples written as the driver writes them, the shipper's command
line, and what must hold at the destination and here after a run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch

from hs_patch import files, reader, store
from hs_patch.host.shipping import shipper

SHIPPED_SHAPE = {"op", "key", "file", "bytes", "sha256", "t"}
SHIPPED_OPTIONAL = {"sample_id", "from", "kept"}  # from: destination (start-up sync); kept: the destination's copy


def make_samples(directory: Path, n: int, *, start: int = 0, tokens: int = 8, hidden: int = 64,
                 sample_ids: bool = False, seed_offset: int = 0, ranged: bool = False,
                 **entry: str) -> list[store.Written]:
    """n samples written and listed the way the driver does (store.write_sample + manifest add);
    ``seed_offset`` gives the same samples (same tokens and keys) with other bytes; ``ranged``: with the
    capture writer's ranged digest (sha256r64m:), else a plain sha256; ``entry``: more fields of their
    manifest lines (run, host, shard)."""
    out = []
    g = torch.Generator().manual_seed(start + seed_offset)
    for i in range(start, start + n):
        ids = torch.arange(i * 100_000, i * 100_000 + tokens, dtype=torch.int64)
        key = store.sample_key(ids)
        plane = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
        meta = {"format": store.FORMAT, "key": key, "num_tokens": str(tokens), "planes": "layer.2",
                "hidden_size": str(hidden), "dtype": "bfloat16"}
        tensors = [store.tensor_bytes("input_ids", ids), store.tensor_bytes("layer.2", plane)]
        w = (store.publish(store.write_temp(directory, key, tensors, meta, ranges=True), directory, replace=True)
             if ranged else store.write_sample(directory, key, tensors, meta))
        store.Manifest(directory).add(w, tokens=tokens, **({"sample_id": f"data.jsonl:{i + 1}"} if sample_ids else {}),
                                      **entry)
        out.append(w)
    return out


def dirs(tmp_path: Path) -> tuple[Path, Path, Path]:
    return tmp_path / "samples", tmp_path / "state", tmp_path / "dest"


def ship_cmd(samples: Path, state: Path, dest: str, *extra: str) -> list[str]:
    return ["ship", "--samples-dir", str(samples), "--state-dir", str(state), "--dest", dest, *extra]


def assert_destination_has(dest: Path, written: list[store.Written]) -> None:
    """Exactly these samples, each once in the manifest, complete and intact; nothing else."""
    lines = [json.loads(x) for x in (dest / store.MANIFEST).read_text().splitlines()]
    assert all(rec["op"] == "add" for rec in lines)
    counts = Counter(rec["key"] for rec in lines)
    assert counts == Counter(w.key for w in written), "lost or duplicated samples at the destination"
    for w in written:
        size, digest = files.file_digest(dest / "samples" / w.path.name, w.sha256)
        assert (size, digest) == (w.nbytes, w.sha256), f"{w.key} truncated or damaged at the destination"
    rep = reader.check_dir(dest)
    assert rep.clean and sorted(rep.ok) == sorted(w.key for w in written)


def shipped_records(state: Path) -> list[dict]:
    return store.read_jsonl(state / shipper.SHIPPED_LOG)


def assert_shipped_locally(samples: Path, state: Path, written: list[store.Written]) -> None:
    """Each shipped once in shipped.jsonl, local file deleted, manifest says removed."""
    recs = shipped_records(state)
    assert all(SHIPPED_SHAPE <= set(r) <= SHIPPED_SHAPE | SHIPPED_OPTIONAL and r["op"] == "shipped" for r in recs)
    assert Counter(r["key"] for r in recs) == Counter(w.key for w in written)
    assert all(not w.path.exists() for w in written)
    live = store.read_manifest(samples)
    assert not live.keys() & {w.key for w in written}
    removes = [r for r in store.read_jsonl(samples / store.MANIFEST) if r["op"] == "remove"]
    assert {r["key"] for r in removes} >= {w.key for w in written}
    assert all(r["reason"] == "shipped" for r in removes)


def status(state: Path) -> dict:
    return json.loads((state / shipper.STATUS_FILE).read_text())
