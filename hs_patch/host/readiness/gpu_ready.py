"""Is this host ready to start the SGLang server? Writable caches, PCIe/IOMMU state, a JIT compile, an NCCL all-reduce.

One self-contained script (standard library at import; torch and tvm-ffi only inside the checks that need them), run
with the venv's Python, as the service user, with the server unit's environment: by the services role before it starts
the server, by the unit itself (ExecStartPre), and by ``fab extract``'s preflight, so all three run the same check.

    python gpu_ready.py [caches] [pcie] [jit] [nccl] [--gpus N] [--timeout S] [--no-gpu] [--json]

- ``caches``: each cache directory the environment names and the ones the libraries derive (:func:`cache_dirs`) takes
  a written, synced, removed file: in the unit's sandbox an unwritable one fails the server before any weight loads
  (Kimi's tokenizer is remote code, the INT4 Marlin repack builds under ``TVM_FFI_CACHE_DIR``).
- ``pcie``: ``nvidia-smi topo -m`` (how each GPU pair is connected), ``nvidia-smi topo -p2p r`` (what the driver
  allows), IOMMU state (``/sys/class/iommu``, the kernel command line) and ACS redirection on PCIe bridges (``lspci
  -vvv``: ``ACSCtl: ... ReqRedir+``), with what to change. Findings are warnings: the NCCL check decides.
- ``jit``: finds nvcc the way tvm-ffi and FlashInfer do (``CUDA_HOME``/``CUDA_PATH``, ``nvcc`` on PATH,
  ``/usr/local/cuda``), ``ninja`` on PATH, checks nvcc's CUDA major equals torch's, then compiles a tiny CUDA kernel
  with ``tvm_ffi.cpp.load_inline`` for GPU 0's architecture (SGLang's own JIT path: Kimi-K2.5's INT4 Marlin repack
  goes through it) and runs it.
- ``nccl``: one process per GPU over exactly ``--gpus`` GPUs (the tensor-parallel size; fewer visible is a failure),
  an all-reduce of 64 MiB through NCCL, the sum checked, under a timeout. A hang is reported as a hang, with the
  likely cause (P2P behind ACS or an IOMMU: NVIDIA/nccl#1999, #2079; vllm#33041) and the NCCL_* settings in effect;
  with P2P on, the all-reduce is tried once more with ``NCCL_P2P_DISABLE=1`` and the report says which setting works
  and what to set (the check still fails: the server would hang with the settings it has).
``--no-gpu`` (the test hosts): ``pcie``, ``jit`` and ``nccl`` are reported as not checked.
"""

from __future__ import annotations

import argparse
import datetime
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
from typing import Mapping

READY_ENV = "HS_GPU_READY_MARK"  # the directory each all-reduce rank marks itself started in (a file: its rank)
HANG_HELP = ("RTX PRO 6000 boards are known to hang multi-GPU NCCL with PCIe peer-to-peer on behind ACS "
             "redirection or an IOMMU in translation mode (NVIDIA/nccl#1999, #2079; vllm#33041). Fix: disable ACS "
             "on the PCIe switches/root ports (BIOS, or hs_pcie_acs_disable: true), boot with iommu=pt "
             "(hs_iommu_passthrough: true, or the IOMMU off in the BIOS), or set "
             "hs_nccl_env: {NCCL_P2P_DISABLE: \"1\"} (traffic through host memory, slower), then run the check again")


# Copied to the host alone and run without this package, so this script carries its own Check (the other readiness
# script and the control node's preflight, hs_patch.control.remote, have theirs).
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


# --------------------------------------------------------------------------- caches

