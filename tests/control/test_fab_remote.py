"""fab's remote steps against a stub connection that runs each command in a real local shell.

Every program the steps call is a recorder on PATH (it writes its argv as JSON and exits
0), so what the host's shell would do with each command line is exactly what happens
here. Hostile names (the issue's ``x.jsonl; touch FILE #``, ``$(...)``, backticks,
quotes, newlines, option-like values) must reach the programs as single, intact
arguments and never run anything.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import BinaryIO

import pytest
import yaml

from hs_patch.control import host_checks, remote, sizing
from hs_patch.control.inventory import Target
from hs_patch.control.shell import RemoteError, Shell

HOSTILE = ["x.jsonl; touch PWNED_semicolon #", "$(touch PWNED_subst)", "`touch PWNED_backtick`",
           "a'b\"c; touch PWNED_quotes", "line\ntouch PWNED_newline", "-oProxyCommand=touch PWNED_option"]
PROGRAMS = ("sudo", "install", "systemctl", "journalctl", "stat", "sha256sum", "df", "cat", "ls", "head", "find",
            "nvidia-smi", "systemd-run", "mktemp", "rm", "ssh", "python", "hs-patch", "hs-extract")

RECORDER = """#!{python}
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps([os.path.basename(sys.argv[0])] + sys.argv[1:]) + "\\n")
name = os.path.basename(sys.argv[0])
if name == "sudo":  # run what follows '--' (or the options) for real, as root would
    args = sys.argv[1:]
    rest = args[args.index("--") + 1:] if "--" in args else args
    os.execvp(rest[0], rest)
if name == "mktemp":
    print({tmp!r})
elif name == "stat":
    print("600 sglang" if "%a %U" in sys.argv else "1234")
elif name == "hs-extract":
    print(json.dumps({{"run": "r"}}))
