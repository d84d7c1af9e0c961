#!/usr/bin/env python3
"""Try the whole flow without a GPU host, in a few minutes (run as root).

    python3 tests/lab/demo.py            # up, provision, extract, ship, check, tear down
    python3 tests/lab/demo.py --keep     # leave the hosts up to look around; later:
    python3 tests/lab/demo.py --down

1. boots two local test hosts (tests/lab/testhosts.py: Debian 12, real systemd, real SSH, in
   their own network namespace): ``gpu`` (203.0.113.40) and ``storage`` (203.0.113.41);
2. runs ``ansible-playbook site.yml`` against them with a generated inventory: the GPU
   steps are faked (an ``nvidia-smi`` printing 8 RTX PRO 6000 rows, an ``nvidia-modprobe`` that logs, a
   ``mokutil`` saying Secure Boot is off, no driver install),
   SGLang 0.5.9 comes from a wheelhouse and is patched and verified, the server unit runs
   the STAND-IN server (tests/lab/standin_server.py: not SGLang; it runs the deepseek_v2.py
   Ansible just patched, on a tiny random DeepseekV3, through the real capture hook);
3. runs ``fab extract`` on the bundled dataset (examples/data/tiny_chat.jsonl) with the
   live dashboard, shipping to the storage host; the dataset holds bad lines ON PURPOSE
   (bad JSON, not UTF-8, no assistant turn, ...: examples/data/README.md), which the
   dashboard counts as rejected, each in the run's rejects.jsonl with its line and reason;
4. copies the destination back and checks every sample (size, sha256, tensors, loss
   mask), and that the dump and samples dirs on the GPU host are empty;
5. tears everything down (unless ``--keep``).

Wheels are cached in /var/cache/hs-patch-tests (the first run downloads ~250 MB: torch
CPU, transformers). The end-to-end tests (tests/end_to_end/test_e2e.py) use the same ``Demo``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE.parent), str(ROOT)]  # run as a script: `lab` and the checkout's hs_patch importable

from lab import wheelhouse_dir  # noqa: E402
from lab.hostcmd import file_locked, tools_of_this_python  # noqa: E402
from lab.rootfs import CACHE_DIR  # noqa: E402
from lab.testhosts import STOP_TIMEOUT_S, Lab  # noqa: E402

# Its own network (not the molecule scenarios' 198.51.100.0/24): a demo or an end-to-end test can
# run beside them (the suite's two workers do).
GATEWAY = "203.0.113.1/26"
GPU, STORAGE = ("gpu", "203.0.113.40"), ("storage", "203.0.113.41")
SGLANG = "0.5.9"
VENV = "/opt/hs-patch/venv"
STANDIN_DIR = "/opt/hs-patch/standin"
# the stand-in server and what it imports, copied as the package lab/ (run as {STANDIN_DIR}/lab/standin_server.py)
STANDIN_FILES = ("__init__.py", "standin_server.py", "standin_engine.py", "standin_requests.py", "standin_spec.py",
                 "sglang_sim.py", "hf_reference.py", "sglang_wheels.py", "hostcmd.py")
STANDIN_NEEDS = ("torch==2.13.0", "transformers", "safetensors", "requests", "pyyaml")
MODEL = "/models/tiny"
EXAMPLE = ROOT / "examples" / "data" / "tiny_chat.jsonl"

# What the test hosts need instead of the production defaults (the rest comes from
# inventory/group_vars/gpu_hosts.yml, copied as it is).
GPU_VARS = {
    "hs_storage_host": STORAGE[0], "hs_dump_budget_gib": 2, "hs_shm_headroom_gib": 1,
    "gpu_host_nvidia_driver_install": False, "gpu_host_apt_cache_valid_time": 0,
    "gpu_host_cuda_toolkit_install": False, "gpu_host_kernel_module_check": False,
    "gpu_host_nvidia_persistenced_service": False, "sglang_check_torch": False, "sglang_service_gpu_checks": False,
    "gpu_host_nvidia_smi": "/usr/local/bin/nvidia-smi", "gpu_host_nvidia_version_file": "/etc/hs-test/nvidia-version",
    "gpu_host_mokutil": "/usr/local/bin/mokutil", "sglang_service_nvidia_modprobe": "/usr/local/bin/nvidia-modprobe",
    "hs_sglang_install_source": "wheelhouse", "hs_sglang_wheelhouse": str(CACHE_DIR / "wheelhouse"),
    "sglang_pip_no_deps": True, "hs_model_path": MODEL, "hs_model_architecture": "DeepseekV3ForCausalLM",
    "hs_capture_layers": [1, 2, 3], "sglang_service_restart_sec": 1,
    "sglang_service_launcher": f"{VENV}/bin/python {STANDIN_DIR}/lab/standin_server.py --installed-sglang "
                               "--write-caches --chunked-prefill-size 256",
    "sample_shipping_apt_cache_valid_time": 0,
}


def say(msg: str) -> None:
    print(f"\n=== demo: {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    print("+ " + shlex.join(cmd), flush=True)
    kw.setdefault("stdin", subprocess.DEVNULL)  # see Demo.fab
    return subprocess.run(cmd, check=True, **kw)


class Demo:
    """Test hosts provisioned by site.yml (``gpus``, one storage host), and fab pointed at them."""

    def __init__(self, state_dir: str | Path, gpus: tuple[tuple[str, str], ...] = (GPU,),
                 storage: tuple[str, str] = STORAGE):
        self.dir = Path(state_dir)
        self.lab = Lab(self.dir / "lab")
        self.inventory = self.dir / "inventory"
        self.gpus, self.storage = list(gpus), storage

    # ------------------------------------------------------------------ hosts
    def up(self) -> None:
        say("booting the test hosts")
        self.lab.up([*self.gpus, self.storage], gateway=GATEWAY)
        self._write_inventory()

    def down(self) -> bool:
        """Stop and remove the hosts and the generated inventory; False if nothing was there."""
        had = bool(self.lab.load()) or self.inventory.exists()
        self.lab.down()
        shutil.rmtree(self.inventory, ignore_errors=True)
        for d in (self.dir / "lab", self.dir):
            try:
                d.rmdir()  # only if nothing else is left in it
            except OSError:
                pass
        return had

    def _write_inventory(self) -> None:
        lab = self.lab.ansible_inventory()["all"]["hosts"]
        hosts = {"all": {"children": {"gpu_hosts": {"hosts": {g: lab[g] for g, _ in self.gpus}},
                                      "training_storage": {"hosts": {self.storage[0]: lab[self.storage[0]]}}}}}
        (self.inventory / "group_vars").mkdir(parents=True, exist_ok=True)
        (self.inventory / "host_vars").mkdir(exist_ok=True)
        (self.inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
        shutil.copy(ROOT / "inventory" / "group_vars" / "gpu_hosts.yml", self.inventory / "group_vars")
        for g, _ in self.gpus:
            host_vars = {**GPU_VARS, "hs_storage_host": self.storage[0]}
            (self.inventory / "host_vars" / f"{g}.yml").write_text(yaml.safe_dump(host_vars, sort_keys=False))

    def ssh(self, host: str, command: str, check: bool = True, timeout: int = 300) -> subprocess.CompletedProcess:
        return self.lab.ssh(host, command, check=check, timeout=timeout)

    def rsync(self, src: str, dest: str) -> None:
        d = self.lab.describe()
        ssh = (f"ssh -i {d['key']} -o IdentitiesOnly=yes -o BatchMode=yes -o StrictHostKeyChecking=yes "
               f"-o UserKnownHostsFile={d['known_hosts']} -l root")
        run(["rsync", "-a", "-e", ssh, src, dest], stdout=subprocess.DEVNULL)

    def addr(self, host: str) -> str:
        return dict([*self.gpus, self.storage])[host]

    # ------------------------------------------------------------------ provisioning
    def provision(self) -> None:
        say("wheels for the test hosts (cached)")
        wheelhouse_dir.build(CACHE_DIR / "wheelhouse", SGLANG)  # the builder's layout: <pin>/ with its lock
        standin = CACHE_DIR / "standin-wheels"
        with file_locked(CACHE_DIR / ".standin-wheels.lock"):
            if not (standin / ".complete").exists():
                run([sys.executable, "-m", "pip", "download", "-q", "-d", str(standin), *STANDIN_NEEDS])
                (standin / ".complete").touch()
        say("fake GPUs, the tiny model and the stand-in server on the GPU test host(s)")
        with tempfile.TemporaryDirectory() as tmp:
            from lab.tiny_model import make_tiny_model_dir

            make_tiny_model_dir(Path(tmp) / "tiny")
            for gpu, _ in self.gpus:
                self._gpu_host_files(gpu, Path(tmp) / "tiny", standin)
        say("ansible-playbook site.yml")
        env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
        run(["ansible-playbook", "-i", str(self.inventory), str(ROOT / "site.yml")], cwd=ROOT, env=env)
        say("the stand-in server's dependencies into the venv (a real host has them with SGLang)")
        pip = f"{VENV}/bin/pip install -q --no-index --find-links {STANDIN_DIR}/wheels " + " ".join(
            shlex.quote(x) for x in STANDIN_NEEDS)
        with ThreadPoolExecutor(len(self.gpus)) as pool:  # test set-up only: the hosts install at once
            list(pool.map(lambda g: self.ssh(g[0], pip, timeout=900), self.gpus))

    def _gpu_host_files(self, gpu: str, tiny: Path, standin: Path) -> None:
        """Fake GPUs, the tiny model and the stand-in server's files on one GPU test host."""
        self.ssh(gpu, f"mkdir -p /etc/hs-test /usr/local/bin {MODEL} {STANDIN_DIR}/wheels {STANDIN_DIR}/lab")
        gpus = {"count": 8, "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "driver": "580.95.05"}
        self.ssh(gpu, f"echo {shlex.quote(json.dumps(gpus))} > /etc/hs-test/fake-gpus.json && "
                      "printf 'NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release "
                      "Build\\n' > /etc/hs-test/nvidia-version")
        for fake in ("nvidia-smi", "nvidia-modprobe", "mokutil"):  # Secure Boot off, as no mokutil state says
            self.rsync(str(ROOT / "molecule" / "shared" / "files" / f"fake-{fake}"),
                       f"{self.addr(gpu)}:/usr/local/bin/{fake}")
        self.ssh(gpu, "chmod 0755 /usr/local/bin/nvidia-smi /usr/local/bin/nvidia-modprobe /usr/local/bin/mokutil")
        self.rsync(f"{tiny}/", f"{self.addr(gpu)}:{MODEL}/")
        self.ssh(gpu, f"chmod -R a+rX {MODEL}")  # save_pretrained writes weights 0600
        for f in STANDIN_FILES:
            self.rsync(str(HERE / f), f"{self.addr(gpu)}:{STANDIN_DIR}/lab/{f}")
        self.rsync(f"{standin}/", f"{self.addr(gpu)}:{STANDIN_DIR}/wheels/")

    # ------------------------------------------------------------------ fab
    def fab(self, *args: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        cmd = ["fab", *args, "--host", self.gpus[0][0], "--inventory", str(self.inventory),
               "--known-hosts", self.lab.describe()["known_hosts"]]
        print("+ " + shlex.join(cmd), flush=True)
        kw.setdefault("timeout", 1200)  # bounded: a fab that never returns fails the test instead of hanging it
        # its own stdin: an ssh killed earlier can leave an inherited one non-blocking, which Ansible refuses
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(cmd, cwd=ROOT, check=check, **kw)

    def fetch_destination(self, run_name: str, dest: Path) -> Path:
        """Copy the run's destination from the storage host (to check it here)."""
        self.rsync(f"{self.addr(self.storage[0])}:/srv/hs-samples/{run_name}/", f"{dest}/")
        return dest


def bad_lines_on_purpose(path: Path = EXAMPLE) -> dict[int, str]:
    """Line -> reason of each line of the example dataset the driver rejects (examples/data/README.md)."""
    from hs_patch.host.driver import dataset

    return {r.line: r.reason for r in dataset.read([str(path)]) if isinstance(r, dataset.Reject)}


def check_destination(dest: Path, expected_ids: set[str] | None = None) -> dict:
    """0 lost, 0 duplicated, 0 truncated at the destination: every file listed once, verified."""
    from hs_patch import reader, store

    entries = store.read_jsonl(dest / store.MANIFEST)
    keys = [e["key"] for e in entries if e.get("op") == "add"]
    assert len(keys) == len(set(keys)), "a sample is listed twice at the destination"
    rep = reader.check_dir(dest, deep=True)
    assert rep.clean, f"destination: bad={rep.bad} missing={rep.missing} unlisted={rep.unlisted}"
    ids = {reader.read_sample(dest / e["file"]).metadata["sample_id"] for e in store.read_manifest(dest).values()}
    if expected_ids is not None:
        assert ids == expected_ids, f"lost {sorted(expected_ids - ids)[:5]}, unexpected {sorted(ids - expected_ids)[:5]}"
    return {"samples": len(ids), "bytes": rep.nbytes, "tokens": rep.tokens}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state-dir", default="/tmp/hs-demo", help="where the lab and the inventory live")
    ap.add_argument("--keep", action="store_true", help="leave the test hosts running at the end")
    ap.add_argument("--down", action="store_true", help="only tear down a kept demo")
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        sys.exit("demo: run as root (network namespaces and systemd-nspawn)")
    tools_of_this_python()  # ansible-playbook and fab from .venv/bin, activated or not
    demo = Demo(a.state_dir)
    if a.down:
        t0 = time.monotonic()
        if demo.down():
            print(f"demo: torn down in {time.monotonic() - t0:.0f}s: test hosts stopped, their network, mounts and "
                  f"the inventory removed from {a.state_dir}")
        else:
            print(f"demo: nothing to tear down in {a.state_dir}")
        return 0
    ok = False
    try:
        demo.up()
        demo.provision()
        bad = bad_lines_on_purpose()
        say(f"fab extract (live dashboard; Ctrl-C only detaches) on {EXAMPLE.relative_to(ROOT)}: {len(bad)} of its "
            f"lines are bad ON PURPOSE (lines {', '.join(map(str, sorted(bad)))}: {', '.join(sorted(set(bad.values())))}; "
            "examples/data/README.md), so the dashboard counts them as rejected, each in the run's rejects.jsonl "
            "with its line and reason")
        out = demo.fab("extract", "--dataset", str(EXAMPLE), "--run", "demo", check=False)
        # fab exits 1 when the run does not hold every line: here exactly the bad lines, said in its last lines
        assert out.returncode == 1, f"fab extract exited {out.returncode}: the run should miss only the bad lines"
        say("checking the samples at the destination")
        with tempfile.TemporaryDirectory() as tmp:
            res = check_destination(demo.fetch_destination("demo", Path(tmp)))
        left = demo.ssh(GPU[0], "find /dev/shm/hs_capture /dev/shm/hs-runs -name '*.safetensors' | wc -l").stdout
        assert left.strip() == "0", f"{left.strip()} sample files left on the GPU host"
        print(f"demo: {res['samples']} samples, {res['tokens']} tokens, {res['bytes']} bytes at the destination, "
              f"all verified; nothing left in the dump and samples dirs; the {len(bad)} rejected lines are the "
              "example's bad lines, there on purpose")
        ok = True
    finally:
        if a.keep:
            print(f"demo: hosts kept; fab --help status, then: python3 tests/lab/demo.py --down "
                  f"(inventory: {demo.inventory}, known_hosts: {demo.lab.describe().get('known_hosts')})")
        else:
            say(f"tearing down (the test hosts shut down, up to {STOP_TIMEOUT_S}s)")
            t0 = time.monotonic()
            demo.down()
            print(f"demo: torn down in {time.monotonic() - t0:.0f}s", flush=True)
        print(f"\n=== demo: {'done: every sample verified at the destination' if ok else 'FAILED (see above)'}",
              flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
