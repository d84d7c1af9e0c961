"""Is the model directory complete and readable, before ~600 GB of weights start loading?

Self-contained (standard library only), run by the services role as the service user:

    python3 model_check.py MODEL_DIR --architecture KimiK25ForConditionalGeneration [--json]

- ``config.json`` parses and names the expected architecture (one SGLang serves through
  ``deepseek_v2.py``);
- the safetensors index (``model.safetensors.index.json``) or the single ``model.safetensors``:
  every shard the index names exists and is readable;
- each shard is whole: its size is exactly 8 + header length + the end of its last tensor
  (a truncated copy is caught without reading the weights), and every tensor the index maps
  to it is in its header.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

KNOWN_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20  # the safetensors format's own limit


# Copied to the host alone and run without this package, so this script carries its own Check (the
# other readiness script and the control node's preflight, hs_patch.control.remote, have theirs).
@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""


def shard_header(path: Path) -> tuple[dict, int]:
    """(header, expected file size) of a safetensors file, reading only its header."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError("shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER:
            raise ValueError(f"header length {n} is not a safetensors header")
        raw = f.read(n)
        if len(raw) != n:
            raise ValueError(f"header cut off at {len(raw)} of {n} bytes")
    header = json.loads(raw)
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    return header, 8 + n + end


def check_model(model: Path, architecture: str) -> list[Check]:
    checks = []
    try:
        cfg = json.loads((model / "config.json").read_text())
        archs = cfg.get("architectures") or []
    except (OSError, ValueError) as e:
        return [Check("config", False, f"{model}/config.json: {e}", "copy the complete model directory there")]
    ok = architecture in archs and architecture in KNOWN_ARCHITECTURES
    checks.append(Check("architecture", ok, f"config.json names {', '.join(archs) or 'none'}",
                        f"expected {architecture} (one of {', '.join(KNOWN_ARCHITECTURES)}): hs-patch patches "
                        "deepseek_v2.py only; set hs_model_architecture or use the right model"))
    try:
        if (model / INDEX).exists():
            weight_map = json.loads((model / INDEX).read_text())["weight_map"]
        elif (model / "model.safetensors").exists():
            weight_map = {k: "model.safetensors" for k in shard_header(model / "model.safetensors")[0]
                          if k != "__metadata__"}
        else:
            return checks + [Check("index", False, f"neither {INDEX} nor model.safetensors in {model}",
                                   "copy the weights (the safetensors files and their index)")]
    except (OSError, ValueError, KeyError) as e:
        return checks + [Check("index", False, f"{model}/{INDEX}: {e}", "copy the index file again")]
    shards = sorted(set(weight_map.values()))
    problems, total = [], 0
    for shard in shards:
        try:
            header, expected = shard_header(model / shard)
            size = (model / shard).stat().st_size
        except (OSError, ValueError) as e:
            problems.append(f"{shard}: {getattr(e, 'strerror', None) or e}")
            continue
        total += size
        if size != expected:
            problems.append(f"{shard}: {size} bytes, its header says {expected} (truncated or still copying)")
        missing = [k for k, v in weight_map.items() if v == shard and k not in header]
        if missing:
            problems.append(f"{shard}: lacks {len(missing)} tensor(s) the index maps to it, e.g. {missing[0]}")
    checks.append(Check("index", True, f"{len(weight_map)} tensors in {len(shards)} shard(s)"))
    checks.append(Check("shards", not problems, "; ".join(problems[:5]) + (f" (+{len(problems) - 5} more)"
                                                                           if len(problems) > 5 else "")
                        if problems else f"{len(shards)} shard(s) whole and readable, {total / 2**30:.1f} GiB",
                        "copy the listed files again (rsync --checksum), and let the service user read them "
                        f"(chmod -R a+rX {model})"))
    return checks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="model_check.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--architecture", default="KimiK25ForConditionalGeneration")
    ap.add_argument("--json", action="store_true", help="one JSON object per check")
    a = ap.parse_args(argv)
    checks = check_model(a.model, a.architecture)
    for c in checks:
        print(json.dumps(asdict(c)) if a.json else
              f"{'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" + ("" if c.ok else f"\n     fix: {c.fix}"))
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
