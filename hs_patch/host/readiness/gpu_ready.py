"""Is this host ready to start the SGLang server? PCIe/IOMMU state, a JIT compile, an NCCL all-reduce.

One self-contained script (standard library at import; torch and tvm-ffi only inside the
checks that need them), run with the venv's Python, as the service user, with the server
unit's environment: by the services role before it starts the server, by the unit itself
(ExecStartPre), and by ``fab extract``'s preflight, so all three run the same check.

    python gpu_ready.py [pcie] [jit] [nccl] [--gpus N] [--timeout S] [--json]

- ``pcie``: ``nvidia-smi topo -m`` (how each GPU pair is connected), ``nvidia-smi topo -p2p r``
  (what the driver allows), IOMMU state (``/sys/class/iommu``, the kernel command line) and
  ACS redirection on PCIe bridges (``lspci -vvv``: ``ACSCtl: ... ReqRedir+``), with what to
  change. Findings are warnings: the NCCL check decides.
- ``jit``: finds nvcc the way tvm-ffi and FlashInfer do (``CUDA_HOME``/``CUDA_PATH``, ``nvcc``
  on PATH, ``/usr/local/cuda``), ``ninja`` on PATH, checks nvcc's CUDA major equals torch's,
  then compiles a tiny CUDA kernel with ``tvm_ffi.cpp.load_inline`` for GPU 0's architecture
  (SGLang's own JIT path: Kimi-K2.5's INT4 Marlin repack goes through it) and runs it.
- ``nccl``: one process per GPU, an all-reduce of 64 MiB through NCCL, the sum checked, under a
  timeout. A hang is reported as a hang, with the likely cause (P2P behind ACS or an IOMMU:
  NVIDIA/nccl#1999, #2079; vllm#33041) and the NCCL_* settings in effect.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HANG_HELP = ("RTX PRO 6000 boards are known to hang multi-GPU NCCL with PCIe peer-to-peer on behind ACS "
             "redirection or an IOMMU in translation mode (NVIDIA/nccl#1999, #2079; vllm#33041). Fix: disable ACS "
             "on the PCIe switches/root ports (BIOS, or setpci), boot with iommu=pt (or the IOMMU off), or set "
             "hs_nccl_env: {NCCL_P2P_DISABLE: \"1\"} (traffic through host memory, slower), then run the check again")


# Copied to the host alone and run without this package, so this script carries its own Check (the
# other readiness script and the control node's preflight, hs_patch.control.remote, have theirs).
@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warn: bool = False  # reported, not failing


def _run(cmd: list[str], timeout: int = 60) -> tuple[int, str]:
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
        return p.returncode, (p.stdout + p.stderr).strip()
    except FileNotFoundError:
        return 127, f"{cmd[0]}: not found"
    except subprocess.TimeoutExpired:
        return 124, f"{' '.join(cmd)}: no answer in {timeout}s"


# --------------------------------------------------------------------------- PCIe / IOMMU / ACS


def iommu_state(sys_root: str = "/") -> tuple[str, str]:
    """('off' | 'passthrough' | 'translated', evidence)."""
    root = Path(sys_root)
    cmdline = (root / "proc/cmdline").read_text() if (root / "proc/cmdline").exists() else ""
    units = sorted(p.name for p in (root / "sys/class/iommu").glob("*")) if (root / "sys/class/iommu").is_dir() else []
    if not units:
        return "off", "no IOMMU in /sys/class/iommu"
    if re.search(r"\biommu(\.passthrough)?=(pt|1)\b", cmdline) and "iommu.passthrough=0" not in cmdline:
        return "passthrough", f"{len(units)} IOMMU unit(s), kernel command line has iommu=pt"
    return "translated", f"{len(units)} IOMMU unit(s) ({', '.join(units[:4])}), no iommu=pt on the kernel command line"


def acs_redirecting(lspci_vvv: str) -> list[str]:
    """PCI devices whose ACS control redirects peer requests (ReqRedir+ or CmpltRedir+)."""
    out, dev = [], ""
    for line in lspci_vvv.splitlines():
        if line and not line[0].isspace():
            dev = line.split(" ", 1)[0]
        elif "ACSCtl:" in line and ("ReqRedir+" in line or "CmpltRedir+" in line):
            out.append(dev)
    return out


def topo_links(topo: str) -> dict[str, int]:
    """Count of each GPU-to-GPU link type (PIX, PXB, PHB, NODE, SYS, NV#) in ``nvidia-smi topo -m``."""
    counts: dict[str, int] = {}
    rows = [r.split() for r in topo.splitlines() if re.match(r"^GPU\d+\s", r)]
    for i, row in enumerate(rows):
        for j, cell in enumerate(row[1:1 + len(rows)]):
            if i < j:
                counts[cell] = counts.get(cell, 0) + 1
    return counts


def pcie_checks(smi: str = "nvidia-smi", sys_root: str = "/") -> list[Check]:
    checks = []
    rc, topo = _run([smi, "topo", "-m"])
    links = topo_links(topo) if rc == 0 else {}
    checks.append(Check("topology", rc == 0, ", ".join(f"{n} x {k}" for k, n in sorted(links.items())) or topo[-200:],
                        "nvidia-smi topo -m failed: is the driver loaded?"))
    rc, p2p = _run([smi, "topo", "-p2p", "r"])
    cells = [c for r in p2p.splitlines() if re.match(r"^GPU\d+\s", r) for c in r.split()[1:] if c != "X"]
    blocked = sorted({c for c in cells if c != "OK"})
    checks.append(Check("p2p", rc == 0, "peer-to-peer reads allowed between all GPUs" if rc == 0 and not blocked else
                        f"peer-to-peer reads not allowed for some pairs: {', '.join(blocked) or p2p[-200:]}",
                        "NCCL falls back to host memory for those pairs (slower, not a hang)", warn=True))
    state, why = iommu_state(sys_root)
    p2p_on = os.environ.get("NCCL_P2P_DISABLE", "0") in ("", "0")
    checks.append(Check("iommu", not (state == "translated" and p2p_on), f"{state}: {why}",
                        "boot with iommu=pt (GRUB_CMDLINE_LINUX_DEFAULT in /etc/default/grub, update-grub, reboot) or "
                        "set NCCL_P2P_DISABLE=1: P2P through a translating IOMMU hangs or crawls", warn=True))
    if os.geteuid() != 0:  # lspci shows the ACS capability to root only
        return checks + [Check("acs", True, "not read (needs root: the services role checks it as root)", warn=True)]
    rc, lspci = _run(["lspci", "-vvv"])
    redirect = acs_redirecting(lspci) if rc == 0 else []
    checks.append(Check("acs", rc == 0 and not (redirect and p2p_on),
                        (f"ACS redirects peer traffic on {len(redirect)} bridge(s): {', '.join(redirect[:8])}" if redirect
                         else "no ACS redirection") if rc == 0 else f"lspci -vvv failed: {lspci[-200:]}",
                        "disable ACS on those bridges (BIOS: PCIe ACS off; or setpci -s BDF ECAP_ACS+0x6.w=0000 at "
                        "every boot), or set NCCL_P2P_DISABLE=1" if rc == 0 else "run as root with pciutils installed",
                        warn=True))
    return checks


# --------------------------------------------------------------------------- JIT toolchain


def find_cuda_home() -> tuple[str | None, str]:
    """(CUDA root, how it was found), in tvm-ffi's and FlashInfer's order."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return os.environ[var], f"${var}"
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(nvcc).resolve().parent.parent), "nvcc on PATH"
    if Path("/usr/local/cuda").exists():
        return "/usr/local/cuda", "/usr/local/cuda"
    return None, "none"


KERNEL = r"""
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>
__global__ void hs_add_one(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.0f; }
void add_one(tvm::ffi::TensorView x) {
  int n = static_cast<int>(x.size(0));
  hs_add_one<<<(n + 255) / 256, 256>>>(static_cast<float*>(x.data_ptr()), n);
}
TVM_FFI_DLL_EXPORT_TYPED_FUNC(add_one, add_one);
"""


def jit_checks() -> list[Check]:
    home, how = find_cuda_home()
    nvcc = Path(home or "/nonexistent") / "bin" / "nvcc"
    if not nvcc.exists():
        return [Check("nvcc", False, f"no nvcc (CUDA_HOME via {how}: {home})",
                      "install the CUDA toolkit of torch's CUDA version (gpu_host role) and set CUDA_HOME in the unit")]
    rc, out = _run([str(nvcc), "--version"])
    m = re.search(r"release (\d+)\.(\d+)", out)
    checks = [Check("nvcc", bool(m), f"{nvcc} (via {how}): CUDA {m.group(1)}.{m.group(2)}" if m else out[-200:])]
    ninja = shutil.which("ninja")
    checks.append(Check("ninja", ninja is not None, ninja or "not on PATH",
                        "put the venv's bin/ first on the unit's PATH (pip installs ninja there)"))
    try:
        import torch
    except ImportError as e:
        return checks + [Check("torch", False, str(e), "run with the venv's python")]
    torch_cuda = torch.version.cuda or ""
    same = bool(m) and torch_cuda.split(".")[0] == m.group(1)
    checks.append(Check("cuda major", same, f"torch {torch.__version__} built for CUDA {torch_cuda}, nvcc {m and m.group(0)}",
                        f"install the CUDA {torch_cuda} toolkit and point CUDA_HOME at it"))
    if not all(c.ok for c in checks):
        return checks
    major, minor = torch.cuda.get_device_capability(0)
    os.environ.setdefault("TVM_FFI_CUDA_ARCH_LIST", f"{major}.{minor}")
    started = time.monotonic()
    try:
        from tvm_ffi.cpp import load_inline

        with tempfile.TemporaryDirectory(prefix="hs-jit-check-") as build:
            mod = load_inline("hs_jit_check", cuda_sources=KERNEL, build_directory=build)
            x = torch.zeros(1000, device="cuda:0")
            mod.add_one(x)
            torch.cuda.synchronize()
            ok = bool((x == 1).all().item())
    except Exception as e:  # noqa: BLE001 - any failure of the toolchain is the finding
        return checks + [Check("jit compile", False, f"sm_{major}{minor}: {type(e).__name__}: {str(e)[-600:]}",
                               "read the compiler output above; the server's JIT kernels would fail the same way")]
    return checks + [Check("jit compile", ok, f"sm_{major}{minor} kernel built with tvm-ffi and run in "
                           f"{time.monotonic() - started:.1f}s" + ("" if ok else ": wrong result"))]


# --------------------------------------------------------------------------- NCCL all-reduce


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, device: str, mib: int, timeout: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    x = torch.full((mib << 18,), float(rank + 1), device=dev)
    if os.environ.get("HS_GPU_READY_STALL_RANK") == str(rank):  # fault injection for the tests: a hung rank
        time.sleep(timeout * 10)
    started = time.monotonic()
    dist.all_reduce(x)
    if device == "cuda":
        torch.cuda.synchronize()
    took = time.monotonic() - started
    want = world * (world + 1) / 2
    ok = bool((x == want).all().item())
    print(json.dumps({"rank": rank, "ok": ok, "seconds": round(took, 3)}), flush=True)
    dist.destroy_process_group()
    sys.exit(0 if ok else 3)


def nccl_check(gpus: int, timeout: int, *, backend: str = "nccl", device: str = "cuda", mib: int = 64,
               pcie: list[Check] | None = None) -> Check:
    port = _free_port()
    env_used = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "_worker", str(r), str(gpus), str(port),
                               backend, device, str(mib), str(timeout)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(gpus)]
    deadline = time.monotonic() + timeout
    hung = False
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung = True
            break
    if hung:
        for p in procs:  # our own children, by pid
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        stuck = [r for r, p in enumerate(procs) if p.returncode not in (0,)]
        risks = [c.detail for c in (pcie or []) if not c.ok]
        return Check("nccl all-reduce", False,
                     f"HANG: the all-reduce over {gpus} {device.upper()}s did not finish in {timeout}s (ranks "
                     f"{stuck} killed); NCCL settings {env_used or 'none (defaults: P2P on)'}"
                     + (f"; this host: {'; '.join(risks)}" if risks else ""), HANG_HELP)
    outs = [(p.returncode, p.stdout.read(), p.stderr.read()) for p in procs]
    bad = [(r, rc, err) for r, (rc, _, err) in enumerate(outs) if rc != 0]
    if bad:
        r, rc, err = bad[0]
        return Check("nccl all-reduce", False, f"rank {r} failed (exit {rc}): {err.strip()[-800:]}",
                     "read the error above (NCCL_DEBUG=INFO in hs_nccl_env shows more)")
    secs = max(json.loads(o.strip().splitlines()[-1])["seconds"] for _, o, _ in outs)
    return Check("nccl all-reduce", True, f"{mib} MiB over {gpus} {device.upper()}s in {secs:.3f}s, sum correct; "
                 f"NCCL settings {env_used or 'defaults'}")


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        r, w, port, backend, device, mib, timeout = argv[1:8]
        _worker(int(r), int(w), int(port), backend, device, int(mib), int(timeout))
        return 0
    ap = argparse.ArgumentParser(prog="gpu_ready.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("checks", nargs="*", choices=["pcie", "jit", "nccl", []], default=[], metavar="CHECK",
                    help="pcie, jit, nccl (default: all three)")
    ap.add_argument("--gpus", type=int, default=0, help="ranks of the all-reduce (default: every visible GPU)")
    ap.add_argument("--timeout", type=int, default=180, help="seconds before the all-reduce counts as hung")
    ap.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)  # gloo + cpu: the tests
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--nvidia-smi", default="nvidia-smi")
    ap.add_argument("--json", action="store_true", help="one JSON object per check")
    a = ap.parse_args(argv)
    want = a.checks or ["pcie", "jit", "nccl"]
    checks: list[Check] = []
    pcie = pcie_checks(a.nvidia_smi) if "pcie" in want or "nccl" in want else []
    checks += pcie if "pcie" in want else []
    if "jit" in want:
        checks += jit_checks()
    if "nccl" in want:
        gpus = a.gpus
        if not gpus and a.device == "cuda":
            import torch

            gpus = torch.cuda.device_count()
        checks.append(nccl_check(gpus or 2, a.timeout, backend=a.backend, device=a.device, pcie=pcie))
    for c in checks:
        if a.json:
            print(json.dumps(asdict(c)), flush=True)
        else:
            mark = "ok  " if c.ok else ("WARN" if c.warn else "FAIL")
            print(f"{mark} {c.name}: {c.detail}" + ("" if c.ok else f"\n     fix: {c.fix}"), flush=True)
    return 0 if all(c.ok or c.warn for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
