"""The Ansible bundle's tests: linters, syntax, pre-flight checks, the test-host lab, and every molecule scenario.

The molecule scenarios (molecule/<role>/) boot real SSH test hosts with
tests/lab/testhosts.py, so they need root, systemd-nspawn, debootstrap and the
network to the Debian mirror and PyPI once (both cached under
/var/cache/hs-patch-tests afterwards). Install with
``bash scripts/install.sh`` as root (README).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lab.local_play import run_local_play

# The scenarios' test hosts share 198.51.100.0/24 and the lab tests' gateways are one too: one lab at a
# time, so those tests run on one of the suite's workers (`-n 2 --dist loadgroup`), and ansible-lint with
# them (it and molecule prepare the same ansible-compat cache). The pre-flight and dry-run tests (local
# connection, ~4 minutes) go to whichever worker is free: the scenarios alone are the longest worker's load.
LAB = pytest.mark.xdist_group("lab-198.51.100")

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = sorted(p.parent.name for p in (ROOT / "molecule").glob("*/molecule.yml"))
ROLES = sorted(p.name for p in (ROOT / "roles").iterdir() if (p / "tasks/main.yml").exists())
BIN = Path(sys.executable).parent
SCENARIO_TIMEOUT_S = 1200  # the longest (sglang_service) takes about 520 s on a quiet 2-core VM, twice that busy


def _tool(name: str) -> str:
    """The tool installed next to this Python (pip install -e '.[test]'), else from PATH."""
    cand = BIN / name
    return str(cand) if cand.exists() else (shutil.which(name) or name)


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment, colours off (the tests read the tools' output), and ``extra``."""
    return {**os.environ, "PY_COLORS": "0", "ANSIBLE_FORCE_COLOR": "0", "NO_COLOR": "1", **(extra or {})}


def _run(cmd: list[str], timeout: int = 900, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=kw.pop("cwd", ROOT), capture_output=True, text=True, timeout=timeout,
                          env=_env(kw.pop("env", {})), check=False, **kw)


def _tail(proc: subprocess.CompletedProcess, n: int = 80) -> str:
    return "\n".join((proc.stdout + proc.stderr).splitlines()[-n:])


def _lab_prereqs() -> str | None:
    if os.geteuid() != 0:
        return "test hosts need root"
    missing = [t for t in ("systemd-nspawn", "debootstrap", "ip", "ssh") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)}: run sudo bash scripts/install-deps.sh"
    return None


# --- static checks -------------------------------------------------------------------


def test_every_role_has_a_scenario_and_argument_specs():
    assert set(ROLES) == {"gpu_host", "sglang", "hs_patch", "sglang_service", "sample_shipping"}
    assert "default" in SCENARIOS, "molecule test (no -s) needs molecule/default"
    for role in ROLES:
        assert role in SCENARIOS, f"no molecule scenario for role {role}"
        specs = yaml.safe_load((ROOT / "roles" / role / "meta/argument_specs.yml").read_text())
        options = specs["argument_specs"]["main"]["options"]
        defaults = yaml.safe_load((ROOT / "roles" / role / "defaults/main.yml").read_text())
        assert set(options) == set(defaults), f"{role}: argument_specs and defaults/main.yml disagree"
        for name, spec in options.items():
            assert name.startswith(role + "_"), f"{role}: variable {name} is not role-prefixed"
            assert spec["description"] and spec["description"] != name, f"{role}: {name} undocumented"


def test_every_apt_task_waits_for_apts_lock():
    """A freshly booted Ubuntu host runs unattended-upgrades first and holds apt's lock for minutes; ansible's apt
    module gives up after 60 s by default. Every apt task of every role waits its role's lock timeout."""

    def apt_tasks(tasks: list) -> list[dict]:
        found = []
        for task in tasks or []:
            found += apt_tasks(task.get("block", []) + task.get("rescue", []) + task.get("always", []))
            if "ansible.builtin.apt" in task:
                found.append(task)
        return found

    seen = 0
    for role in ROLES:
        for path in sorted((ROOT / "roles" / role / "tasks").glob("*.yml")):
            for task in apt_tasks(yaml.safe_load(path.read_text())):
                seen += 1
                assert task["ansible.builtin.apt"].get("lock_timeout") == f"{{{{ {role}_apt_lock_timeout }}}}", \
                    f"{path.relative_to(ROOT)}: {task['name']!r} does not wait for apt's lock"
    assert seen >= 10


def test_yamllint():
    proc = _run([_tool("yamllint"), "--strict", "."])
    assert proc.returncode == 0, _tail(proc)


