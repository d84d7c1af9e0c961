"""The host readiness check (hs_patch/host/readiness/gpu_ready.py) the services role, the unit and fab run.

The NCCL all-reduce orchestration runs for real here with torch's gloo backend on CPU
(the same processes, rendezvous, sum check and timeout; a stalled rank stands in for the
P2P hang), the PCIe/IOMMU/ACS readers on recorded tool output, and the JIT toolchain
lookup on a CUDA_HOME without nvcc and with one of the wrong CUDA major. On GPU hosts
the same script runs with NCCL and a real nvcc (docs/verification.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hs_patch.host.readiness import gpu_ready as gr

SCRIPT = Path(gr.__file__)

TOPO = """\
\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity
GPU0\t X \tPIX\tNODE\tSYS\t0-31\t0
GPU1\tPIX\t X \tNODE\tSYS\t0-31\t0
GPU2\tNODE\tNODE\t X \tSYS\t0-31\t0
GPU3\tSYS\tSYS\tSYS\t X \t32-63\t1
"""

LSPCI = """\
00:01.1 PCI bridge: Advanced Micro Devices, Inc. [AMD] Starship/Matisse GPP Bridge
\t\tACSCap:\tSrcValid+ TransBlk+ ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-
\t\tACSCtl:\tSrcValid+ TransBlk- ReqRedir+ CmpltRedir+ UpstreamFwd+ EgressCtrl- DirectTrans-
41:00.0 PCI bridge: Broadcom / LSI PEX890xx PCIe Gen 5 Switch
\t\tACSCtl:\tSrcValid- TransBlk- ReqRedir- CmpltRedir- UpstreamFwd- EgressCtrl- DirectTrans-
c1:00.0 VGA compatible controller: NVIDIA Corporation Device 2bb5
"""


def test_readers_of_topology_acs_and_iommu(tmp_path):
    assert gr.topo_links(TOPO) == {"PIX": 1, "NODE": 2, "SYS": 3}
    assert gr.acs_redirecting(LSPCI) == ["00:01.1"]
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/cmdline").write_text("BOOT_IMAGE=/vmlinuz root=/dev/sda1 quiet\n")
    assert gr.iommu_state(str(tmp_path))[0] == "off"
    (tmp_path / "sys/class/iommu/dmar0").mkdir(parents=True)
    assert gr.iommu_state(str(tmp_path))[0] == "translated"
    (tmp_path / "proc/cmdline").write_text("BOOT_IMAGE=/vmlinuz intel_iommu=on iommu=pt\n")
    assert gr.iommu_state(str(tmp_path))[0] == "passthrough"


def test_all_reduce_over_processes_checks_the_sum():
    c = gr.nccl_check(2, 120, backend="gloo", device="cpu", mib=4)
    assert c.ok, c.detail
    assert "4 MiB over 2 CPUs" in c.detail and "sum correct" in c.detail


def test_a_hung_all_reduce_is_reported_as_a_hang_with_the_likely_cause(monkeypatch):
    monkeypatch.setenv("HS_GPU_READY_STALL_RANK", "1")
    monkeypatch.setenv("NCCL_P2P_LEVEL", "SYS")
    risk = gr.Check("acs", False, "ACS redirects peer traffic on 1 bridge(s): 00:01.1", warn=True)
    started = time.monotonic()
    c = gr.nccl_check(2, 8, backend="gloo", device="cpu", mib=1, pcie=[risk])
    took = time.monotonic() - started
    assert not c.ok
    assert c.detail.startswith("HANG: the all-reduce over 2 CPUs did not finish in 8s")
    assert "'NCCL_P2P_LEVEL': 'SYS'" in c.detail and "00:01.1" in c.detail
    assert "nccl#1999" in c.fix and "NCCL_P2P_DISABLE" in c.fix and "iommu=pt" in c.fix
    # P2P was on: one more try with NCCL_P2P_DISABLE=1 hung too, so it is not only the P2P path
    assert "With NCCL_P2P_DISABLE=1 it hung too: not only the P2P path" in c.detail
    assert 16 <= took < 45, took  # bounded by the timeout, twice, the stalled ranks killed each time


def test_a_hang_with_p2p_on_only_says_p2p_off_works_and_what_to_set(monkeypatch):
    """The B2 case (ACS or a translating IOMMU): the all-reduce hangs with P2P on and finishes with it
    off. The check still fails (the server would hang with the settings it has) and says what to set."""
    monkeypatch.setenv("HS_GPU_READY_STALL_RANK", "1")
    monkeypatch.setenv("HS_GPU_READY_STALL_P2P", "1")  # the stalled rank hangs only while P2P is on
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    # the ranks' start (import torch: over 6 s on a loaded CI host) is not counted in the 8 s
    c = gr.nccl_check(2, 8, backend="gloo", device="cpu", mib=1)
    assert not c.ok
    assert c.detail.startswith("HANG: the all-reduce over 2 CPUs did not finish in 8s")
    assert "With NCCL_P2P_DISABLE=1 it finished in" in c.detail and "the P2P path hangs here" in c.detail
    assert c.fix.startswith('set hs_nccl_env: {NCCL_P2P_DISABLE: "1"} to serve now')
    assert "hs_pcie_acs_disable" in c.fix and "hs_iommu_passthrough" in c.fix
    # with P2P already off there is nothing more to try: one attempt, said so
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    monkeypatch.setenv("HS_GPU_READY_STALL_P2P", "0")
    started = time.monotonic()
    c = gr.nccl_check(2, 6, backend="gloo", device="cpu", mib=1)
    assert not c.ok and "P2P is off already" in c.detail and time.monotonic() - started < 20


def test_the_cli_prints_json_and_exits_non_zero_on_a_hang():
    env = {**os.environ, "HS_GPU_READY_STALL_RANK": "0"}
    p = subprocess.run([sys.executable, str(SCRIPT), "nccl", "--gpus", "2", "--timeout", "6", "--backend", "gloo",
                        "--device", "cpu", "--nvidia-smi", "/nonexistent/nvidia-smi", "--json"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stderr
    (check,) = [json.loads(line) for line in p.stdout.splitlines()]
    assert check["name"] == "nccl all-reduce" and check["ok"] is False and "HANG" in check["detail"]


def test_jit_check_names_a_missing_nvcc_and_a_cuda_major_torch_was_not_built_for(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
    (c,) = gr.jit_checks()
    assert not c.ok and c.name == "nvcc" and "CUDA_HOME" in c.fix
    nvcc = tmp_path / "cuda/bin/nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 12.0, V12.0.140'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", "/nonexistent")  # no ninja either
    checks = {c.name: c for c in gr.jit_checks()}
    assert checks["nvcc"].ok and "CUDA 12.0" in checks["nvcc"].detail and "via $CUDA_HOME" in checks["nvcc"].detail
    assert not checks["ninja"].ok and "venv's bin/ first" in checks["ninja"].fix
    # this machine's torch is the CPU build: no CUDA major matches
    assert not checks["cuda major"].ok
    assert "jit compile" not in checks


@pytest.mark.parametrize("var", ["CUDA_HOME", "CUDA_PATH"])
def test_cuda_home_lookup_follows_tvm_ffi_and_flashinfer(var, monkeypatch):
    for v in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, "/opt/cuda-x")
    assert gr.find_cuda_home() == ("/opt/cuda-x", f"${var}")


# --- caches: what the sandboxed server writes ------------------------------------------------------


def test_caches_check_writes_into_each_cache_and_names_the_one_it_cannot(tmp_path):
    blocked = tmp_path / "a-file"  # a directory under a file cannot exist: the write fails as under ProtectSystem
    blocked.write_text("x")
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "TVM_FFI_CACHE_DIR": str(blocked / "tvm-ffi"),
           "FLASHINFER_WORKSPACE_BASE": str(tmp_path / "cache"), "SGLANG_VLM_CACHE_SIZE_MB": "512", "PATH": "/usr/bin"}
    c = gr.cache_check(env)
    assert not c.ok
    assert c.detail.startswith("1 of 5 cache dir(s) not writable: TVM_FFI_CACHE_DIR=" + str(blocked / "tvm-ffi"))
    assert "sglang_service_read_write_paths" in c.fix and "sglang_service_cache_dir" in c.fix
    # the others were made and written, and no probe file is left behind
    for d in ("cache", "cache/huggingface/modules", "cache/.cache/flashinfer"):
        assert (tmp_path / d).is_dir() and not list((tmp_path / d).glob(".hs-cache-check-*")), d
    env["TVM_FFI_CACHE_DIR"] = str(tmp_path / "cache" / "tvm-ffi")
    c = gr.cache_check(env)
    assert c.ok and c.detail.startswith("5 cache dir(s) writable: "), c.detail


@pytest.mark.parametrize("env", [{"XDG_CACHE_HOME": "X"}, {"XDG_CACHE_HOME": "X", "HF_HOME": "X/hf"},
                                 {"HF_HOME": "X/hf", "HF_MODULES_CACHE": "X/modules"}, {}])
def test_the_transformers_module_cache_is_where_transformers_puts_it(env, tmp_path, monkeypatch):
    """Kimi's tokenizer is remote code: transformers creates HF_MODULES_CACHE at load, derived as
    the check derives it (read from transformers itself, in a clean interpreter)."""
    env = {k: v.replace("X", str(tmp_path)) for k, v in env.items()}
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("XDG_CACHE_HOME", "HF_HOME", "HF_MODULES_CACHE"):
        monkeypatch.delenv(name, raising=False)
    out = subprocess.run([sys.executable, "-c", "from transformers.utils.hub import HF_MODULES_CACHE as m; print(m)"],
                         env={**os.environ, **env}, capture_output=True, text=True, timeout=120, check=True)
    assert gr.cache_dirs(env)["transformers modules"] == out.stdout.strip()


def test_without_gpus_only_the_caches_are_checked(tmp_path):
    p = subprocess.run([sys.executable, str(SCRIPT), "caches", "jit", "nccl", "--no-gpu", "--json"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "c"), "HF_HOME": str(tmp_path / "c/hf")})
    assert p.returncode == 0, p.stderr
    checks = {c["name"]: c for c in map(json.loads, p.stdout.splitlines())}
    assert checks["caches"]["ok"] and not checks["caches"]["warn"]
    assert all(checks[n]["warn"] and "not checked" in checks[n]["detail"] for n in ("jit", "nccl"))


def test_an_all_reduce_over_more_gpus_than_cuda_sees_fails(tmp_path):
    """The unit passes --gpus <tp size>: a host where CUDA sees fewer (a GPU off the bus, a missing
    /dev/nvidiaN) fails at once instead of an all-reduce over whatever is visible. torch's CPU build
    here sees no GPU."""
    p = subprocess.run([sys.executable, str(SCRIPT), "nccl", "--gpus", "8", "--nvidia-smi", "/nonexistent/nvidia-smi",
                        "--json"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    c = [json.loads(x) for x in p.stdout.splitlines() if '"nccl all-reduce"' in x][0]
    assert c["detail"] == "8 ranks asked (the tensor-parallel size), 0 GPU(s) visible to CUDA"
    assert "/dev/nvidia0..N-1" in c["fix"] and "hs_tp_size" in c["fix"]


def test_a_slow_start_of_the_ranks_is_not_taken_for_a_hang(monkeypatch):
    """Eight ranks importing torch and starting CUDA at once on a cold host take seconds each: the hang deadline
    counted that start, so a short --timeout called a healthy host hung."""
    monkeypatch.setenv("HS_GPU_READY_SLOW_START_S", "6")
    c = gr.nccl_check(2, 4, backend="gloo", device="cpu", mib=1)
    assert c.ok, c.detail
