"""fab with an S3 bucket as training storage (issue #37): what it reads from the inventory, where each run and
fleet part goes, and how the shipper gets its credentials on the GPU host: only through systemd's
LoadCredential=, in the follow unit, a foreground fab ship and the preflight's check alike; never on a
command line."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from hs_patch.control import host_checks, remote, storage
from hs_patch.control.inventory import ConfigError, load
from hs_patch.control.inventory import Target
from hs_patch.control.shell import Shell

SECRET = "s3cret-key-never-shown"


class Result:
    def __init__(self, exited=0, stdout="", stderr=""):
        self.exited, self.stdout, self.stderr = exited, stdout, stderr
        self.failed, self.ok = exited != 0, exited == 0


class FakeConnection:
    """Records each command; ``test -f`` of the credentials file answers as ``has_credentials`` says."""
    host = "gpu"

    def __init__(self, has_credentials=True):
        self.lines: list[str] = []
        self.has_credentials = has_credentials

    def run(self, line, **kw):
        self.lines.append(line)
        argv = shlex.split(line)
        if argv[:2] == ["test", "-f"]:
            return Result(0 if self.has_credentials else 1)
        if argv[:1] == ["systemd-run"] and "--check" in argv:
            return Result(0, "hs-ship: s3://b-1/p: reachable, 3 samples listed in its manifest\n")
        if argv[:1] == ["systemd-run"] and "--wait" in argv:
            return Result(3, "", "hs-ship: 1 samples shipped earlier are damaged or missing at the destination\n")
        return Result(0, "inactive\n")

    def argv(self) -> list[list[str]]:
        return [shlex.split(x) for x in self.lines]


def s3_target(**kw) -> Target:
    return replace(Target(host="gpu", name="gpu1"), s3_url="s3://hs-runs/kimi", s3_endpoint="https://s3.lab:9000",
                   s3_region="eu-1", s3_addressing="path", s3_concurrency=12, **kw)


def test_the_inventory_names_the_bucket_and_its_settings_but_never_its_secret(tmp_path):
    (tmp_path / "group_vars").mkdir()
    (tmp_path / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"gpu_hosts": {"hosts": {
        "gpu1": {"ansible_host": "198.51.100.10", "ansible_user": "root"}}}}}}))
    (tmp_path / "group_vars" / "gpu_hosts.yml").write_text(yaml.safe_dump({
        "hs_s3_url": "s3://hs-runs/kimi", "hs_s3_endpoint": "https://s3.lab:9000", "hs_s3_region": "eu-1",
        "hs_s3_addressing": "path", "hs_s3_concurrency": 12, "hs_s3_access_key_id": "AK",
        "hs_s3_secret_access_key": SECRET}))
    t = load("gpu1", str(tmp_path / "hosts.yml"))
    assert (t.s3_url, t.s3_endpoint, t.s3_region, t.s3_addressing, t.s3_concurrency) == (
        "s3://hs-runs/kimi", "https://s3.lab:9000", "eu-1", "path", 12)
    assert t.s3_credentials_file == "/etc/hs-patch/s3-credentials"  # the role's default, read from it
    assert SECRET not in repr(t)
    (tmp_path / "group_vars" / "gpu_hosts.yml").write_text(yaml.safe_dump({"hs_s3_url": "s3://x/$(id)"}))
    with pytest.raises(ConfigError, match="s3_url"):
        load("gpu1", str(tmp_path / "hosts.yml"))


def test_each_run_and_each_fleet_part_has_its_prefix_in_the_bucket():
    t = s3_target()
    assert remote.destination(t, "r1") == "s3://hs-runs/kimi/r1"
    assert remote.destination(t, "r1", "gpu1") == "s3://hs-runs/kimi/r1/gpu1"
    rsync = Target(host="gpu")
    assert remote.destination(rsync, "r1", "gpu1") == "hs-storage:/srv/hs-samples/r1/gpu1"
    assert storage.ship_options(rsync) == []


def test_the_follow_unit_gets_the_credentials_from_systemd_and_the_bucket_options():
    c = FakeConnection()
    remote.start_jobs(Shell(c, s3_target()), s3_target(), "r1", [])
    ship = next(a for a in c.argv() if a[0] == "systemd-run" and "--unit=hs-ship-r1" in a)
    assert "--property=LoadCredential=s3:/etc/hs-patch/s3-credentials" in ship
    cmdline = ship[ship.index("--") + 1:]
    assert cmdline[cmdline.index("--dest") + 1] == "s3://hs-runs/kimi/r1"
    for opt, value in (("--s3-endpoint", "https://s3.lab:9000"), ("--s3-region", "eu-1"), ("--s3-addressing", "path"),
                       ("--s3-concurrency", "12")):
        assert cmdline[cmdline.index(opt) + 1] == value
    assert "--s3-credentials" not in cmdline, "the unit finds them at $CREDENTIALS_DIRECTORY/s3"
    # no credentials file on the host (an instance role): no LoadCredential= (a unit would not start)
    c = FakeConnection(has_credentials=False)
    remote.start_jobs(Shell(c, s3_target()), s3_target(), "r1", [])
    assert not any("LoadCredential" in a for x in c.argv() for a in x)


def test_a_foreground_fab_ship_runs_as_a_unit_with_the_same_sandbox_and_credentials():
    c = FakeConnection()
    t = s3_target()
    code, out = remote.ship_now(Shell(c, t), t, "r1", dest=remote.destination(t, "r1", "gpu1"))
    assert code == 3 and "damaged or missing" in out
    run = next(a for a in c.argv() if a[0] == "systemd-run")
    assert {"--wait", "--pipe", "--unit=hs-ship-r1", f"--uid={t.service_user}"} <= set(run)
    assert "--property=LoadCredential=s3:/etc/hs-patch/s3-credentials" in run
    assert set(remote.unit_hardening(t, "r1", "ship")) <= set(run)
    assert run[run.index("--dest") + 1] == "s3://hs-runs/kimi/r1/gpu1"
    assert not any(line.startswith("sudo") for line in c.lines)


def test_preflight_reaches_the_bucket_as_the_shipper_would():
    c = FakeConnection()
    t = replace(s3_target(), venv="/opt/v")
    found = [x for x in host_checks.preflight(Shell(c, t), t, estimated_bytes=1, bytes_per_token=1) if x.name == "storage"]
    assert len(found) == 1 and found[0].ok and found[0].detail == "s3://b-1/p: reachable, 3 samples listed in its manifest"
    check = next(a for a in c.argv() if a[0] == "systemd-run" and "--check" in a)
    assert "--property=LoadCredential=s3:/etc/hs-patch/s3-credentials" in check
    assert check[check.index("--") + 1:][:3] == ["/opt/v/bin/hs-extract", "ship", "--check"]
    assert not any(a[:1] == ["ssh"] for a in c.argv()), "no storage host to reach over SSH"


def test_nothing_fab_sends_holds_a_secret(tmp_path: Path):
    c = FakeConnection()
    t = s3_target()
    remote.start_jobs(Shell(c, t), t, "r1", [])
    remote.ship_now(Shell(c, t), t, "r1")
    assert not any(SECRET in line or "aws_secret_access_key" in line for line in c.lines)
