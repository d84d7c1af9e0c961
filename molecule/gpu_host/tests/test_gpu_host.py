"""State of the test host after the gpu_host role (via playbooks/provision.yml)."""

import json

import pytest

testinfra_hosts = ["ansible://gpu_hosts"]


def test_service_user_is_unprivileged(host):
    user = host.user("sglang")
    assert user.exists
    assert user.uid < 1000, "a system account"
    assert user.shell == "/usr/sbin/nologin"
    assert user.home == "/var/lib/sglang"
    assert host.file("/var/lib/sglang").is_directory
    assert user.group == "sglang"


def test_limits(host):
    limits = host.file("/etc/security/limits.d/90-hs-patch.conf")
    assert limits.mode == 0o644
    lines = {tuple(line.split()) for line in limits.content_string.splitlines() if line and not line.startswith("#")}
    assert ("sglang", "hard", "memlock", "unlimited") in lines
    assert ("sglang", "soft", "memlock", "unlimited") in lines
    assert ("sglang", "hard", "nofile", "1048576") in lines


def test_shm_sized_for_dump_budget(host):
    # budget 2 GiB + headroom 1 GiB (host_vars/gpu1.yml)
    out = host.check_output("python3 -c 'import os; s = os.statvfs(\"/dev/shm\"); print(s.f_blocks * s.f_frsize)'")
    assert int(out) == 3 * 1024**3
    fstab = host.file("/etc/fstab").content_string
    assert any(line.split()[:3] == ["tmpfs", "/dev/shm", "tmpfs"] and "size=3G" in line for line in fstab.splitlines()
               if line.strip() and not line.startswith("#"))


def test_dump_dir(host):
    d = host.file("/dev/shm/hs_capture")
    assert d.is_directory
    assert d.user == "sglang" and d.group == "sglang"
    assert d.mode == 0o750
    tmpfiles = host.file("/etc/tmpfiles.d/hs-patch.conf").content_string
    assert "d /dev/shm/hs_capture 0750 sglang sglang -" in tmpfiles
    # systemd-tmpfiles accepts the rule (recreates the dir at boot)
    host.run_test("systemd-tmpfiles --create /etc/tmpfiles.d/hs-patch.conf")


def test_persistence_mode_survives_a_restart_of_the_daemon(host):
    """Ubuntu's unit runs nvidia-persistenced --no-persistence-mode; the drop-in replaces ExecStart."""
    exec_start = host.check_output("systemctl show -p ExecStart --value nvidia-persistenced")
    assert "--persistence-mode" in exec_start and "--no-persistence-mode" not in exec_start
    assert host.service("nvidia-persistenced").is_enabled
    # what a reboot does: persistence off, the daemon started again by systemd
    host.run_test("echo Disabled > /var/lib/hs-test/persistence && systemctl restart nvidia-persistenced")
    rows = host.check_output("nvidia-smi --query-gpu=persistence_mode --format=csv,noheader").splitlines()
    assert rows == ["Enabled"] * 8


def test_persistence_mode_turned_on(host):
    rows = host.check_output("nvidia-smi --query-gpu=index,persistence_mode --format=csv,noheader").splitlines()
    assert len(rows) == 8
    assert all(r.endswith("Enabled") for r in rows)


@pytest.mark.parametrize("pkg", ["rsync", "python3-venv", "acl", "openssh-client"])
def test_base_packages(host, pkg):
    assert host.package(pkg).is_installed


def test_fake_gpus_back_to_eight(host):
    conf = json.loads(host.file("/etc/hs-test/fake-gpus.json").content_string)
    assert conf["count"] == 8