"""


class LocalShellConnection:
    """A fabric Connection stand-in: ``run`` hands the command line to bash, ``put`` copies."""

    def __init__(self, workdir: Path, path: str):
        self.host, self.workdir, self.path, self.lines, self.puts = "stub", workdir, path, [], []

    def run(self, command: str, **kw) -> SimpleNamespace:
        self.lines.append(command)
        p = subprocess.run(["bash", "-c", command], cwd=self.workdir, capture_output=True, text=True, timeout=30,
                           env={"PATH": self.path, "HOME": str(self.workdir)})
        return SimpleNamespace(ok=p.returncode == 0, failed=p.returncode != 0, exited=p.returncode,
                               stdout=p.stdout, stderr=p.stderr)

    def put(self, local: BinaryIO, remote_path: str) -> None:  # Fabric's Connection.put with a file object
        self.puts.append((local.name, remote_path))
        with open(remote_path, "wb") as out:
            shutil.copyfileobj(local, out)


@pytest.fixture
def lab(tmp_path: Path):
    fake = tmp_path / "bin"
    fake.mkdir()
    log = tmp_path / "argv.jsonl"
    work = tmp_path / "work"
    work.mkdir()
    upload_tmp = tmp_path / "upload.tmp"

    def recorder(path: Path) -> None:
        path.write_text(RECORDER.format(python=sys.executable, log=str(log), tmp=str(upload_tmp)))
        path.chmod(path.stat().st_mode | stat.S_IXUSR)

    for name in PROGRAMS:
        recorder(fake / name)
    # every hostile string is a path component of the venv: its bin/ holds recorders too
    venv = tmp_path / ("venv " + " ".join(HOSTILE).replace("\n", "_").replace("/", "_"))
    plain = tmp_path / "venv x; touch PWNED_venv #"  # no '$': one that systemd-run may be given
    for d in (venv, plain):
        (d / "bin").mkdir(parents=True, exist_ok=True)
        for name in ("python", "hs-patch", "hs-extract"):
            recorder(d / "bin" / name)
    path = f"{fake}:/usr/bin:/bin"
    conn = LocalShellConnection(work, path)

    def argv() -> list[list[str]]:
        return [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []

    return SimpleNamespace(conn=conn, argv=argv, work=work, venv=venv, plain_venv=plain, tmp=tmp_path)


def hostile_target(venv: Path, become: bool) -> Target:
    return Target(host="stub", user="ubuntu" if become else "root", become=become,
                  become_password="pw; touch PWNED_pw" if become else None, venv=str(venv), service=HOSTILE[0],
                  service_user=HOSTILE[1], model_path="/m/" + HOSTILE[2], dump_dir="/dev/shm/" + HOSTILE[3],
                  storage_alias=HOSTILE[5], storage_dir="/s/" + HOSTILE[4], state_root="/r/" + HOSTILE[0],
                  samples_root="/dev/shm/" + HOSTILE[1], api_key_file="/k/" + HOSTILE[2], server_port=30000)


def pwned(lab) -> list[str]:
    return sorted(str(p) for p in lab.tmp.rglob("PWNED*"))


@pytest.mark.parametrize("become", [False, True], ids=["root", "sudo"])
def test_hostile_names_stay_single_arguments(lab, become):
    t = hostile_target(lab.venv, become)
    c = Shell(lab.conn, t)
    run = HOSTILE[0]  # fab validates run names; the remote steps quote them anyway
    dataset = lab.tmp / "data.jsonl"
    dataset.write_text('{"input_ids": [1, 2]}\n')

    sizing.remote_size(c, "/data/" + HOSTILE[0])
    sizing.estimate_bytes(c, t, 1000)
    host_checks.preflight(c, t, estimated_bytes=1, bytes_per_token=1)
    remote.prepare(c, t, run)
    remote.upload(c, t, run, dataset)
    remote.start_server(c, t, 5, lambda m: None)
    with pytest.raises(remote.RemoteError, match=r"holds '\$'"):  # systemd would expand $(...) at start
        remote.start_jobs(c, t, run, ["--data", "/data/" + HOSTILE[0]])
    remote.start_jobs(c, replace(t, venv=str(lab.plain_venv), service_user="sglang", samples_root="/dev/shm/y",
                                  api_key_file="/k/k"),
                      "r1", ["--data", "/data/" + HOSTILE[0]])
    remote.snapshot(c, t, run)
    remote.runs(c, t)
    remote.stop(c, t, run, server=True)
    remote.ship_now(c, t, run)

    assert not pwned(lab), f"a hostile name ran as shell code: {pwned(lab)}"
    calls = lab.argv()
    flat = [a for call in calls for a in call]
    for value in ["/data/" + HOSTILE[0], f"/m/{HOSTILE[2]}/config.json", "/dev/shm/" + HOSTILE[3],
                  f"/r/{HOSTILE[0]}/{run}", HOSTILE[1], f"{HOSTILE[0]}.service"]:
        assert value in flat, f"{value!r} did not arrive as one argument"
    stat_calls = [call for call in calls if call[:4] == ["stat", "-c", "%s", "--"]]
    assert stat_calls == [["stat", "-c", "%s", "--", "/data/" + HOSTILE[0]]]
    ssh = next(call for call in calls if call[0] == "ssh")
    assert ssh[ssh.index("--") + 1] == HOSTILE[5], "the alias comes after '--': never an ssh option"
    assert ssh[-1] == "df -Pk " + __import__("shlex").quote("/s/" + HOSTILE[4]), "one quoted line for the far shell"
    assert any(call[0] == "install" and call[-1].endswith("/data/data.jsonl") for call in calls)
    drive = next(call for call in calls if call[0] == "systemd-run" and "--unit=hs-drive-r1" in call)
    assert "--api-key-file" in drive and drive[drive.index("--api-key-file") + 1] == "/k/k"
    if become:
        sudo_lines = [line for line in lab.conn.lines if not line.startswith(("mktemp", "rm "))]
        assert all(line.startswith("sudo -S -p ") for line in sudo_lines), "every root step goes through sudo"
        assert not any("pw; touch" in line for line in lab.conn.lines), "the sudo password is never on a command line"


def test_sudo_without_password_is_non_interactive(lab):
    t = replace(hostile_target(lab.venv, True), become_password=None)
    c = Shell(lab.conn, t)
    c.run(["systemctl", "stop", "a b.service"])
    assert lab.conn.lines[-1] == "sudo -n -H -- sh -c 'systemctl stop '\"'\"'a b.service'\"'\"''"
    assert lab.argv()[-1] == ["systemctl", "stop", "a b.service"]


def test_sandbox_of_the_job_units():
    t = Target(host="h")
    drive = remote.unit_hardening(t, "r1", "drive")
    ship = remote.unit_hardening(t, "r1", "ship")
    for props in (drive, ship):
        for p in ("NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes", "CapabilityBoundingSet=",
                  "ProtectHome=read-only", "PrivateDevices=yes"):
            assert f"--property={p}" in props
        assert not any("RemoveIPC" in p for p in props), "RemoveIPC would delete the user's /dev/shm files"
    # one writable path holds both the capture dir and the samples dir: rename(2) between two
    # ReadWritePaths= mounts fails with EXDEV (the e2e run's driver adopted nothing before this)
    assert "--property=ReadWritePaths=/var/lib/hs-patch/runs/r1 /dev/shm" in drive
    assert "--property=ReadWritePaths=/var/lib/hs-patch/runs/r1 /dev/shm/hs-runs/r1" in ship
    assert "--property=IPAddressDeny=any" in drive and "--property=IPAddressDeny=any" not in ship
    deep = replace(t, dump_dir="/srv/hs/capture/", samples_root="/srv/hs/runs")
    assert "--property=ReadWritePaths=/var/lib/hs-patch/runs/r1 /srv/hs" in remote.unit_hardening(deep, "r1", "drive")
    for apart in (replace(t, samples_root="/var/tmp/runs"), replace(t, dump_dir="/dev/hs", samples_root="/dev/runs")):
        with pytest.raises(RemoteError, match="are apart: set hs_dump_dir and hs_runs_samples_root under one"):
            remote.unit_hardening(apart, "r1", "drive")
    assert os.sep == "/"


@pytest.fixture
def kv_server(tiny_model_dir, tmp_path):
    """A stand-in SGLang server with a 300-token KV cache pool, behind an API key."""
    from lab.standin_engine import Engine
    from lab.standin_server import StandinServer

    srv = StandinServer(Engine(str(tiny_model_dir), str(tmp_path / "capture"), release="0.5.16",
                               max_total_num_tokens=300), api_key="k3y").start()
    yield srv
    srv.close()


def test_extract_refuses_a_server_whose_kv_cache_cannot_hold_a_sample(kv_server, tmp_path):
    """fab extract reads the started server's /server_info on the host (with its API key) and stops
    before the driver when max_total_num_tokens is below the longest sample the driver sends."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (tmp_path / "api-key").write_text("k3y\n")
    t = Target(host="stub", user="root", become=False, venv=str(venv), api_key_file=str(tmp_path / "api-key"),
               server_port=int(kv_server.url.rsplit(":", 1)[1]), service="sglang-kimi")
    c = Shell(LocalShellConnection(tmp_path, "/usr/bin:/bin"), t)
    with pytest.raises(RemoteError, match=r"on stub: the server's KV cache holds 300 tokens \(max_total_num_tokens\), "
                                          r"fewer than the 32769 .* sglang_service_mem_fraction_static.*"
                                          r"restart the server \(systemctl restart sglang-kimi\); "  # the host's unit
                                          r"or send shorter samples \(fab extract --max-tokens 299\)$"):
        remote.check_kv_cache(c, t)  # the option a fab user has, not hs-extract drive's
    remote.check_kv_cache(c, t, max_tokens=256)  # a driver sending 256-token samples at most: it fits
    (tmp_path / "api-key").write_text("wrong\n")
    with pytest.raises(RemoteError, match=r"could not read http://127\.0\.0\.1:\d+/server_info: .*401"):
        remote.check_kv_cache(c, t)


