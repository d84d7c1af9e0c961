"""--ssh-option values that skip the host key check are refused before anything is sent.

Against a real loopback sshd whose key is NOT the one pinned (a changed or spoofed storage
host): with ``StrictHostKeyChecking=no`` ssh itself would connect and the samples would go
(proved with the explicit, dangerous ``--allow-unverified-host-key``); without that flag
the shipper refuses at the start, sends nothing and deletes nothing.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from lab import loopback_sshd
from hs_patch.host.shipping import link as ship_link, shipper
from lab.ship_runs import dirs, make_samples, ship_cmd

REFUSED = ["StrictHostKeyChecking=no", "StrictHostKeyChecking no", "stricthostkeychecking=OFF",
           "StrictHostKeyChecking=accept-new", "StrictHostKeyChecking=false", "UserKnownHostsFile=/dev/null",
           "UserKnownHostsFile=none", "GlobalKnownHostsFile /dev/null", "KnownHostsCommand=/bin/echo %H",
           "VerifyHostKeyDNS=yes", "UserKnownHostsFile=\"/dev/null\""]
ALLOWED = ["StrictHostKeyChecking=yes", "UserKnownHostsFile=/etc/ssh/pinned", "Ciphers=aes128-gcm@openssh.com",
           "HostKeyAlias=storage", "VerifyHostKeyDNS=no", "ServerAliveInterval=5"]


@pytest.fixture(scope="module")
def sshd(tmp_path_factory):
    server = loopback_sshd.start(tmp_path_factory.mktemp("sshd"))
    yield server
    server.stop()


@pytest.mark.parametrize("opt", REFUSED)
def test_options_that_skip_the_host_key_check_are_refused(opt):
    assert ship_link.unverified_host_key_options([opt]) == [opt]
    with pytest.raises(ship_link.ConfigError, match="--allow-unverified-host-key"):
        ship_link.SshOptions(options=[opt])
    assert "-o" in ship_link.SshOptions(options=[opt], allow_unverified_host_key=True).argv()


def test_other_options_pass():
    assert ship_link.unverified_host_key_options(ALLOWED) == []
    argv = ship_link.SshOptions(options=ALLOWED).argv()
    assert all(opt in argv for opt in ALLOWED)


def test_a_changed_host_key_with_strict_checking_off_ships_nothing(tmp_path, sshd, capsys):
    samples, state, dest = dirs(tmp_path)
    written = make_samples(samples, 2)
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    changed = tmp_path / "known_hosts"  # the key the operator pinned is not the one the host shows now
    changed.write_text(f"[127.0.0.1]:{sshd.port} {Path(str(other) + '.pub').read_text()}")
    args = ["--ssh-key", str(sshd.key), "--ssh-port", str(sshd.port), "--known-hosts", str(changed),
            "--ssh-option", "StrictHostKeyChecking=no", "--ssh-option", "UserKnownHostsFile=/dev/null"]
    code = shipper.main(ship_cmd(samples, state, f"{sshd.host}:{dest}", *args))
    err = capsys.readouterr().err
    assert code == shipper.EXIT_USAGE
    assert "StrictHostKeyChecking=no, UserKnownHostsFile=/dev/null" in err and "not verified" in err
    assert all(w.path.exists() for w in written) and not dest.exists(), "nothing sent, nothing deleted"

    # what the refusal prevents: with the explicit flag ssh does connect to that host and ships
    code = shipper.main(ship_cmd(samples, state, f"{sshd.host}:{dest}", *args, "--allow-unverified-host-key"))
    assert code == shipper.EXIT_OK, capsys.readouterr().err
    assert sorted(p.name for p in (dest / "samples").iterdir()) == sorted(w.path.name for w in written)
