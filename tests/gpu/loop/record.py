"""What a run records besides its numbers, and how its results leave the GPU machine.

- ``provenance``: the target's weights (sha256 of every file of its directory), SpecForge's
  repository commit (the capture script's), the sha256 of every carried wheel and tarball, the
  versions of the packages each side imports, the GPU;
- ``pack``: every arm's per-conversation rows (``hs-extract accept --out`` reports, one row per
  conversation, plus the plain target's answers) in ONE ``conversations.jsonl.xz``, the logs'
  tails in ONE ``logs.tar.xz``, beside ``results.json`` and the table: the device returns at most
  8 files a call, so every call writes these few files, each holding everything measured so far.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import tarfile
from pathlib import Path
from typing import Any


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def tree_digest(directory: Path) -> dict[str, Any]:
    files = {p.relative_to(directory).as_posix(): sha256_file(p) for p in sorted(directory.rglob("*")) if p.is_file()}
    whole = hashlib.sha256("".join(f"{k} {v}\n" for k, v in files.items()).encode()).hexdigest()
    return {"sha256_of_listing": whole, "files": files}


def versions(site: Path | None = None) -> dict[str, str]:
    """Installed versions, from dist-info metadata (``site``: one --target directory only)."""
    from importlib import metadata

    if site is not None:
        out = {}
        for d in sorted(site.glob("*.dist-info")):
            name, _, rest = d.name[: -len(".dist-info")].partition("-")
            out[name] = rest
        return out
    out = {}
    for name in ("torch", "sglang", "transformers", "triton", "flashinfer-python", "numpy"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def provenance(target: Path, carry: Path, sfsite: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"target": tree_digest(target), "kit": versions(), "specforge_site": versions(sfsite)}
    commit = carry / "prepare_hidden_states.commit"
    out["specforge_commit"] = commit.read_text().strip() if commit.exists() else None
    out["carried"] = {p.relative_to(carry).as_posix(): sha256_file(p) for p in sorted(carry.rglob("*"))
                      if p.is_file() and p.suffix in (".whl", ".xz", ".gz", ".py", ".jsonl")}
    try:
        import torch

        out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as e:  # noqa: BLE001
        out["gpu"] = f"unknown: {e}"
    return out


ROW_KEYS = ("sample_id", "completion_tokens", "verify_ct", "correct_drafts", "histogram", "finish", "output_sha256",
            "accept_length", "error")


def rows_of(report: dict[str, Any], meta: dict[str, Any], subsets: dict[str, str]) -> list[dict[str, Any]]:
    return [{**meta, "subset": subsets.get(c["sample_id"], "-"), **{k: c.get(k) for k in ROW_KEYS}}
            for c in report.get("by_conversation", [])]


def pack(measured: dict[str, dict], plain: list[dict], out: Path, subsets: dict[str, str]) -> int:
    """conversations.jsonl.xz from every measured report (``measured``: key -> {meta, report path})."""
    rows = [{"arm": "plain", "seed": 0, "setting": s, "temperature": 0.0, **r} for r in plain
            for s in sorted({m["meta"]["setting"] for m in measured.values()})]
    for key, m in sorted(measured.items()):
        path = Path(m.get("report") or "/nonexistent")
        if path.is_file():
            rows += rows_of(json.loads(path.read_text()), m["meta"], subsets)
    tmp = out / ".conversations.jsonl.xz.tmp"
    with lzma.open(tmp, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    os.replace(tmp, out / "conversations.jsonl.xz")
    return len(rows)


def pack_logs(paths: list[Path], out: Path, tail_bytes: int = 200_000) -> None:
    """The last ``tail_bytes`` of each log, in one logs.tar.xz."""
    tmp = out / ".logs.tar.xz.tmp"
    with tarfile.open(tmp, "w:xz") as tar:
        for p in paths:
            if not p.is_file():
                continue
            with open(p, "rb") as f:
                f.seek(max(0, p.stat().st_size - tail_bytes))
                data = f.read()
            info = tarfile.TarInfo(name=f"{p.parent.name}-{p.name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, out / "logs.tar.xz")
