"""GPU hosts for the dashboards on loopback: private sshd's, each behind a link that can be cut.

Each host is a :mod:`lab.loopback_sshd` (its own port, host key and authorized key: a host of
its own to Fabric) reached through a :class:`CuttableLink`, a TCP relay on 127.0.0.1: cut, its
connections stay open and nothing passes either way, exactly what an established SSH
connection sees when the host's network link dies (no reset, no answer); a new connection is
accepted and hears nothing. The host side of a dashboard read (``hs-extract snapshot``) is a
script printing the host's snapshot file, which the caller rewrites as the run "progresses".
Used by tests/control/test_fleet_poll.py and bench/fleet_dashboard.py.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hs_patch.control.inventory import Target
from lab import loopback_sshd


class CuttableLink:
    """A relay from a port of its own to ``port`` on 127.0.0.1 whose link :meth:`cut` silences."""

    def __init__(self, port: int):
        self.target = ("127.0.0.1", port)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.up = threading.Event()
        self.up.set()
        self.closed = False
        self.last_answer = 0.0   # time.monotonic() when the host's side last sent bytes through
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, name=f"link-{port}", daemon=True).start()

    def cut(self) -> None:
        self.up.clear()

    def restore(self) -> None:
        self.up.set()

    def close(self) -> None:
        self.closed = True
        self.up.set()
        self.sock.close()
        for s in self._socks:
            s.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                a, _ = self.sock.accept()
                b = socket.create_connection(self.target, timeout=10)
            except OSError:
                continue
            self._socks += [a, b]
            threading.Thread(target=self._relay, args=(a, b), daemon=True).start()

    def _relay(self, a: socket.socket, b: socket.socket) -> None:
        peer = {a: b, b: a}
        while not self.closed:
            self.up.wait()
            try:
                ready, _, _ = select.select([a, b], [], [], 0.2)
            except (OSError, ValueError):
                return
            if not self.up.is_set():
                continue  # cut: what arrived waits in the kernel's buffers, nothing passes
            for s in ready:
                try:
                    data = s.recv(65536)
                    if data:
                        peer[s].sendall(data)
                        if s is b:
                            self.last_answer = time.monotonic()
                        continue
                except OSError:
                    pass
                a.close()
                b.close()
                return


@dataclass
class Host:
    target: Target
    sshd: loopback_sshd.LoopbackSshd
    link: CuttableLink
    snapshot: Path

    def show(self, snap: dict[str, Any]) -> None:
        """What the host's next ``hs-extract snapshot`` prints."""
        tmp = self.snapshot.with_suffix(".tmp")
        tmp.write_text(json.dumps(snap))
        tmp.replace(self.snapshot)

    def stop(self) -> None:
        self.link.close()
        self.sshd.stop()


def start(directory: Path, names: list[str]) -> list[Host]:
    """One host a name, each with its sshd, its link and its snapshot file (empty JSON object until shown)."""
    hosts: list[Host] = []
    try:
        for name in names:
            d = directory / name
            sshd = loopback_sshd.start(d / "sshd")
            link = CuttableLink(sshd.port)
            # the host key as the relay's address knows it
            sshd.known_hosts.write_text(sshd.known_hosts.read_text().replace(f":{sshd.port} ", f":{link.port} "))
            script = d / "venv" / "bin" / "hs-extract"
            script.parent.mkdir(parents=True)
            script.write_text(f"#!/bin/sh\nexec cat {d / 'snap.json'}\n")
            script.chmod(0o755)
            target = Target(host="127.0.0.1", name=name, user=sshd.host.split("@")[0], port=link.port,
                            key_file=str(sshd.key), known_hosts=str(sshd.known_hosts), venv=str(d / "venv"))
            hosts.append(Host(target, sshd, link, d / "snap.json"))
            hosts[-1].show({})
    except BaseException:
        for h in hosts:
            h.stop()
        raise
    return hosts