# Variables that move where the server's libraries write at run time (read in the wheels of SGLang
# 0.5.9/0.5.16/0.5.23, transformers, tvm-ffi 0.1.11, FlashInfer 0.6.3/0.7.2, torch, Triton, CUDA); the services role
# sets each under sglang_service_cache_dir.
CACHE_VARS = ("XDG_CACHE_HOME", "HF_HOME", "HF_MODULES_CACHE", "TVM_FFI_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE",
              "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "SGLANG_CACHE_DIR",
              "SGLANG_JIT_CACHE_DIR", "SGLANG_DG_CACHE_DIR", "CUDA_CACHE_PATH")
CACHE_FIX = ("the server writes there and its sandbox (ProtectSystem=strict) does not let it: keep every cache under "
             "sglang_service_cache_dir, which the unit's ReadWritePaths holds, or add the directory to "
             "sglang_service_read_write_paths; it must belong to the service user")


def cache_dirs(env: Mapping[str, str]) -> dict[str, str]:
    """{what: directory} the server will write: each cache variable set to a path, transformers' module cache as it
    derives it (HF_MODULES_CACHE, HF_HOME/modules, XDG_CACHE_HOME/huggingface/modules, ~/.cache/...) and FlashInfer's
    (FLASHINFER_WORKSPACE_BASE/.cache/flashinfer)."""
    dirs = {name: value for name, value in env.items()
            if value.startswith("/") and (name in CACHE_VARS or "CACHE" in name)}
    hf_home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                                  "huggingface")
    dirs["transformers modules"] = env.get("HF_MODULES_CACHE") or os.path.join(hf_home, "modules")
    if env.get("FLASHINFER_WORKSPACE_BASE"):
        dirs["flashinfer"] = os.path.join(env["FLASHINFER_WORKSPACE_BASE"], ".cache", "flashinfer")
    return dirs


def write_probe(directory: str, keep_as: str = "") -> str:
    """Create ``directory`` if need be, write and sync a file in it, then remove it (or rename it to ``keep_as``
    there); OSError says why not. Returns the file's last path."""
    os.makedirs(directory, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=directory, prefix=".hs-cache-check-")
    try:
        data = f"written by pid {os.getpid()} at {time.time():.3f}\n".encode()
        if os.write(fd, data) != len(data):
            raise OSError(f"short write to {path}")
        os.fsync(fd)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    if not keep_as:
        os.unlink(path)
        return path
    os.replace(path, kept := os.path.join(directory, keep_as))
    return kept