def test_a_status_the_host_cannot_give_is_status_unreadable_not_a_lost_connection():
    """A snapshot that failed or printed no JSON read as "lost the connection" on the dashboards (or a traceback)."""
    from hs_patch.control.shell import StatusUnreadable

    t = Target(host="stub")
    for ok, stdout, stderr in ((False, "", "hs-extract: no run r1"), (True, "Traceback (most recent call last):", "")):
        answer = SimpleNamespace(ok=ok, failed=not ok, exited=0 if ok else 1, stdout=stdout, stderr=stderr)
        conn = SimpleNamespace(host="stub", run=lambda command, **kw: answer)
        with pytest.raises(StatusUnreadable, match="cannot read the run's status on stub: .*fab verify --host stub"):
            remote.snapshot(Shell(conn, t), t, "r1")


def test_the_runs_on_a_host_are_its_run_directories_newest_first(tmp_path):
    """fab status/stop/ship without --run take the newest run: that was the newest entry of any kind, so a
    state root on its own filesystem gave lost+found, and a file left there was taken for a run."""
    root = tmp_path / "runs"
    for i, name in enumerate(["kimi-v1", "lost+found", "kimi-v2", "notes.txt", "with space"]):
        (root / name).mkdir(parents=True) if name != "notes.txt" else (root / name).write_text("x")
        os.utime(root / name, (1_000 + i, 1_000 + i))
    (tmp_path / "elsewhere").mkdir()  # a run directory moved to another disk, linked back
    (root / "kimi-v0").symlink_to(tmp_path / "elsewhere")
    os.utime(tmp_path / "elsewhere", (999, 999))
    c = LocalShellConnection(tmp_path, "/usr/bin:/bin")
    t = Target(host="stub", state_root=str(root))
    assert remote.runs(Shell(c, t), t) == ["kimi-v2", "kimi-v1", "kimi-v0"]
    empty = replace(t, state_root=str(tmp_path / "none"))
    assert remote.runs(Shell(c, empty), empty) == []


