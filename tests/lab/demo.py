#!/usr/bin/env python3
"""Try the whole flow without a GPU host, in a few minutes (run as root).

    python3 tests/lab/demo.py            # up, provision, extract, ship, check, tear down
    python3 tests/lab/demo.py --keep     # leave the hosts up to look around; later:
    python3 tests/lab/demo.py --down

1. boots two local test hosts (tests/lab/testhosts.py: Debian 12, real systemd, real SSH, in
   their own network namespace): ``gpu`` (203.0.113.40) and ``storage`` (203.0.113.41);
2. runs ``ansible-playbook site.yml`` once against them, with the shipped
   ``inventory/group_vars/gpu_hosts.yml`` and only what the lab must change (``GPU_VARS``): the GPU
   host stands in for a fresh one whose NVIDIA driver is installed but not loaded (stand-in dpkg
   packages: an ``nvidia-smi`` printing 8 RTX PRO 6000 rows once the "module" is loaded, an
   ``nvidia-modprobe`` that logs, a ``mokutil`` saying Secure Boot is off), so the play reboots it for
   real and goes on; SGLang 0.5.9 comes from a wheelhouse (with the stand-in server's torch and
   transformers in its lock) and is patched and verified; the model stage downloads a tiny random
   DeepseekV3 from a local stand-in of the Hugging Face hub (tests/lab/fake_hub.py, on this machine's
   lab address) and verifies every file; the services stage starts the server unit, which runs the
   STAND-IN server (tests/lab/standin_server.py: not SGLang; it runs the deepseek_v2.py Ansible just
   patched, through the real capture hook), and waits for its health check;
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
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE.parent), str(ROOT)]  # run as a script: `lab` and the checkout's hs_patch importable

from lab import wheelhouse_dir  # noqa: E402
from lab.fake_hub import COMMIT, FakeHub  # noqa: E402
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
EXAMPLE = ROOT / "examples" / "data" / "tiny_chat.jsonl"
WHEELHOUSE = CACHE_DIR / "wheelhouse-standin"  # sglang's lock and the stand-in server's wheels
STANDIN_WHEELS = CACHE_DIR / "standin-wheels"
HUB_REPO = "hs-test/tiny"

# What the test hosts need instead of the shipped defaults; everything else comes from
# inventory/group_vars/gpu_hosts.yml, copied as it is (hs_reboot_allowed, the server started and
# enabled at the end of the run, the health wait, the model check, the roles' defaults). Each line
# says why the lab cannot keep the default.
GPU_VARS = {
    # the lab's platform: Debian 12 test hosts (tests/lab/rootfs.py), no GPU, no network beyond the lab
    "hs_platforms": ["Debian 12 x86_64"],
    # the GPU fakes' paths: the kernel's files the stand-in driver cannot put where the kernel does
    "gpu_host_nvidia_version_file": "/run/hs-test/nvidia-version",
    "gpu_host_nvidia_module_version_file": "/run/hs-test/nvidia-module-version",
    "gpu_host_modinfo": "/usr/local/bin/modinfo",
    # nvidia-modprobe comes with the CUDA toolkit (not installed here): a stand-in that logs its calls
    "sglang_service_nvidia_modprobe": "/usr/local/bin/nvidia-modprobe",
    # no Ubuntu or NVIDIA archive: the stand-in driver came as dpkg packages, no CUDA toolkit, no apt refresh
    "gpu_host_nvidia_driver_install": False, "gpu_host_cuda_toolkit_install": False,
    "gpu_host_apt_cache_valid_time": 0, "sample_shipping_apt_cache_valid_time": 0,
    # no PyPI on the test hosts: the wheelhouse (README's "Hosts without internet")
    "hs_sglang_install_source": "wheelhouse", "hs_sglang_wheelhouse": str(WHEELHOUSE),
    # no GPU: CPU torch in the venv, no JIT or all-reduce check, the stand-in server in SGLang's place
    "sglang_check_torch": False, "sglang_service_gpu_checks": False,
    "sglang_service_launcher": f"{VENV}/bin/python {STANDIN_DIR}/lab/standin_server.py --installed-sglang "
                               "--write-caches --chunked-prefill-size 256",
    # the tiny model instead of Kimi-K2.5 (the hub's address is the lab's: provision() adds it)
    "hs_model_repo": HUB_REPO, "hs_model_revision": COMMIT, "hs_model_architecture": "DeepseekV3ForCausalLM",
    "hs_capture_layers": [1, 2, 3], "hs_space_model_gib": 1,
    # the test hosts' memory
    "hs_dump_budget_gib": 2, "hs_shm_headroom_gib": 1,
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

    def _write_inventory(self, more: dict | None = None) -> None:
        lab = self.lab.ansible_inventory()["all"]["hosts"]
        hosts = {"all": {"children": {"gpu_hosts": {"hosts": {g: lab[g] for g, _ in self.gpus}},
                                      "training_storage": {"hosts": {self.storage[0]: lab[self.storage[0]]}}}}}
        (self.inventory / "group_vars").mkdir(parents=True, exist_ok=True)
        (self.inventory / "host_vars").mkdir(exist_ok=True)
        (self.inventory / "hosts.yml").write_text(yaml.safe_dump(hosts, sort_keys=False))
        shutil.copy(ROOT / "inventory" / "group_vars" / "gpu_hosts.yml", self.inventory / "group_vars")
        for g, _ in self.gpus:
            host_vars = {**GPU_VARS, "hs_storage_host": self.storage[0], **(more or {})}
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
        """One ``ansible-playbook site.yml`` on fresh hosts, nothing by hand in between: the GPU hosts
        reboot to load the (stand-in) driver, download the model from the (stand-in) hub and end serving."""
        say("wheels for the test hosts (cached)")
        with file_locked(CACHE_DIR / ".standin-wheels.lock"):
            if not (STANDIN_WHEELS / ".complete").exists():
                run([sys.executable, "-m", "pip", "download", "-q", "-d", str(STANDIN_WHEELS), *STANDIN_NEEDS])
                (STANDIN_WHEELS / ".complete").touch()
        wheelhouse_dir.build(WHEELHOUSE, SGLANG, extra=STANDIN_WHEELS)  # the builder's layout: <pin>/, its lock
        say("the stand-in driver (installed, not loaded: the play reboots), GPUs and server on the GPU test host(s)")
        for gpu, _ in self.gpus:
            self._gpu_host_files(gpu)
        self.boot_ids = {gpu: self.boot_id(gpu) for gpu, _ in self.gpus}  # the boot site.yml starts in
        with tempfile.TemporaryDirectory() as tmp:
            from lab.tiny_model import make_tiny_model_dir

            hub = FakeHub(make_tiny_model_dir(Path(tmp) / "tiny"), HUB_REPO, bind=GATEWAY.split("/")[0])
            try:
                self._write_inventory({"hs_model_hub_endpoint": hub.url})
                say(f"ansible-playbook site.yml (the model from the stand-in hub at {hub.url})")
                env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
                run(["ansible-playbook", "-i", str(self.inventory), str(ROOT / "site.yml")], cwd=ROOT, env=env)
            finally:
                hub.close()

    def boot_id(self, host: str) -> str:
        return self.ssh(host, "cat /proc/sys/kernel/random/boot_id").stdout.strip()

    def site(self, *args: str) -> subprocess.CompletedProcess:
        """``ansible-playbook site.yml`` on the lab's inventory again (its output captured)."""
        env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg")}
        return subprocess.run(["ansible-playbook", "-i", str(self.inventory), str(ROOT / "site.yml"), *args], cwd=ROOT,
                              env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1800)

    def _gpu_host_files(self, gpu: str) -> None:
        """The stand-in driver and GPUs, and the stand-in server's files, on one GPU test host."""
        lib = "/usr/local/lib/hs-test"
        self.ssh(gpu, f"mkdir -p /etc/hs-test {lib} /usr/local/bin {STANDIN_DIR}/lab")
        gpus = {"count": 8, "name": "NVIDIA RTX PRO 6000 Blackwell Server Edition", "driver": "580.95.05",
                "module_file": GPU_VARS["gpu_host_nvidia_module_version_file"]}
        self.ssh(gpu, f"echo {shlex.quote(json.dumps(gpus))} > /etc/hs-test/fake-gpus.json")
        files = ROOT / "molecule" / "shared" / "files"
        for fake in ("fake-nvidia-driver", "fake-nvidia-smi", "fake-nvidia-persistenced", "fake-mokutil"):
            self.rsync(str(files / fake), f"{self.addr(gpu)}:{lib}/{fake}")
        for fake in ("modinfo", "nvidia-modprobe"):
            self.rsync(str(files / f"fake-{fake}"), f"{self.addr(gpu)}:/usr/local/bin/{fake}")
        # installed as dpkg packages, the module not loaded until the next boot (a fresh host after apt install)
        self.ssh(gpu, "chmod 0755 /usr/local/bin/modinfo /usr/local/bin/nvidia-modprobe && "
                      f"python3 {lib}/fake-nvidia-driver")
        for f in STANDIN_FILES:
            self.rsync(str(HERE / f), f"{self.addr(gpu)}:{STANDIN_DIR}/lab/{f}")

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
    from hs_patch.samples import reader, store

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