@LAB
def test_the_lab_group_holds_on_the_workers(request):
    """The README's test command (`-n 2 --dist loadgroup`) keeps a group's tests on one worker only while
    xdist can mark them (pytest 9 silently broke that: the labs then ran on both workers at once)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None or not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not a worker of `--dist loadgroup` (the README's test command)")
    assert request.node.nodeid.endswith("@lab-198.51.100"), \
        f"{request.node.nodeid}: xdist did not group it: pytest and pytest-xdist versions that group (pyproject.toml)"


@LAB
def test_ansible_lint_production_profile():
    proc = _run([_tool("ansible-lint"), "--profile", "production"], timeout=600)
    assert proc.returncode == 0, _tail(proc)
    assert "Profile 'production' was required, and it passed" in proc.stdout + proc.stderr


def test_site_syntax_check():
    proc = _run([_tool("ansible-playbook"), "site.yml", "--syntax-check"])
    assert proc.returncode == 0, _tail(proc)


def test_site_runs_the_readiness_checks_unless_skipped():
    """site.yml alone never started the server, so the GPU/JIT/NCCL checks never ran: the services stage
    ends with them (tag readiness), and --skip-tags readiness is the way to leave them out."""
    listed = _run([_tool("ansible-playbook"), "site.yml", "--list-tasks"])
    skipped = _run([_tool("ansible-playbook"), "site.yml", "--list-tasks", "--skip-tags", "readiness"])
    assert listed.returncode == 0 and skipped.returncode == 0, _tail(listed) + _tail(skipped)
    task = "sglang_service : Check the host is ready to start the server (readiness)"
    assert task in listed.stdout and task not in skipped.stdout
    checks = (ROOT / "roles/sglang_service/tasks/readiness.yml").read_text()
    assert "gpu-ready" in checks and "['jit', 'nccl']" in checks  # the checks it runs: caches, then JIT and NCCL


def _tasks(tasks: list) -> list:
    """Every task of a list, those inside block/rescue/always too."""
    out = []
    for t in tasks:
        out.append(t)
        for key in ("block", "rescue", "always"):
            out += _tasks(t.get(key, []))
    return out


def test_upgrade_runs_the_roles_as_the_stage_playbooks_do():
    """upgrade.yml hands the sglang and sglang_service roles what sglang.yml and services.yml hand them, but
    for the upgrade's own settings: a drift would upgrade a host to a release configured unlike site.yml's."""
    def stage(playbook: str, role: str) -> dict:
        plays = yaml.safe_load((ROOT / "playbooks" / playbook).read_text())
        (entry,) = [r for p in plays for r in p.get("roles", []) if r["role"] == role]
        return {k: v for k, v in entry.items() if k != "role"}

    plays = yaml.safe_load((ROOT / "playbooks/upgrade.yml").read_text())
    tasks = _tasks([t for p in plays for t in p.get("tasks", [])])
    imports = {t["ansible.builtin.import_role"]["name"]: t.get("vars", {}) for t in tasks
               if "ansible.builtin.import_role" in t and "tasks_from" not in t["ansible.builtin.import_role"]}
    assert imports["sglang"] == {**stage("sglang.yml", "sglang"), "sglang_activate": False}
    assert imports["sglang_service"] == {**stage("services.yml", "sglang_service"), "sglang_service_start": True}
    assert imports["hs_patch"] == {"hs_patch_venv": "{{ hs_upgrade_new_venv }}", "hs_patch_state": "patched"}


# --- pre-flight ----------------------------------------------------------------------------


@pytest.fixture
def local_inventory(tmp_path: Path) -> Path:
    """gpu_hosts = this machine over the local connection, with the production group_vars."""
    inv = tmp_path / "inventory"
    inv.mkdir()
    (inv / "group_vars").symlink_to(ROOT / "inventory" / "group_vars")
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    # the managed storage host the pre-flight reaches: this machine too
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {
        "gpu_hosts": {"hosts": {"preflight-local": local}},
        "training_storage": {"hosts": {"storage-local": local}}}}}))
    return inv


def _preflight(inv: Path, tmp_path: Path, extra: dict) -> subprocess.CompletedProcess:
    # Fits this machine's memory and disk and names a storage host: the defaults are for the GPU host.
    base = {"hs_dump_budget_gib": 1, "hs_shm_headroom_gib": 1, "hs_storage_host": "storage-local",
            "hs_space_model_gib": 1, "hs_model_revision": "0123456789abcdef0123456789abcdef01234567",
            # the roles' platform, and this machine's (Debian 12 or Ubuntu 24.04, README's Install)
            "hs_platforms": ["Ubuntu 24.04 x86_64", "Debian 12 x86_64"]}
    varfile = tmp_path / "extra.json"
    varfile.write_text(json.dumps({**base, **extra}))
    return _run([_tool("ansible-playbook"), "-i", str(inv), "-e", f"@{varfile}", "playbooks/preflight.yml"],
                timeout=300)


def test_preflight_accepts_the_defaults(local_inventory, tmp_path):
    proc = _preflight(local_inventory, tmp_path, {})
    assert proc.returncode == 0, _tail(proc)
    assert "failed=0" in proc.stdout


@pytest.mark.parametrize("extra, message", [
    ({"hs_sglang_version": "0.5.8"}, "naming a release hs-patch supports"),
    ({"hs_sglang_version": "0.5.24"}, "naming a release hs-patch supports"),
    ({"hs_sglang_version": 0.6}, "must be a quoted string"),
    ({"hs_sglang_install_source": "conda"}, "must be pypi or wheelhouse"),
    ({"hs_sglang_install_source": "wheelhouse", "hs_sglang_wheelhouse": "/nonexistent/wh"},
     "is not an absolute path to a directory on the control node"),
    ({"hs_sglang_install_source": "wheelhouse", "hs_sglang_wheelhouse": "wheelhouse"},
     "is not an absolute path to a directory on the control node"),
    ({"hs_model_path": "models/kimi"}, "hs_model_path must be an absolute path"),
    ({"hs_dump_dir": "/dev/shm/my dumps"}, "hs_dump_dir must be an absolute path without spaces"),
    ({"hs_model_architecture": "LlamaForCausalLM"}, "is not served by SGLang's deepseek_v2.py"),
    ({"hs_tp_size": 3}, "hs_tp_size a power of two"),
    ({"hs_tp_size": 16}, "hs_tp_size a power of two no larger than it"),
    ({"hs_gpu_count": "8"}, "hs_gpu_count must be an integer"),
    ({"hs_capture_layers": [2, 2, 58]}, "distinct non-negative integers"),
    ({"hs_capture_layers": "2,30,58,60"}, "hs_capture_layers must be a non-empty list"),
    ({"hs_capture_final": "after"}, "hs_capture_final one of pre, post, both, none"),
    ({"hs_dump_budget_gib": 100000}, "fit in 80% of"),
    ({"hs_server_port": 80}, "hs_server_port must be an integer 1024-65535"),
    ({"hs_nvidia_driver_branch": "570"}, "580 or newer (NVIDIA supports the RTX PRO 6000 from R580"),
    ({"hs_service_user": "root"}, "not root"),
    ({"hs_nccl_env": {"P2P_DISABLE": "1"}}, "hs_nccl_env must map NCCL_* names to values"),
    ({"hs_nccl_env": "NCCL_P2P_DISABLE=1"}, "hs_nccl_env must map NCCL_* names to values"),
    ({"hs_venv_releases_dir": "venvs"}, "hs_venv_releases_dir an absolute path"),
    ({"hs_runs_samples_root": "/dev/shm/hs runs"}, "hs_runs_samples_root must be an absolute path without spaces"),
    ({"hs_runs_state_root": "/var/lib/hs\truns"}, "hs_runs_state_root must be an absolute path without spaces"),
    ({"hs_dump_dir": "relative/capture"}, "hs_dump_dir must be an absolute path"),
    ({"hs_storage_host": ""}, "set hs_storage_host"),
    ({"hs_storage_managed": False}, "hs_storage_host_key to its SSH host key"),
    # not in the inventory, and a name that never resolves (RFC 6761): nothing is contacted
    ({"hs_storage_host": "storage.invalid"}, "The control node cannot reach the storage host storage.invalid"),
    ({"hs_s3_url": "s3://Bad_Bucket/p"}, "Shipping goes to a bucket (hs_s3_url) but its settings are off"),
    ({"hs_s3_url": "s3://hs-runs/p", "hs_s3_endpoint": "https://k:s@s3.lab"}, "without credentials in it"),
    ({"hs_s3_url": "s3://hs-runs/p", "hs_s3_access_key_id": "AK"}, "both set (from the vault) or both empty"),
    ({"sglang_service_host": "0.0.0.0"}, "set sglang_service_allow_non_loopback: true"),
    ({"sglang_service_host": "198.51.100.10"}, "the SGLang server would answer every host"),
    ({"hs_space_venv_gib": -1}, "whole numbers of GiB"),
    ({"hs_space_model_gib": 100000}, "Not enough disk space on preflight-local"),
    ({"hs_space_model_gib": 100000}, "model 100000.0 GiB (/models/Kimi-K2.5)"),
    ({"hs_platforms": ["Ubuntu 24.04 aarch64"]}, "the roles provision Ubuntu 24.04 aarch64 (hs_platforms)"),
    ({"hs_model_revision": ""}, "hub needs hs_model_revision, the commit of moonshotai/Kimi-K2.5 to serve"),
    ({"hs_model_revision": "main"}, "pin the one you validated, as the hub's main moves"),
    ({"hs_model_source": "s3"}, "hs_model_source must be hub, http, rsync or none"),
    ({"hs_model_source": "http"}, "http and rsync need hs_model_mirror_url"),
    ({"hs_iommu_passthrough": "yes"}, "hs_iommu_passthrough and hs_pcie_acs_disable true or false"),
])
def test_preflight_refuses_bad_inventory(local_inventory, tmp_path, extra, message):
    proc = _preflight(local_inventory, tmp_path, extra)
    assert proc.returncode != 0, f"{extra} was accepted"
    flat = " ".join((proc.stdout + proc.stderr).split())
    assert message in flat, _tail(proc)


def test_preflight_lets_an_exposed_server_through_only_when_allowed(local_inventory, tmp_path):
    proc = _preflight(local_inventory, tmp_path, {"sglang_service_host": "0.0.0.0",
                                                  "sglang_service_allow_non_loopback": True})
    assert proc.returncode == 0, _tail(proc)


def test_preflight_takes_a_bucket_without_a_storage_host(local_inventory, tmp_path):
    proc = _preflight(local_inventory, tmp_path, {"hs_storage_host": "", "hs_s3_url": "s3://hs-runs/kimi",
                                                  "hs_s3_endpoint": "https://s3.lab:9000", "hs_s3_addressing": "path"})
    assert proc.returncode == 0, _tail(proc)


def test_preflight_skips_storage_when_shipping_is_off(local_inventory, tmp_path):
    proc = _preflight(local_inventory, tmp_path, {"hs_storage_host": "", "hs_ship_enabled": False})
    assert proc.returncode == 0, _tail(proc)


def test_a_dry_run_on_a_fresh_host_passes_the_driver_checks_and_a_real_run_keeps_them(tmp_path):
    """README's first command, `ansible-playbook site.yml --check --diff`, on a fresh host: the driver is only
    simulated there, so no package, no module and no nvidia-smi exist yet. The kernel-module and GPU checks stopped
    that dry run ("The driver package ... is not installed", "nvidia-smi failed"); in check mode they now say what
    a real run checks, and a real run still refuses a host without them."""
    boot = tmp_path / "boot"
    boot.mkdir()
    (boot / "vmlinuz-6.8.0-31-generic").write_text("")
    play = tmp_path / "fresh.yml"
    play.write_text(yaml.safe_dump([{
        "name": "The gpu_host checks on a host without a driver", "hosts": "localhost", "gather_facts": False,
        "vars": {"gpu_host_boot_dir": str(boot), "gpu_host_modinfo": str(tmp_path / "no-modinfo"),
                 "gpu_host_nvidia_userspace_package": "hs-test-no-such-driver-package",
                 "gpu_host_nvidia_smi": str(tmp_path / "no-nvidia-smi"),
                 "gpu_host_nvidia_version_file": str(tmp_path / "no-version-file")},
        "tasks": [{"name": f"Run {f}", "ansible.builtin.include_role": {"name": "gpu_host", "tasks_from": f}}
                  for f in ("kernel-modules.yml", "gpu-checks.yml")]}]))
    dry = run_local_play(play, "--check", cwd=ROOT)
    assert dry.returncode == 0, _tail(dry)
    flat = " ".join(dry.stdout.split())
    assert "Check mode: hs-test-no-such-driver-package is not installed yet" in flat, _tail(dry)
    assert "no-nvidia-smi does not answer yet" in flat, _tail(dry)
    real = run_local_play(play, cwd=ROOT)
    assert real.returncode != 0
    assert "The driver package hs-test-no-such-driver-package is not installed" in " ".join(real.stdout.split()), \
        _tail(real)


def test_a_dry_run_on_a_fresh_host_passes_the_shipping_stage_before_its_user_exists(tmp_path):
    """The same dry run reached the shipping stage and stopped there: gpu_host's creation of the service user is
    only simulated, and sample_shipping refused the missing user. In check mode it says what a real run sets up;
    a real run still refuses a missing user (nothing is contacted: the storage host's name never resolves)."""
    play = tmp_path / "ship.yml"
    play.write_text(yaml.safe_dump([{
        "name": "sample_shipping before its user exists", "hosts": "localhost", "gather_facts": False,
        "roles": [{"role": "sample_shipping", "sample_shipping_user": "hs-test-no-such-user",
                   "sample_shipping_storage_host": "storage.invalid"}]}]))
    dry = run_local_play(play, "--check", cwd=ROOT)
    assert dry.returncode == 0, _tail(dry)
    assert "Check mode: user hs-test-no-such-user does not exist yet" in " ".join(dry.stdout.split()), _tail(dry)
    real = run_local_play(play, cwd=ROOT)
    assert real.returncode != 0
    assert "User hs-test-no-such-user does not exist on localhost" in " ".join(real.stdout.split()), _tail(real)


def test_a_dry_run_on_a_fresh_host_passes_the_services_stage_before_nvidia_modprobe_exists(tmp_path):
    """The same dry run reached the services stage and stopped there: gpu_host's install of nvidia-modprobe is only
    simulated on a fresh host, and sglang_service asserted it. In check mode it says what a real run needs; a real
    run still refuses a host without it."""
    play = tmp_path / "modprobe.yml"
    missing = tmp_path / "no-nvidia-modprobe"
    play.write_text(yaml.safe_dump([{
        "name": "sglang_service's nvidia-modprobe check on a fresh host", "hosts": "localhost", "gather_facts": False,
        "tasks": [{"name": "Run it", "ansible.builtin.include_role": {"name": "sglang_service",
                                                                      "tasks_from": "nvidia-modprobe.yml"},
                   "vars": {"sglang_service_nvidia_modprobe": str(missing)}}]}]))
    dry = run_local_play(play, "--check", cwd=ROOT)
    assert dry.returncode == 0, _tail(dry)
    assert f"Check mode: {missing} is not there yet; a real run needs it" in " ".join(dry.stdout.split()), _tail(dry)
    real = run_local_play(play, cwd=ROOT)
    assert real.returncode != 0
    assert f"{missing} is missing: the unit runs it as root" in " ".join(real.stdout.split()), _tail(real)


def test_a_dry_run_on_a_fresh_host_says_the_model_download_cannot_be_listed_yet(tmp_path):
    """docs/deployment.md promised that a dry run lists what the model stage downloads (hs-model fetch --plan); on
    a fresh host hs-model is not installed yet (the patch stage is simulated), and the stage skipped it silently."""
    play = tmp_path / "model.yml"
    play.write_text(yaml.safe_dump([{
        "name": "sglang_service's model stage on a fresh host", "hosts": "localhost", "gather_facts": False,
        "tasks": [{"name": "Run it", "ansible.builtin.include_role": {"name": "sglang_service",
                                                                      "tasks_from": "model.yml"},
                   "vars": {"sglang_service_venv": str(tmp_path / "no-venv"), "sglang_service_model_source": "hub",
                            "sglang_service_model_repo": "moonshotai/Kimi-K2.5",
                            "sglang_service_model_revision": "a" * 40,
                            "sglang_service_model_path": str(tmp_path / "models/Kimi-K2.5")}}]}]))
    dry = run_local_play(play, "--check", cwd=ROOT)
    assert dry.returncode == 0, _tail(dry)
    assert (f"Check mode: {tmp_path}/no-venv/bin/hs-model is not installed yet (the patch stage installs it), so this "
            f"dry run cannot list the download; a real run places moonshotai/Kimi-K2.5@{'a' * 40} at "
            f"{tmp_path}/models/Kimi-K2.5") in " ".join(dry.stdout.split()), _tail(dry)


# --- the test-host lab ----------------------------------------------------------------------


@LAB
@pytest.mark.slow
def test_testhosts_up_down_leaves_nothing(tmp_path):
    """Two hosts reach each other over SSH, one reboots and comes back; down removes every netns, link, mount
    and process."""
    if reason := _lab_prereqs():
        pytest.skip(reason)
    from lab.testhosts import Lab

    def snapshot():
        netns = set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()
        links = set(_run(["ip", "-o", "link", "show"]).stdout.split("\n"))
        links = {line.split(":")[1].strip().split("@")[0] for line in links if line.strip()}
        mounts = {line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()}
        # iproute2's first 'ip netns add' on a machine bind-mounts /run/netns onto itself and
        # keeps it (by design, for every later netns): not something a lab leaves behind
        return netns, links, mounts - {"/run/netns"}

    before = snapshot()
    lab = Lab(tmp_path / "lab")
    try:
        old_umask = os.umask(0o077)  # a hardened shell's umask must not lock the guests' daemons out
        try:
            # its own network: the end-to-end tests' labs (203.0.113.0/26) may be up beside it
            desc = lab.up([("gpu", "203.0.113.74"), ("storage", "203.0.113.75")], gateway="203.0.113.65/26")
        finally:
            assert os.umask(old_umask) == 0o077, "up restores the caller's umask"
        assert [h["address"] for h in desc["hosts"]] == ["203.0.113.74", "203.0.113.75"]
        state = lab.load()
        lab_id = state["id"]
        pids = [h["pid"] for h in state["hosts"]]
        # the lab belongs to this test process (tests/conftest.py): were it killed, the next up removes the lab
        assert state["owner"]["pid"] == os.getpid() and not lab.orphaned()
        assert lab.ssh("gpu", "hostname").stdout.strip() == "gpu"
        assert lab.ssh("storage", "systemctl is-system-running", check=False).stdout.strip() in ("running", "degraded")
        # host to host over the lab bridge (storage's sshd answers; no key needed to prove reachability)
        probe = lab.ssh("gpu", "python3 -c \"import socket; s = socket.create_connection(('storage', 22), 5); "
                               "print(s.recv(64).decode().split('-')[0])\"", check=False)
        assert probe.stdout.strip() == "SSH", probe.stderr
        # one pinned host key per host (the lab keeps strict host key checking on)
        known = Path(desc["known_hosts"]).read_text()
        assert known.count("ssh-ed25519") == 2
        # a reboot (Ansible's reboot module does this) brings the host back as a machine comes back: a new
        # boot id, /run emptied, the disk kept, the same recorded pid (lab/boot_loop.py boots it again)
        boot = lab.ssh("gpu", "touch /run/booted /root/kept; cat /proc/sys/kernel/random/boot_id").stdout.strip()
        lab.ssh("gpu", "systemctl reboot", check=False)
        nspawn = set(_run(["pgrep", "-g", str(pids[0])]).stdout.split())
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            again = lab.ssh("gpu", "cat /proc/sys/kernel/random/boot_id", check=False)
            if again.returncode == 0 and again.stdout.strip() != boot:
                break
            time.sleep(1)
        assert again.stdout.strip() != boot, "the host did not come back from its reboot"
        assert lab.ssh("gpu", "ls /run/booted /root/kept", check=False).stdout.split() == ["/root/kept"]
        assert [h["pid"] for h in lab.load()["hosts"]] == pids and lab.running()
        nspawn |= set(_run(["pgrep", "-g", str(pids[0])]).stdout.split())
    finally:
        lab.down()
    after = snapshot()
    # every name a lab makes carries its id (hsb<id>, hs<id>-<host>, hsv<id><n>) and its mounts lie in
    # its state dir: other labs up and down beside this one (the suite's other worker) are not counted
    ours = [{n for n in a - b if lab_id in n or str(tmp_path) in n} for a, b in zip(after, before)]
    assert not ours[0], f"network namespaces left behind: {ours[0]}"
    assert not ours[1], f"network links left behind: {ours[1]}"
    assert not ours[2], f"mounts left behind: {ours[2]}"
    for pid in pids + [int(p) for p in nspawn]:  # the boot loops and every systemd-nspawn they ran
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert not (tmp_path / "lab" / "lab.json").exists()


@LAB
def test_lab_waits_for_a_busy_gateway_then_names_its_owner(tmp_path, monkeypatch):
    """Two labs on one gateway would collide: up waits for the other to go, and says whose it is."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and ip")
    import ipaddress
    import threading

    from lab import gateway

    gw = ipaddress.ip_interface("203.0.113.129/25")  # a gateway no lab of this project uses
    bridge = f"hsbw{os.getpid() % 0xffff:04x}"
    assert _run(["ip", "link", "add", bridge, "type", "bridge"]).returncode == 0
    try:
        assert _run(["ip", "addr", "add", str(gw), "dev", bridge]).returncode == 0
        gateway.OWNERS_DIR.mkdir(parents=True, exist_ok=True)
        (gateway.OWNERS_DIR / bridge).write_text(f"{tmp_path}/other-lab\n")
        monkeypatch.setattr(gateway, "GATEWAY_WAIT_S", 1)
        with pytest.raises(gateway.LabError, match=f"{bridge} \\(lab in {tmp_path}/other-lab\\)"):
            with gateway.gateway_claimed(gw):
                pytest.fail("claimed a gateway another lab holds")
        monkeypatch.setattr(gateway, "GATEWAY_WAIT_S", 60)
        threading.Timer(3, lambda: _run(["ip", "link", "del", bridge])).start()
        started = time.monotonic()
        with gateway.gateway_claimed(gw):
            waited = time.monotonic() - started
            assert not gateway.gateway_user(gw)
        assert waited >= 2, "claimed before the other lab went"
    finally:
        _run(["ip", "link", "del", bridge])  # gone already when the timer ran
        (gateway.OWNERS_DIR / bridge).unlink(missing_ok=True)


@LAB
def test_lab_removes_a_dead_or_orphaned_lab_on_its_gateway_and_waits_for_a_live_one(tmp_path, monkeypatch):
    """A lab left by a killed run (no host process alive, or hosts alive but the recorded owner gone) is
    removed by its own ids; a running one whose owner lives is waited for."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and ip")
    import ipaddress

    from lab import gateway
    from lab.hostcmd import proc_start_time
    from lab.gateway import OWNER_ENV
    from lab.testhosts import Lab, reclaim_dead_lab

    gw = ipaddress.ip_interface("203.0.113.129/25")  # a gateway no lab of this project uses
    tag = f"{os.getpid() % 0xffff:04x}"
    bridge, netns = f"hsbd{tag}", f"hsd{tag}-gpu"
    # long enough to outlive the other worker's lab holding the labs' lock (its boot: up to minutes); killed below
    sleeper = subprocess.Popen(["sleep", "600"])
    orphan_host = subprocess.Popen(["sleep", "600"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    me = {"pid": os.getpid(), "start": proc_start_time(os.getpid())}

    def lab_holding_gateway(host_pid: int, host_start: str | None, owner: dict | None = None) -> Path:
        state_dir = tmp_path / f"lab-{host_pid}"
        state_dir.mkdir()
        assert _run(["ip", "link", "add", bridge, "type", "bridge"]).returncode == 0
        assert _run(["ip", "addr", "add", str(gw), "dev", bridge]).returncode == 0
        assert _run(["ip", "netns", "add", netns]).returncode == 0
        gateway.OWNERS_DIR.mkdir(parents=True, exist_ok=True)
        (gateway.OWNERS_DIR / bridge).write_text(f"{state_dir}\n")
        host = {"name": "gpu", "address": "203.0.113.130", "netns": netns, "veth": f"hsvd{tag}",
                "dir": str(state_dir / "hosts" / "gpu"), "mounted": False, "netns_created": True,
                "pid": host_pid, "pid_start": host_start, "machine": f"hsd{tag}-gpu"}
        (state_dir / "lab.json").write_text(json.dumps({"id": tag, "gateway": str(gw), "bridge": bridge,
                                                         "bridge_created": True, "owner": owner, "hosts": [host]}))
        return state_dir

    monkeypatch.setenv(OWNER_ENV, str(dead.pid))  # an owner that is not a running process is refused
    with pytest.raises(gateway.LabError, match=f"{OWNER_ENV}='{dead.pid}' is not a running process"):
        Lab(tmp_path / "refused").up([("gpu", "203.0.113.130")], gateway=str(gw))
    assert not (tmp_path / "refused" / "lab.json").exists()
    monkeypatch.undo()
    try:
        # live: its host process runs and its owner (this process) lives, so it is waited for (here: 1 s)
        # and named, and left alone
        live = lab_holding_gateway(sleeper.pid, proc_start_time(sleeper.pid), owner=me)
        assert Lab(live).running() and not Lab(live).orphaned()
        monkeypatch.setattr(gateway, "GATEWAY_WAIT_S", 1)
        with pytest.raises(gateway.LabError, match=f"{bridge} \\(lab in {live}\\)"):
            with gateway.gateway_claimed(gw, reclaim=reclaim_dead_lab):
                pytest.fail("claimed the gateway of a lab whose host runs")
        assert Path("/run/netns", netns).exists() and (live / "lab.json").exists()
        Lab(live).down()  # as its owner would: stops the host by its recorded pid
        assert sleeper.wait(timeout=10) is not None
        assert not Path("/run/netns", netns).exists() and not gateway.gateway_user(gw)

        # dead: its host's pid is gone, so the next up removes it at once and claims the gateway
        # (GATEWAY_WAIT_S is still 1: a lab waited for raises; the time taken is the other test worker's, which
        # holds the labs' lock while its own lab boots, so it is not measured)
        gone = lab_holding_gateway(dead.pid, "0")
        assert not Lab(gone).running()
        with gateway.gateway_claimed(gw, reclaim=reclaim_dead_lab):
            assert not gateway.gateway_user(gw)
        assert not Path("/run/netns", netns).exists(), "the dead lab's netns was left"
        assert _run(["ip", "link", "show", bridge]).returncode != 0, "the dead lab's bridge was left"
        assert not (gone / "lab.json").exists() and not (gateway.OWNERS_DIR / bridge).exists()

        # orphaned: its host runs but the owner it recorded is gone, so it is removed at once, its host
        # stopped by the recorded pid
        orphan = lab_holding_gateway(orphan_host.pid, proc_start_time(orphan_host.pid),
                                     owner={"pid": dead.pid, "start": "0"})
        assert Lab(orphan).running() and Lab(orphan).orphaned()
        with gateway.gateway_claimed(gw, reclaim=reclaim_dead_lab):
            assert not gateway.gateway_user(gw)
        assert orphan_host.wait(timeout=10) is not None, "the orphaned lab's host was left running"
        assert not Path("/run/netns", netns).exists() and not (orphan / "lab.json").exists()
    finally:
        for proc in (sleeper, orphan_host):
            proc.kill()
            proc.wait()
        _run(["ip", "netns", "del", netns])
        _run(["ip", "link", "del", bridge])
        (gateway.OWNERS_DIR / bridge).unlink(missing_ok=True)


# --- molecule scenarios -----------------------------------------------------------------------


def _stop_and_destroy(molecule: subprocess.Popen, args: list[str], path: str) -> tuple[str, str, str]:
    """Stop a molecule run and destroy its test host, which a killed molecule never does and which would hold
    the lab's gateway (the next scenario would wait for it instead of running). molecule, the ansible-playbook
    under it and their ssh sessions are one process group (started in a session of its own): all go."""
    os.killpg(molecule.pid, signal.SIGKILL)
    try:
        stdout, stderr = molecule.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # something it started in a session of its own still holds the pipes
        stdout, stderr = "", "(molecule's output could not be read after it was stopped)"
    destroy = _run([_tool("molecule"), "destroy", *args], timeout=300, env={"PATH": path})
    return stdout, stderr, f"its test host destroyed: exit {destroy.returncode}"


@LAB
@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_molecule_scenario(scenario):
    """destroy, syntax, create, prepare, check, converge, idempotence, side_effect, verify, destroy."""
    if reason := _lab_prereqs():
        pytest.skip(reason)
    started = time.monotonic()
    # the default scenario exactly as typed at the repository root: `molecule test`
    args = [] if scenario == "default" else ["--scenario-name", scenario]
    env = _env({"PATH": f"{BIN}:{os.environ.get('PATH', '')}"})
    molecule = subprocess.Popen([_tool("molecule"), "test", *args], cwd=ROOT, env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = molecule.communicate(timeout=SCENARIO_TIMEOUT_S)
    except BaseException as exc:  # its time is up, or the run is being stopped (Ctrl-C)
        stdout, stderr, destroyed = _stop_and_destroy(molecule, args, env["PATH"])
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        pytest.fail(f"molecule {scenario} ran past {SCENARIO_TIMEOUT_S}s and was stopped ({destroyed}); where it "
                    "was:\n" + _tail(subprocess.CompletedProcess([], -9, stdout, stderr), 150))
    proc = subprocess.CompletedProcess(molecule.args, molecule.returncode, stdout, stderr)
    took = time.monotonic() - started
    print(f"molecule {scenario}: {took:.0f}s")
    assert proc.returncode == 0, _tail(proc, 150)
    out = proc.stdout + proc.stderr
    # default: site.yml whole, fast; check mode and negative cases are the role scenarios' job.
    # upgrade: its dry run is upgrade.yml --check, in the side effect (molecule/upgrade/molecule.yml).
    steps = ("converge", "idempotence", "verify") if scenario == "default" else \
        ("converge", "idempotence", "side_effect", "verify") if scenario == "upgrade" else \
        ("check", "converge", "idempotence", "side_effect", "verify")
    for step in steps:
        assert f"{scenario} > {step}: Executed: Successful" in out, f"{scenario}: step {step} did not run successfully"
    if scenario == "sample_shipping":  # its side effect ships to a bucket: the role never shows the secret
        assert "TASK [Assert the sample is at the store, verified, and gone here]" in out, "the bucket part did not run"
        assert "molecule-s3-secret-7f3a9c" not in out, "the S3 secret key reached the output"