def test_preflight_runs_gpu_ready_from_the_inventorys_check_dir(tmp_path):
    """The services role installs gpu-ready in sglang_service_check_dir: preflight runs it from the host's
    value (it ran /usr/local/lib/hs-patch/gpu-ready whatever the inventory said)."""
    checks = tmp_path / "opt checks"
    checks.mkdir()
    (checks / "gpu-ready").write_text('#!/bin/sh\necho "{\\"name\\": \\"nccl\\", \\"ok\\": true, '
                                      '\\"detail\\": \\"ran from the check dir: $*\\"}"\n')
    (checks / "gpu-ready").chmod(0o755)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "systemctl").write_text("#!/bin/sh\nexit 3\n")  # the server is not running: the check runs
    (fake / "systemctl").chmod(0o755)
    t = Target(host="stub", check_dir=str(checks))
    got = host_checks._gpu_ready(Shell(LocalShellConnection(tmp_path, f"{fake}:/usr/bin:/bin"), t), t)
    assert got.ok and got.detail == "nccl: ran from the check dir: caches jit nccl --json", got
    assert Target(host="h").check_dir == yaml.safe_load(
        (Path(__file__).resolve().parents[2] / "roles/sglang_service/defaults/main.yml").read_text()
    )["sglang_service_check_dir"], "the role's default, defined once"


