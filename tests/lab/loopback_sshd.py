"""A private sshd on 127.0.0.1 for rsync-over-SSH tests.

Its own host key, authorized key and known_hosts in a temp directory, every setting
given with ``-o`` (``-f /dev/null``), so /etc/ssh is never read or changed. Runs as the
current user (root here: sshd then needs its privilege-separation directory /run/sshd,
which is created if missing). Stopped by its own pid.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SSHD = "/usr/sbin/sshd"


@dataclass
class LoopbackSshd:
    port: int
    key: Path          # client identity authorized for the current user
    known_hosts: Path  # holds the server's host key for [127.0.0.1]:port
    log: Path
    proc: subprocess.Popen
    address: str = "127.0.0.1"

    @property
    def host(self) -> str:
        import getpass

        return f"{getpass.getuser()}@{self.address}"

    def ship_args(self) -> list[str]:
        """The shipper's command-line options to reach this server."""
        return ["--ssh-key", str(self.key), "--ssh-port", str(self.port), "--known-hosts", str(self.known_hosts)]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(directory: Path, *, address: str = "127.0.0.1", netns: str | None = None) -> LoopbackSshd:
    """``address``/``netns``: listen there instead, inside that network namespace (the S3 bench puts sshd
    beside the S3 server, behind one link)."""
    if not os.path.exists(SSHD):
        raise RuntimeError(f"{SSHD} is missing: apt-get install -y openssh-server (the tests need a real sshd)")
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    for name in ("host_key", "client_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name)], check=True)
    shutil.copy(directory / "client_key.pub", directory / "authorized_keys")
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
    port = _free_port()
    (directory / "known_hosts").write_text(f"[{address}]:{port} {(directory / 'host_key.pub').read_text()}")
    options = {
        "Port": port, "ListenAddress": address, "HostKey": directory / "host_key",
        "AuthorizedKeysFile": directory / "authorized_keys", "PidFile": "none", "StrictModes": "no",
        "UsePAM": "no", "PasswordAuthentication": "no", "KbdInteractiveAuthentication": "no",
        "PermitRootLogin": "prohibit-password", "MaxStartups": "50", "MaxSessions": "50",
    }
    argv = (["ip", "netns", "exec", netns] if netns else []) + [SSHD, "-D", "-e", "-f", "/dev/null"]
    for k, v in options.items():
        argv += ["-o", f"{k}={v}"]
    log = directory / "sshd.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    server = LoopbackSshd(port, directory / "client_key", directory / "known_hosts", log, proc, address)
    deadline = time.monotonic() + 15
    while b"Server listening" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"sshd did not start: {log.read_text()}")
        time.sleep(0.05)
    return server