def cache_check(env: Mapping[str, str] | None = None) -> Check:
    dirs = cache_dirs(os.environ if env is None else env)
    bad = []
    for what, directory in sorted(dirs.items()):
        try:
            write_probe(directory)
        except OSError as e:
            bad.append(f"{what}={directory}: {e.strerror or e}")
    if bad:
        return Check("caches", False, f"{len(bad)} of {len(dirs)} cache dir(s) not writable: {'; '.join(bad)}",
                     CACHE_FIX)
    return Check("caches", True, f"{len(dirs)} cache dir(s) writable: {', '.join(sorted(set(dirs.values())))}")


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
                        "boot with iommu=pt (hs_iommu_passthrough: true: a GRUB drop-in and the play's reboot) or set "
                        "NCCL_P2P_DISABLE=1: P2P through a translating IOMMU hangs or crawls", warn=True))
    if os.geteuid() != 0:  # lspci shows the ACS capability to root only
        return checks + [Check("acs", True, "not read (needs root: the services role checks it as root)", warn=True)]
    rc, lspci = _run(["lspci", "-vvv"])
    redirect = acs_redirecting(lspci) if rc == 0 else []
    checks.append(Check("acs", rc == 0 and not (redirect and p2p_on),
                        (f"ACS redirects peer traffic on {len(redirect)} bridge(s): {', '.join(redirect[:8])}" if redirect
                         else "no ACS redirection") if rc == 0 else f"lspci -vvv failed: {lspci[-200:]}",
                        "disable ACS on those bridges (BIOS: PCIe ACS off; or hs_pcie_acs_disable: true, a boot unit "
                        "running setpci ECAP_ACS+0x6.w=0000), or set NCCL_P2P_DISABLE=1" if rc == 0
                        else "run as root with pciutils installed",
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


def _worker(rank: int, world: int, port: int, backend: str, device: str, mib: int, timeout: int) -> None:
    import torch
    import torch.distributed as dist

    dev = torch.device(f"cuda:{rank}") if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    time.sleep(float(os.environ.get("HS_GPU_READY_SLOW_START_S", "0")))  # the tests' fault: a cold host's start
    open(os.path.join(os.environ[READY_ENV], str(rank)), "w").close()  # on its device: the hang deadline may start
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    x = torch.full((mib << 18,), float(rank + 1), device=dev)
    # fault injection for the tests: a hung rank (HS_GPU_READY_STALL_P2P=1: only while P2P is on)
    if os.environ.get("HS_GPU_READY_STALL_RANK") == str(rank) and not (
            os.environ.get("HS_GPU_READY_STALL_P2P") == "1" and os.environ.get("NCCL_P2P_DISABLE") == "1"):
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


def _all_reduce(gpus: int, timeout: int, backend: str, device: str, mib: int,
                env: Mapping[str, str]) -> tuple[str, str]:
    """('ok', seconds) | ('hang', ranks killed) | ('failed', error) of one all-reduce over ``gpus`` processes."""
    with socket.socket() as s:  # a free port for the ranks' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mark = tempfile.mkdtemp(prefix="hs-gpu-ready-")
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "_worker", str(r), str(gpus), str(port),
                               backend, device, str(mib), str(timeout)], env={**os.environ, **env, READY_ENV: mark},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(gpus)]
    # the ranks' start (import torch, CUDA's init: long with 8 at once on a cold host) is not the all-reduce's time
    start_by = time.monotonic() + max(90, timeout)
    while len(os.listdir(mark)) < gpus and all(p.poll() is None for p in procs) and time.monotonic() < start_by:
        time.sleep(0.1)
    shutil.rmtree(mark, ignore_errors=True)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:  # our own children, by pid
            if p.poll() is None:
                p.kill()
            p.wait()
        return "hang", str([r for r, p in enumerate(procs) if p.returncode not in (0,)])
    outs = [(p.returncode, p.stdout.read(), p.stderr.read()) for p in procs]
    for r, (rc, _, err) in enumerate(outs):
        if rc != 0:
            return "failed", f"rank {r} failed (exit {rc}): {err.strip()[-800:]}"
    return "ok", f"{max(json.loads(o.strip().splitlines()[-1])['seconds'] for _, o, _ in outs):.3f}"


def nccl_check(gpus: int, timeout: int, *, backend: str = "nccl", device: str = "cuda", mib: int = 64,
               pcie: list[Check] | None = None) -> Check:
    env_used = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    state, said = _all_reduce(gpus, timeout, backend, device, mib, {})
    if state == "failed":
        return Check("nccl all-reduce", False, said, "read the error above (NCCL_DEBUG=INFO in hs_nccl_env shows more)")
    if state == "ok":
        return Check("nccl all-reduce", True, f"{mib} MiB over {gpus} {device.upper()}s in {float(said):.3f}s, sum "
                     f"correct; NCCL settings {env_used or 'defaults'}")
    risks = [c.detail for c in (pcie or []) if not c.ok]
    hang = (f"HANG: the all-reduce over {gpus} {device.upper()}s did not finish in {timeout}s (ranks {said} killed); "
            f"NCCL settings {env_used or 'none (defaults: P2P on)'}" + (f"; this host: {'; '.join(risks)}" if risks else ""))
    look = ("look for a GPU fallen off the bus or an Xid (nvidia-smi -q, dmesg), and run with NCCL_DEBUG=INFO in "
            "hs_nccl_env to see where it stops")
    if env_used.get("NCCL_P2P_DISABLE", "0") not in ("", "0"):
        return Check("nccl all-reduce", False, hang + "; P2P is off already, so the hang is not the P2P path's", look)
    # One more try with peer-to-peer off says whether the P2P path is the cause, and what to set.
    state, said = _all_reduce(gpus, timeout, backend, device, mib, {"NCCL_P2P_DISABLE": "1"})
    if state == "ok":
        return Check("nccl all-reduce", False, f"{hang}. With NCCL_P2P_DISABLE=1 it finished in {float(said):.3f}s: "
                     "the P2P path hangs here", "set hs_nccl_env: {NCCL_P2P_DISABLE: \"1\"} to serve now (traffic "
                     "through host memory, slower); to keep P2P, remove its cause and run the check again: " + HANG_HELP)
    return Check("nccl all-reduce", False, f"{hang}. With NCCL_P2P_DISABLE=1 it "
                 f"{'hung too' if state == 'hang' else 'failed: ' + said}: not only the P2P path", f"{look}; {HANG_HELP}")