class UnitHost:
    """A host whose server unit starts as systemd does it: the start job is queued (inactive, a job listed),
    then the pre-start checks run (activating), then the server answers, or the unit fails."""

    def __init__(self, states: list[str], healthy_at: int | None, hang: str = ""):
        self.host, self.states, self.healthy_at, self.hang, self.lines, self.polls = "stub", states, healthy_at, hang, [], 0

    def run(self, command: str, **kw) -> SimpleNamespace:
        from invoke.exceptions import CommandTimedOut

        self.lines.append(command)
        out, code = "", 0
        if self.hang and self.hang in command:
            raise CommandTimedOut(SimpleNamespace(command=command, stdout="", stderr=""), kw.get("timeout"))
        if "urllib" in command:
            self.polls += 1
            code = 0 if self.healthy_at is not None and self.polls >= self.healthy_at else 1
        elif "is-active" in command:
            out = self.states[min(self.polls, len(self.states)) - 1]
        elif "list-jobs" in command:
            out = "7 sglang.service start waiting\n" if self.states[min(self.polls, len(self.states)) - 1] == \
                "inactive" and self.polls < 2 else ""
        elif "journalctl" in command:
            out = "ExecStartPre: gpu_ready.py: nccl: the all-reduce hung\n"
        return SimpleNamespace(ok=code == 0, failed=code != 0, exited=code, stdout=out, stderr="")


def server_target() -> Target:
    return Target(host="stub", user="root", venv="/opt/v", service="sglang", server_port=30000)


def test_fab_starts_the_server_without_blocking_on_its_pre_start_checks(monkeypatch):
    """`systemctl start` blocks until the unit's pre-start checks end (minutes on a cold host: a JIT compile, an
    all-reduce over every GPU), past the SSH command's 120 s; the start is queued instead and the health loop waits
    for it, a start job still queued (inactive) included."""
    monkeypatch.setattr(remote.time, "sleep", lambda s: None)
    host = UnitHost(["inactive", "activating", "activating"], healthy_at=3)
    said: list[str] = []
    remote.start_server(Shell(host, server_target()), server_target(), 60, said.append)
    assert "systemctl start --no-block sglang.service" in host.lines[0]
    assert host.polls == 3 and said == [
        "waiting for http://127.0.0.1:30000/health_generate (0s, unit inactive)",
        "waiting for http://127.0.0.1:30000/health_generate (0s, unit activating)"]

    failing = UnitHost(["activating", "failed"], healthy_at=None)
    with pytest.raises(RemoteError, match=r"(?s)the server unit sglang is failed:.*the all-reduce hung.*fab extract"):
        remote.start_server(Shell(failing, server_target()), server_target(), 60, lambda m: None)


def test_a_command_past_its_timeout_is_a_remote_error_that_says_what_to_do():
    """invoke raises CommandTimedOut whatever warn says: fab printed a traceback (fab only turns RemoteError into
    a message)."""
    host = UnitHost(["active"], healthy_at=1, hang="systemctl stop")
    with pytest.raises(RemoteError, match=r"on stub: `systemctl stop x.service` did not finish within 300 s .*"
                                          r"run the same command again"):
        Shell(host, server_target()).run(["systemctl", "stop", "x.service"], timeout=300)


def test_a_driver_is_started_only_after_an_earlier_drivers_end_marker_is_gone():
    """A finished run started again (a --limit trial, lines appended): the shipper, started right after the driver,
    found the old driver.done before the new driver removed it, shipped nothing and ended 'done', and fab said every
    sample was shipped. fab removes the marker before it starts a driver that is not running, never under one."""
    from hs_patch.host.driver.runstate import DONE

    class Host:
        host = "stub"

        def __init__(self, drive_state: str):
            self.drive_state, self.lines = drive_state, []

        def run(self, command: str, **kw) -> SimpleNamespace:
            self.lines.append(command)
            out = (self.drive_state if "hs-drive-r1" in command else "inactive") + "\n" \
                if "ActiveState" in command else ""
            return SimpleNamespace(ok=True, failed=False, exited=0, stdout=out, stderr="")

    t = Target(host="stub", venv="/opt/v", state_root="/var/lib/hs-patch/runs")
    assert remote.DRIVER_DONE == DONE, "the driver's own name for it"
    idle = Host("inactive")
    remote.start_jobs(Shell(idle, t), t, "r1", [])
    rm = idle.lines.index(f"rm -f -- /var/lib/hs-patch/runs/r1/{DONE}")
    starts = [i for i, line in enumerate(idle.lines) if line.startswith("systemd-run")]
    assert len(starts) == 2 and rm < starts[0] and "hs-drive-r1" in idle.lines[starts[0]], idle.lines
    running = Host("active")
    remote.start_jobs(Shell(running, t), t, "r1", [])
    assert not any(DONE in line for line in running.lines), running.lines


