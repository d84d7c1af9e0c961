"""The shipping key's forced command on the storage host (hs_patch/host/shipping/gate.py).

First the gate alone, fed the exact command lines the shipper's rsync and ssh send (and
attacks), with recorders standing in for rsync and df; then a real loopback sshd whose
authorized key carries ``restrict,command="python3 gate.py ROOT"``: the shipper ships and
verifies through it, anything else the key tries is refused.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from lab import loopback_sshd
from hs_patch.host.shipping import link, shipper
from lab.ship_runs import assert_destination_has, dirs, make_samples, ship_cmd

GATE = Path(link.__file__).with_name("gate.py")
ROOT = "/srv/hs-samples"
RECORDER = "#!{py}\nimport json, sys\nprint(json.dumps(sys.argv))\n"

ALLOWED = [
    f"rsync --server -tRe.LsfxCIvu --timeout=120 --partial-dir .rsync-partial --compare-dest ../samples . "
    f"{ROOT}/run1/.incoming/",
    f"rsync --server -tRe.LsfxCIvu --timeout=60 -@-1 --partial-dir .rsync-partial --compare-dest ../samples . "
    f"{ROOT}/run1/.incoming/",  # what rsync 3.2-3.5 send for the shipper's options today
    f"rsync --server -tIRe.LsfxCIvu --timeout=120 --bwlimit=1000 --partial-dir .rsync-partial . "
    f"{ROOT}/run1/.incoming/",
    f"rsync --server -tRe.LsfxCIvu --partial-dir=.rsync-partial . {ROOT}/a/b/.incoming",
    "rsync --version",
    f"df -Pk {ROOT}",
    f"df -Pk {ROOT}/run1",
]
REFUSED = [
    "", "id", "sh -c id", "/bin/bash", "scp -t /tmp", "sftp-server",
    f"rsync --server --sender -tRe.LsfxCIvu . {ROOT}/run1/.incoming/",           # reading files back
    f"rsync --server -logDtprce.iLsfxCIvu . {ROOT}/",                            # rsync -a: links, devices, owners
    f"rsync --server -tRe.LsfxCIvu . /etc/.incoming/",
    f"rsync --server -tRe.LsfxCIvu . {ROOT}/run1/../../../etc/.incoming/",
    f"rsync --server -tRe.LsfxCIvu . {ROOT}/run1/",                              # not .incoming
    f"rsync --server -tRe.LsfxCIvu . {ROOT}/.incoming/",                          # not under a run dir
    f"rsync --server -tRe.LsfxCIvu --partial-dir ../../../etc . {ROOT}/run1/.incoming/",
    f"rsync --server -tRe.LsfxCIvu --compare-dest /etc . {ROOT}/run1/.incoming/",
    f"rsync --server -tRe.LsfxCIvu --delete . {ROOT}/run1/.incoming/",
    f"rsync --server -tRe.LsfxCIvu --rsync-path=/bin/sh . {ROOT}/run1/.incoming/",
    f"rsync --server -tRe.LsfxCIvu . {ROOT}/run1/.incoming/ ; touch /tmp/x",
    f"rsync --server -tRe.LsfxCIvu . . {ROOT}/run1/.incoming/",
    f"rsync --server -tRe.LsfxCIvu -@1 . {ROOT}/run1/.incoming/", f"rsync --server -t@-1 . {ROOT}/run1/.incoming/",
    "python3 -c " + shlex.quote("import os; os.system('id')"),
    "df -Pk /etc", f"df -Pk {ROOT}/../etc", "df -h /",
]


def gate(tmp_path: Path, command: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    fake = tmp_path / "bin"
    if not fake.exists():
        fake.mkdir()
        for name in ("rsync", "df"):
            (fake / name).write_text(RECORDER.format(py=sys.executable))
            (fake / name).chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": command}
    return subprocess.run([sys.executable, str(GATE), ROOT], input=stdin, capture_output=True, env=env, timeout=60)


@pytest.mark.parametrize("command", ALLOWED)
def test_the_shippers_commands_pass_unchanged(tmp_path, command):
    p = gate(tmp_path, command)
    assert p.returncode == 0, p.stderr.decode()
    argv = json.loads(p.stdout)
    assert [os.path.basename(argv[0])] + argv[1:] == shlex.split(command)


@pytest.mark.parametrize("command", REFUSED)
def test_everything_else_is_refused(tmp_path, command):
    p = gate(tmp_path, command)
    assert p.returncode == 1 and p.stdout == b"", p.stdout
    assert b"hs-ingest-gate: refused" in p.stderr and b"may only run the hs-patch shipper" in p.stderr


def test_verify_runs_the_installed_step_for_a_root_under_root(tmp_path):
    root = tmp_path / "srv"
    (root / "run1").mkdir(parents=True)
    request = json.dumps({"root": str(root / "run1"), "files": []}).encode()
    env_root = str(root)
    cmd = "python3 -c " + shlex.quote(link.REMOTE_SOURCE)
    env = {"PATH": "/usr/bin:/bin", "SSH_ORIGINAL_COMMAND": cmd}
    p = subprocess.run([sys.executable, str(GATE), env_root], input=request, capture_output=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    assert json.loads(p.stdout) == {"results": [], "manifest": 0}
    outside = json.dumps({"root": str(tmp_path / "elsewhere"), "files": []}).encode()
    p = subprocess.run([sys.executable, str(GATE), env_root], input=outside, capture_output=True, env=env, timeout=60)
    assert p.returncode == 1 and b"outside" in p.stderr and not (tmp_path / "elsewhere").exists()
    tampered = "python3 -c " + shlex.quote(link.REMOTE_SOURCE + "\nimport os; os.system('id')\n")
    p = subprocess.run([sys.executable, str(GATE), env_root], input=request, capture_output=True,
                       env={**env, "SSH_ORIGINAL_COMMAND": tampered}, timeout=60)
    assert p.returncode == 1 and b"not the one installed" in p.stderr
    from hs_patch.host.shipping.gate import MAX_REQUEST

    huge = json.dumps({"root": str(root / "run1"), "files": [{"file": "x" * 1000}] * (MAX_REQUEST // 1000)}).encode()
    p = subprocess.run([sys.executable, str(GATE), env_root], input=huge, capture_output=True, env=env, timeout=60)
    assert p.returncode == 1 and b"smaller --batch-files" in p.stderr, "what to do about it, not only the limit"


@pytest.fixture(scope="module")
def gated_sshd(tmp_path_factory):
    d = tmp_path_factory.mktemp("sshd")
    server = loopback_sshd.start(d)
    root = tmp_path_factory.mktemp("storage")
    pub = (d / "client_key.pub").read_text().strip()
    (d / "authorized_keys").write_text(f'restrict,command="/usr/bin/python3 {GATE} {root}" {pub}\n')
    yield server, root
    server.stop()


def _ssh(server, *remote: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ssh", "-i", str(server.key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                           "-o", f"UserKnownHostsFile={server.known_hosts}", "-p", str(server.port), server.host,
                           *remote], capture_output=True, text=True, timeout=60)


def test_shipping_works_through_the_forced_command_and_nothing_else_does(tmp_path, gated_sshd):
    server, root = gated_sshd
    samples, state, _ = dirs(tmp_path)
    written = make_samples(samples, 3)
    dest = root / "run1"
    code = shipper.main(ship_cmd(samples, state, f"{server.host}:{dest}", *server.ship_args()))
    assert code == shipper.EXIT_OK
    assert_destination_has(dest, written)
    assert all(not w.path.exists() for w in written), "verified at the destination, deleted here"

    for attempt in (["id"], ["cat", "/etc/passwd"], ["rsync", "--server", "--sender", "-tRe.LsfxCIvu", ".",
                                                     f"{dest}/samples/"]):
        p = _ssh(server, *attempt)
        assert p.returncode != 0 and "hs-ingest-gate: refused" in p.stderr, (attempt, p.stdout, p.stderr)
    pull = subprocess.run(["rsync", "-e", f"ssh -i {server.key} -o IdentitiesOnly=yes -o BatchMode=yes "
                           f"-o UserKnownHostsFile={server.known_hosts} -p {server.port}",
                           f"{server.host}:{dest}/samples/", str(tmp_path / "stolen")],
                          capture_output=True, text=True, timeout=60)
    assert pull.returncode != 0 and "refused" in pull.stderr and not (tmp_path / "stolen").exists()
    assert _ssh(server, "df", "-Pk", str(root)).returncode == 0


def test_a_destination_the_forced_command_refuses_is_an_error_not_an_outage(tmp_path, gated_sshd):
    """--dest outside the gate's ROOT (a typo, another storage directory): refused every time, which
    waiting cannot cure. Before: ridden out as an outage for ever ('waiting_for_destination', the
    dashboard's STORAGE UNREACHABLE) while the storage host answered at once."""
    server, root = gated_sshd
    samples, state, _ = dirs(tmp_path)
    written = make_samples(samples, 2)
    dest = tmp_path / "not-under-root" / "run1"
    argv = [sys.executable, "-m", "hs_patch.host.shipping.shipper",
            *ship_cmd(samples, state, f"{server.host}:{dest}", *server.ship_args(), "--backoff-max", "0.2")]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True)
    try:
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert code == shipper.EXIT_ERROR and "hs-ingest-gate: refused" in err and "is outside" in err, err
    assert all(w.path.exists() for w in written) and not dest.exists()
