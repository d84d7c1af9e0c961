"""Shipper runs for the tests: samples written as the driver writes them, the shipper's command
line, and what must hold at the destination and here after a run."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import torch

from hs_patch.host.shipping import shipper
from hs_patch.samples import files, reader, store
from hs_patch.samples.files import RANGE, RANGED

SHIPPED_SHAPE = {"op", "key", "file", "bytes", "sha256", "t"}
SHIPPED_OPTIONAL = {"sample_id", "line_sha256", "from", "kept"}  # from: destination (start-up sync); kept: the destination's copy


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


# ------------------------------------------------------------------------------ an S3 bucket


def objects(server, prefix: str, bucket_name: str = "hs-runs") -> dict[str, bytes]:
    """Every object under PREFIX/samples/ read back with the admin's client: name -> bytes."""
    c = server.client()
    out = {}
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket_name, Prefix=f"{prefix}/samples/"):
        for o in page.get("Contents") or []:
            out[o["Key"].rsplit("/", 1)[1]] = c.get_object(Bucket=bucket_name, Key=o["Key"])["Body"].read()
    return out


def store_manifest(server, prefix: str, bucket_name: str = "hs-runs") -> list[dict]:
    raw = server.client().get_object(Bucket=bucket_name, Key=f"{prefix}/manifest.jsonl")["Body"].read()
    return [json.loads(x) for x in raw.splitlines()]


def digest_of(data: bytes, like: str) -> str:
    if not like.startswith(RANGED):
        return hashlib.sha256(data).hexdigest()
    return RANGED + hashlib.sha256(b"".join(hashlib.sha256(data[i:i + RANGE]).digest()
                                            for i in range(0, max(len(data), 1), RANGE))).hexdigest()


def assert_bucket_has(server, prefix: str, written: list[store.Written], bucket_name: str = "hs-runs") -> None:
    """Exactly these samples at the store, each once in its manifest, every byte as hashed when written."""
    lines = store_manifest(server, prefix, bucket_name)
    assert Counter(r["key"] for r in lines) == Counter(w.key for w in written), "lost or duplicated samples"
    held = objects(server, prefix, bucket_name)
    assert sorted(held) == sorted(w.path.name for w in written)
    by_key = {r["key"]: r for r in lines}
    for w in written:
        data = held[w.path.name]
        assert (len(data), digest_of(data, w.sha256)) == (w.nbytes, w.sha256), f"{w.key} damaged at the store"
        assert by_key[w.key]["file"] == f"samples/{w.path.name}" and by_key[w.key]["sha256"] == w.sha256
