"""sample_shipping's last step on the rsync path (roles/sample_shipping/tasks/check-rsync.yml): the shipping user
runs rsync on the storage host over SSH. When that fails, the role says what the failure most likely means and
what to do, by whether the bundle manages the storage host, instead of ending on ssh's own line.

The role's task file runs as it is (include_role, local connection); `ssh` is a stand-in on PATH that answers as
ssh does in each case (its message on stderr, its exit status). The real SSH path runs in the sample_shipping
molecule scenario."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from lab.local_play import run_local_play

ROOT = Path(__file__).resolve().parents[2]


def _check(tmp_path: Path, managed: bool, stderr: str, rc: int) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    ssh = bin_dir / "ssh"
    ssh.write_text(f"#!/bin/sh\nprintf '%s\\n' {stderr!r} >&2\nexit {rc}\n")
    ssh.chmod(0o755)
    play = tmp_path / "check.yml"
    play.write_text(yaml.safe_dump([{
        "name": "The shipping user's check of the storage host", "hosts": "localhost", "gather_facts": False,
        "vars": {"sample_shipping_manage_storage": managed, "sample_shipping_storage_host": "storage1",
                 "sample_shipping_user": "root", "sample_shipping_home": "/root",
                 "sample_shipping_dial_address": "192.0.2.7"},
        "tasks": [{"name": "Check", "ansible.builtin.include_role": {"name": "sample_shipping",
                                                                     "tasks_from": "check-rsync.yml"}}]}]))
    # ansible_become=false: the task's become (to the shipping user) would reset PATH through sudo
    return run_local_play(play, "-e", "ansible_become=false",
                          env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "ANSIBLE_ROLES_PATH": str(ROOT / "roles")})


@pytest.mark.parametrize("managed, stderr, rc, says", [
    (False, "hs-ingest@192.0.2.7: Permission denied (publickey).", 255,
     ["does not accept the shipping key for hs-ingest", "hs_storage_managed false the storage side is yours",
      "authorize the key shown above"]),
    (True, "hs-ingest@192.0.2.7: Permission denied (publickey).", 255,
     ["does not accept the shipping key", "this run authorized it"]),
    (False, "Host key verification failed.", 255,
     ["known_hosts_hs-storage", "set hs_storage_host_key", "ssh-keyscan -t ed25519 192.0.2.7"]),
    (False, "/usr/bin/python3: can't open file '/usr/local/lib/hs-ingest/gate.py': [Errno 2] No such file", 2,
     ["the gate /usr/local/lib/hs-ingest/gate.py, is not on the storage host", "copy hs_patch/host/shipping/gate.py"]),
    (True, "ssh: connect to host 192.0.2.7 port 22: Connection timed out", 255,
     ["does not reach 192.0.2.7 on SSH", "firewall"]),
])
def test_a_failed_check_says_what_it_means_and_what_to_do(tmp_path, managed, stderr, rc, says):
    proc = _check(tmp_path, managed, stderr, rc)
    assert proc.returncode != 0
    flat = " ".join(proc.stdout.split())
    assert "could not run rsync on the storage host storage1 as hs-ingest" in flat, proc.stdout[-3000:]
    assert stderr in flat and f"exit {rc}" in flat
    for phrase in says:
        assert phrase in flat, (phrase, proc.stdout[-3000:])


def test_a_check_that_reaches_the_storage_host_passes(tmp_path):
    proc = _check(tmp_path, managed=True, stderr="", rc=0)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "Say why the user does not reach the storage host" in proc.stdout  # listed, skipped
    assert "could not run rsync" not in proc.stdout
