"""One JSON snapshot of an extraction run, taken on the GPU host for the dashboard.

hs-extract snapshot --run NAME --state-dir D --samples-dir S --capture-dir C --service UNIT
prints the driver's status.json, the shipper's shipper_status.json, the hook's
hook_status.json, the state of the run's systemd units and of the server unit, the
filesystem usage of the dump and samples directories, per-GPU utilisation and memory
from nvidia-smi, and the last rejects. Standard library only; never fails because a
piece is missing (that piece is null).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

# each program a snapshot runs gets this long: the whole snapshot stays well inside the
# dashboard's 20 s read deadline (hs_patch.control.poll), past which the host is shown unreachable
STEP_TIMEOUT_S = 8


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail_jsonl(path: Path, n: int) -> list[Any]:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            lines = f.read().decode("utf-8", "replace").splitlines()[-n:]
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def units(names: list[str]) -> dict[str, dict[str, str]]:
    """ActiveState/SubState/Result/ExecMainStatus of systemd units (empty if systemctl is missing)."""
    if not shutil.which("systemctl"):
        return {}
    props = "ActiveState,SubState,Result,ExecMainStatus,ActiveEnterTimestamp"
    try:
        out = subprocess.run(["systemctl", "show", "-p", props, *[f"{n}.service" for n in names]],
                             capture_output=True, text=True, timeout=STEP_TIMEOUT_S).stdout
    except subprocess.TimeoutExpired:
        return {}
    res: dict[str, dict[str, str]] = {}
    for name, block in zip(names, out.split("\n\n")):
        res[name] = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
    return res


def gpus() -> list[dict[str, Any]] | None:
    if not shutil.which("nvidia-smi"):
        return None
    q = "index,name,utilization.gpu,memory.used,memory.total"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=STEP_TIMEOUT_S).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = []
    for line in out.strip().splitlines():
        p = [x.strip() for x in line.split(",")]
        if len(p) == 5:
            rows.append({"index": p[0], "name": p[1], "util": _num(p[2]), "mem_used": _num(p[3]),
                         "mem_total": _num(p[4])})
    return rows


def _num(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:
        return None


def usage(path: str) -> dict[str, Any] | None:
    p = Path(path)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        st = os.statvfs(p)
    except OSError:
        return None
    total = st.f_blocks * st.f_frsize
    free = st.f_bavail * st.f_frsize
    return {"path": path, "total": total, "free": free, "used_pct": round(100 * (1 - free / total), 1) if total else 0}


def sample_files(samples_dir: str) -> int | None:
    """Sample files in the run's samples dir (those not shipped yet, with shipping on); None if unreadable."""
    try:
        with os.scandir(samples_dir) as it:
            return sum(1 for e in it if e.name.endswith(".safetensors"))
    except OSError:
        return None


def take(run: str, state_dir: str, samples_dir: str, capture_dir: str, service: str) -> dict[str, Any]:
    state = Path(state_dir)
    return {
        "time": time.time(), "run": run,
        "driver": _json(state / "status.json"),
        "shipper": _json(state / "shipper_status.json"),
        "hook": _json(Path(capture_dir) / "hook_status.json"),
        "units": units([f"hs-drive-{run}", f"hs-ship-{run}", service]),
        "dump": usage(capture_dir), "samples": usage(samples_dir), "samples_left": sample_files(samples_dir),
        "gpus": gpus(),
        "rejects": _tail_jsonl(state / "rejects.jsonl", 5),
    }


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--run", required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--samples-dir", required=True)
    ap.add_argument("--capture-dir", required=True)
    ap.add_argument("--service", required=True, metavar="UNIT",
                    help="the SGLang server's systemd unit: the host's sglang_service_name (fab passes it)")


def run_args(a: argparse.Namespace) -> int:
    print(json.dumps(take(a.run, a.state_dir, a.samples_dir, a.capture_dir, a.service)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hs_patch.host.driver.snapshot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    return run_args(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