def test_a_host_lost_mid_command_or_a_refused_sudo_password_is_a_remote_error_not_a_traceback(tmp_path):
    """Fabric opens a dropped connection again for the next command; on a dead host that raised paramiko's
    NoValidConnectionsError, and a wrong ansible_become_password invoke's Failure (its sudo watcher's): both
    reached the operator as tracebacks (fab turns only RemoteError and ConfigError into a message)."""
    from invoke.exceptions import Failure
    from invoke.exceptions import WatcherError
    from paramiko.ssh_exception import NoValidConnectionsError

    class Lost:
        host = "stub"

        def run(self, command, **kw):
            raise NoValidConnectionsError({("127.0.0.1", 22): ConnectionRefusedError(111, "Connection refused")})

        def put(self, local, remote):
            raise EOFError()

    with pytest.raises(RemoteError, match=r"lost the connection to stub \(NoValidConnectionsError.*fab status --host"):
        Shell(Lost(), server_target()).run(["systemctl", "stop", "x.service"])

    class PutLost(Lost):
        def run(self, command, **kw):
            return SimpleNamespace(ok=True, failed=False, exited=0, stdout="/tmp/tmp.x\n", stderr="")

    (tmp_path / "f").write_text("x")
    with pytest.raises(RemoteError, match=r"lost the connection to stub \(EOFError"):
        Shell(PutLost(), server_target()).put(tmp_path / "f", "/etc/x", owner="root")
    # a local file that cannot be read is said as that, not as a lost connection (both are OSErrors)
    with pytest.raises(FileNotFoundError):
        Shell(PutLost(), server_target()).put(tmp_path / "gone", "/etc/x", owner="root")

    class Refused(Lost):
        def run(self, command, **kw):
            assert kw["watchers"], "the password goes to sudo through its watcher"
            raise Failure(SimpleNamespace(command=command, stdout="", stderr=""), reason=WatcherError("Auto-response"))

    target = Target(host="stub", user="ops", become=True, become_password="wrong", venv="/opt/v", service="sglang")
    with pytest.raises(RemoteError, match=r"sudo refused ansible_become_password for ops"):
        Shell(Refused(), target).run(["systemctl", "stop", "x.service"])


def test_fab_ship_during_a_run_gives_the_driver_its_follow_shipper_back(monkeypatch):
    """fab ship stops the follow shipper and drains in the foreground; with the driver still running nothing
    started the follower again: the samples piled up until the driver paused at its high-water mark."""
    from hs_patch.control import extraction

    class Host:
        host = "stub"

        def __init__(self, driver: str):
            self.driver, self.lines = driver, []

        def run(self, command, **kw):
            self.lines.append(command)
            out = self.driver if "hs-drive-r1.service" in command and "ActiveState" in command else "inactive"
            return SimpleNamespace(ok=True, failed=False, exited=0, stdout=out + "\n", stderr="")

    t = Target(host="stub", user="root", venv="/opt/v", service="sglang")
    monkeypatch.setattr(remote, "ship_now", lambda c, t, run, dest=None: (0, "shipped 3"))
    running = Host("active")
    code, out = extraction.drain(Shell(running, t), t, "r1")
    started = [line for line in running.lines if line.startswith("systemd-run")]
    assert code == 0 and len(started) == 1 and "--unit=hs-ship-r1" in started[0] and " --follow" in started[0]
    assert "hs-ship-r1 started again: hs-drive-r1 is still running" in out
    ended = Host("inactive")
    assert extraction.drain(Shell(ended, t), t, "r1") == (0, "shipped 3")
    assert not [line for line in ended.lines if line.startswith("systemd-run")], "a drained run stays drained"
