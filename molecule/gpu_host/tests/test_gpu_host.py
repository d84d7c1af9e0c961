"""State of the test host after the gpu_host role (via playbooks/provision.yml)."""

import json
import time

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
    # the unit is Type=simple: `systemctl restart` returns once the daemon is forked, before it has set the
    # mode (a loaded CI host saw "Disabled" here); wait for it, at most 30 s
    for _ in range(60):
        rows = host.check_output("nvidia-smi --query-gpu=persistence_mode --format=csv,noheader").splitlines()
        if rows == ["Enabled"] * 8:
            break
        time.sleep(0.5)
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


# needrestart's own decision (needrestart 3.6, the loop over $nrconf{override_rc} after reading
# /etc/needrestart/conf.d/*.conf): the first regex that matches the unit name decides, 0 = leave it.
NEEDRESTART = r"""
our %nrconf = (defno => 0, override_rc => {});
do $ARGV[0]; die "parse: $@" if $@;
for my $rc (@ARGV[1..$#ARGV]) {
    my $restart = !$nrconf{defno};
    foreach my $re (sort keys %{$nrconf{override_rc}}) {
        next unless($rc =~ /$re/);
        $restart = $nrconf{override_rc}->{$re};
        last;
    }
    print "$rc ", ($restart ? "restart" : "deferred"), "\n";
}
"""


def test_needrestart_leaves_the_server_and_the_extraction_alone(host):
    conf = "/etc/needrestart/conf.d/hs-patch.conf"
    units = ["sglang.service", "hs-drive-kimi-v1.service", "hs-ship-kimi-v1.service", "nvidia-persistenced.service",
             "ssh.service", "cron.service", "sglang-other.service"]
    out = host.check_output(f"perl -e {_quote(NEEDRESTART)} {conf} {' '.join(units)}")
    said = dict(line.split() for line in out.splitlines())
    assert said == {"sglang.service": "deferred", "hs-drive-kimi-v1.service": "deferred",
                    "hs-ship-kimi-v1.service": "deferred", "nvidia-persistenced.service": "deferred",
                    "ssh.service": "restart", "cron.service": "restart", "sglang-other.service": "restart"}


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


def test_the_kernel_is_held_with_the_driver(host):
    """The policy: no upgrade installs a kernel the held DKMS driver was not built for (kernel-hold.yml)."""
    selections = dict(line.split() for line in host.check_output(
        "dpkg --get-selections linux-image-amd64 linux-image-6.1.0-hs-test").splitlines())
    assert selections == {"linux-image-amd64": "hold", "linux-image-6.1.0-hs-test": "install"}


def test_the_kernel_check_saw_the_stand_in_kernel(host):
    assert host.file("/boot/vmlinuz-6.1.0-hs-test").exists
    assert host.check_output("/usr/local/bin/modinfo -k 6.1.0-hs-test -F version nvidia") == "580.95.05"