def _nccl_over(gpus: int, timeout: int, backend: str, device: str, pcie: list[Check]) -> Check:
    """The all-reduce over ``gpus`` ranks (0: every visible GPU); asking more GPUs than CUDA sees fails."""
    if device == "cuda":
        import torch

        seen = torch.cuda.device_count()
        if gpus > seen:
            return Check("nccl all-reduce", False, f"{gpus} ranks asked (the tensor-parallel size), {seen} GPU(s) "
                         f"visible to CUDA", "look for a GPU fallen off the bus (nvidia-smi -L, dmesg for Xid), "
                         "CUDA_VISIBLE_DEVICES in the unit, and the device nodes /dev/nvidia0..N-1 (the unit makes "
                         "them with nvidia-modprobe as root); or set hs_tp_size to what the host has")
        gpus = gpus or seen
    return nccl_check(gpus or 2, timeout, backend=backend, device=device, pcie=pcie)


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        r, w, port, backend, device, mib, timeout = argv[1:8]
        _worker(int(r), int(w), int(port), backend, device, int(mib), int(timeout))
        return 0
    ap = argparse.ArgumentParser(prog="gpu_ready.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("checks", nargs="*", choices=["caches", "pcie", "jit", "nccl", []], default=[], metavar="CHECK",
                    help="caches, pcie, jit, nccl (default: all four)")
    ap.add_argument("--gpus", type=int, default=0, help="all-reduce ranks: the TP size (default: every GPU)")
    ap.add_argument("--timeout", type=int, default=180, help="seconds before the all-reduce counts as hung")
    ap.add_argument("--no-gpu", action="store_true", help="report pcie, jit and nccl as not checked")
    ap.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)  # gloo + cpu: the tests
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--nvidia-smi", default="nvidia-smi")
    ap.add_argument("--json", action="store_true", help="one JSON object per check")
    a = ap.parse_args(argv)
    want = a.checks or ["caches", "pcie", "jit", "nccl"]
    checks: list[Check] = [cache_check()] if "caches" in want else []
    if a.no_gpu:
        checks += [Check(name, True, "not checked: this host runs without GPU checks (sglang_service_gpu_checks is "
                         "false)", warn=True) for name in ("pcie", "jit", "nccl") if name in want]
        want = []
    pcie = pcie_checks(a.nvidia_smi) if "pcie" in want or "nccl" in want else []
    checks += pcie if "pcie" in want else []
    if "jit" in want:
        checks += jit_checks()
    if "nccl" in want:
        checks.append(_nccl_over(a.gpus, a.timeout, a.backend, a.device, pcie))
    for c in checks:
        if a.json:
            print(json.dumps(asdict(c)), flush=True)
        else:
            mark = "ok  " if c.ok else ("WARN" if c.warn else "FAIL")
            print(f"{mark} {c.name}: {c.detail}" + ("" if c.ok else f"\n     fix: {c.fix}"), flush=True)
    return 0 if all(c.ok or c.warn for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
