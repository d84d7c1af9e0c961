#!/usr/bin/env python3
"""Disposable SSH test hosts without Docker: debootstrap + overlayfs + netns + systemd-nspawn.

Each host is a Debian 12 system booted with real systemd (``systemd-nspawn -b``, under
:mod:`lab.boot_loop`, so a guest that reboots comes back as a machine does, with its disk)
on its own copy-on-write overlay of one cached root filesystem, in its own
network namespace, reached over real SSH with a key generated for the lab.
All hosts of one lab share a bridge in the root namespace (the gateway
address lives on it), so they reach each other and this machine, nothing else.

Command line (run as root)::

    python3 tests/lab/testhosts.py up   --state-dir DIR --host gpu=198.51.100.10 --host storage=198.51.100.11
    python3 tests/lab/testhosts.py down --state-dir DIR
    python3 tests/lab/testhosts.py status --state-dir DIR
    python3 tests/lab/testhosts.py rootfs            # build the cached root filesystem only

Python API (used by the molecule create/destroy playbooks and by end-to-end tests)::

    from lab.testhosts import Lab
    lab = Lab("/tmp/lab")
    lab.up([("gpu", "198.51.100.10"), ("storage", "198.51.100.11")])
    lab.ssh("gpu", "systemctl is-system-running")
    lab.down()

``up`` records every resource in ``DIR/lab.json`` *before* creating it, so
``down`` removes exactly what this lab made (by its recorded names and pids),
even after a partial failure. ``down`` is idempotent. Nothing is killed by name.

The pieces: :mod:`lab.rootfs` (the cached root filesystem), :mod:`lab.gateway` (one lab per
gateway on this machine), :mod:`lab.hostcmd` (commands, processes, mounts).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent)]  # run as a script (molecule's create/destroy): `lab` importable

from lab.gateway import OWNERS_DIR, gateway_claimed, labs_locked, owner_from_env  # noqa: E402
from lab.hostcmd import LabError, alive, log, proc_start_time, remove_host, run, umask  # noqa: E402
from lab.rootfs import ensure_rootfs  # noqa: E402

DEFAULT_GATEWAY = "198.51.100.1/24"
BOOT_TIMEOUT_S = int(os.environ.get("HS_TESTHOSTS_BOOT_S", "180"))  # a guest boots in ~1 s when idle
STOP_TIMEOUT_S = 30


class Lab:
    """A set of test hosts described by ``state_dir/lab.json``."""

    def __init__(self, state_dir: str | os.PathLike):
        self.state_dir = Path(state_dir).resolve()
        self.state_file = self.state_dir / "lab.json"
        self.key = self.state_dir / "id_ed25519"
        self.known_hosts = self.state_dir / "known_hosts"

    # state ---------------------------------------------------------------
    def load(self) -> dict:
        if not self.state_file.exists():
            return {}
        return json.loads(self.state_file.read_text())

    def _save(self, state: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)

    # up ------------------------------------------------------------------
    def up(self, hosts: list[tuple[str, str]], gateway: str = DEFAULT_GATEWAY) -> dict:
        """Boot ``hosts`` ([(name, address)]) and return the lab description."""
        if os.geteuid() != 0:
            raise LabError("test hosts need root (mounts, network namespaces, systemd-nspawn)")
        for tool in ("systemd-nspawn", "ip", "ssh", "ssh-keygen", "debootstrap"):
            if shutil.which(tool) is None:
                raise LabError(f"{tool} not found: run 'sudo bash scripts/install-deps.sh'")
        if self.load().get("hosts"):
            raise LabError(f"{self.state_file} already describes a lab: run 'down --state-dir {self.state_dir}' first")
        gw = ipaddress.ip_interface(gateway)
        names = [n for n, _ in hosts]
        if len(set(names)) != len(names) or not hosts:
            raise LabError(f"host names must be unique and at least one given: {names}")
        for name, addr in hosts:
            if not name.replace("-", "").replace("_", "").isalnum() or len(name) > 32:
                raise LabError(f"bad host name {name!r}: letters, digits, - and _ only, 32 at most")
            if ipaddress.ip_address(addr) not in gw.network or ipaddress.ip_address(addr) == gw.ip:
                raise LabError(f"address {addr} of {name} must be in {gw.network} and differ from the gateway {gw.ip}")
            if not (gw.network.subnet_of(ipaddress.ip_network("198.51.100.0/24"))
                    or gw.network.subnet_of(ipaddress.ip_network("203.0.113.0/24"))):
                raise LabError("test hosts use documentation ranges only (198.51.100.0/24, 203.0.113.0/24)")
        owner = owner_from_env()
        # The overlay's upper dir becomes each guest's '/': under a caller's umask of 077 (a
        # hardened shell, or a CLI that set it earlier in the same process) it would be 0700,
        # every non-root daemon would be locked out and the boot would never finish (dbus hangs).
        with umask(0o022):
            rootfs = ensure_rootfs()
            self.state_dir.mkdir(parents=True, exist_ok=True)
            with gateway_claimed(gw, reclaim=reclaim_dead_lab):
                return self._up_claimed(hosts, gw, rootfs, owner)

    def _up_claimed(self, hosts: list[tuple[str, str]], gw: ipaddress.IPv4Interface, rootfs: Path,
                    owner: dict | None) -> dict:
        lab_id = secrets.token_hex(2)
        state = {
            "id": lab_id,
            "gateway": str(gw),
            "bridge": f"hsb{lab_id}",
            "bridge_created": False,
            "rootfs": str(rootfs),
            "key": str(self.key),
            "known_hosts": str(self.known_hosts),
            "owner": owner,
            "hosts": [],
        }
        self._save(state)
        try:
            if self.key.exists():
                self.key.unlink()
                self.key.with_suffix(".pub").unlink(missing_ok=True)
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"hs-testlab-{lab_id}", "-f", str(self.key)])
            run(["ip", "link", "add", state["bridge"], "type", "bridge"])
            state["bridge_created"] = True
            self._save(state)
            run(["ip", "addr", "add", str(gw), "dev", state["bridge"]])
            (OWNERS_DIR / state["bridge"]).write_text(str(self.state_dir) + "\n")
            run(["ip", "link", "set", state["bridge"], "up"])
            known = []
            for idx, (name, addr) in enumerate(hosts):
                host = {
                    "name": name,
                    "address": addr,
                    "netns": f"hs{lab_id}-{name}"[:32],
                    "veth": f"hsv{lab_id}{idx:x}",
                    "dir": str(self.state_dir / "hosts" / name),
                    "mounted": False,
                    "netns_created": False,
                    "pid": None,
                    "machine": f"hs{lab_id}-{name}"[:64],
                }
                state["hosts"].append(host)
                self._save(state)
                known.append(self._start_host(state, host, rootfs, hosts))
            self.known_hosts.write_text("".join(known))
            for host in state["hosts"]:
                self._wait_ready(host)
        except BaseException:
            log("up failed, removing what was created")
            self._down()  # up holds the labs' lock already
            raise
        return self.describe()

    def _start_host(self, state: dict, host: dict, rootfs: Path, all_hosts: list[tuple[str, str]]) -> str:
        hdir = Path(host["dir"])
        if hdir.exists():
            shutil.rmtree(hdir)
        for sub in ("upper", "work", "merged"):
            (hdir / sub).mkdir(parents=True)
        merged = hdir / "merged"
        host["mounted"] = True
        self._save(state)
        run(["mount", "-t", "overlay", "overlay", "-o",
              f"lowerdir={rootfs},upperdir={hdir / 'upper'},workdir={hdir / 'work'}", str(merged)])
        host_line = self._prepare_guest(merged, host, all_hosts)

        host["netns_created"] = True
        self._save(state)
        ns, veth = host["netns"], host["veth"]
        prefix = ipaddress.ip_interface(state["gateway"]).network.prefixlen
        run(["ip", "netns", "add", ns])
        run(["ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "g"])
        run(["ip", "link", "set", veth + "g", "netns", ns])
        run(["ip", "-n", ns, "link", "set", veth + "g", "name", "eth0"])
        run(["ip", "-n", ns, "addr", "add", f"{host['address']}/{prefix}", "dev", "eth0"])
        run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        run(["ip", "-n", ns, "link", "set", "lo", "up"])
        run(["ip", "link", "set", veth, "master", state["bridge"]])
        run(["ip", "link", "set", veth, "up"])

        log = open(hdir / "console.log", "w")
        # --register=no/--keep-unit: this machine's PID 1 is not systemd (no machined, no scopes).
        # Under boot_loop.py: a guest that reboots (exit 133) is booted again, as a machine comes back.
        proc = subprocess.Popen(
            [sys.executable, str(HERE / "boot_loop.py"), "--", "systemd-nspawn", "--boot", "--quiet", "--directory", str(merged), "--machine", host["machine"],
             f"--network-namespace-path=/run/netns/{ns}", "--register=no", "--keep-unit",
             "--console=passive", "--resolv-conf=off", "--timezone=off", "--link-journal=no",
             # Like a real PID 1, let the guest's systemd grant LimitMEMLOCK=infinity to services
             # (only where this machine may raise hard limits: CAP_SYS_RESOURCE; else a no-op).
             "--rlimit=RLIMIT_MEMLOCK=infinity"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        host["pid"] = proc.pid
        host["pid_start"] = proc_start_time(proc.pid)
        self._save(state)
        return host_line

    def _prepare_guest(self, merged: Path, host: dict, all_hosts: list[tuple[str, str]]) -> str:
        name = host["name"]
        (merged / "etc/hostname").write_text(name + "\n")
        lines = ["127.0.0.1 localhost\n", f"127.0.1.1 {name}\n"]
        lines += [f"{a} {n}\n" for n, a in all_hosts if n != name]
        (merged / "etc/hosts").write_text("".join(lines))
        (merged / "etc/machine-id").write_text(secrets.token_hex(16) + "\n")
        ssh_dir = merged / "root/.ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        (ssh_dir / "authorized_keys").write_text(self.key.with_suffix(".pub").read_text())
        os.chmod(ssh_dir / "authorized_keys", 0o600)
        hostkey = merged / "etc/ssh/ssh_host_ed25519_key"
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"root@{name}", "-f", str(hostkey)])
        (merged / "etc/ssh/sshd_config.d/hs-testhost.conf").write_text(
            "HostKey /etc/ssh/ssh_host_ed25519_key\nUseDNS no\nPasswordAuthentication no\n"
        )
        keytype, keydata = hostkey.with_suffix(".pub").read_text().split()[:2]
        return f"{host['address']},{name} {keytype} {keydata}\n"

    def _ssh_base(self, host: dict) -> list[str]:
        return ["ssh", "-i", str(self.key), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
                "-o", f"UserKnownHostsFile={self.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "ConnectTimeout=3", "-l", "root", host["address"]]

    def _wait_ready(self, host: dict) -> None:
        """Return once the guest's systemd has finished booting ('running' or 'degraded') over SSH.

        Polls ``systemctl is-system-running`` (no ``--wait``: a boot job that hangs must not hang
        this call); on time-out the error carries the guest's pending jobs, failed units and console.
        """
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        last = ""
        restarts = 0
        for _ in range(BOOT_TIMEOUT_S * 2):  # bounded in count too: each try sleeps 0.5 s at least
            if not alive(host["pid"], host.get("pid_start")):
                raise LabError(f"{host['name']}: systemd-nspawn exited during boot; see {host['dir']}/console.log")
            try:
                # booted, and open to users other than root (pam_nologin's /run/nologin gone: the shipping
                # user's SSH was refused "System is booting up" on a host systemd called degraded)
                proc = run(self._ssh_base(host) + ["systemctl is-system-running; test ! -e /run/nologin || "
                                                   "echo /run/nologin"], check=False, timeout=15)
                last = (proc.stdout + proc.stderr).strip()
                said = proc.stdout.split()
                if said[:1] in (["running"], ["degraded"]) and "/run/nologin" not in said:
                    return
                if said[:1] == ["degraded"] and restarts < 2 and self._user_sessions_failed(host):
                    restarts += 1
                    continue
            except subprocess.TimeoutExpired:
                last = "ssh did not answer within 15s"
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
        raise LabError(f"{host['name']} ({host['address']}) did not finish booting in {BOOT_TIMEOUT_S}s"
                       f" (last answer: {last or 'none'}){self._boot_report(host)}")

    def _user_sessions_failed(self, host: dict) -> bool:
        """systemd-user-sessions.service (what removes /run/nologin) failed at boot, seen once on a loaded 2-core
        CI machine: logins but root's would stay refused for good. Restarted, said with its journal."""
        proc = run(self._ssh_base(host) + ["systemctl is-failed --quiet systemd-user-sessions.service && "
                                           "journalctl -b --no-pager -n 5 -u systemd-user-sessions.service"],
                   check=False, timeout=15)
        if proc.returncode != 0:
            return False
        log(f"{host['name']}: systemd-user-sessions.service failed at boot, restarting it: {proc.stdout.strip()}")
        run(self._ssh_base(host) + ["systemctl restart systemd-user-sessions.service"], check=False, timeout=30)
        return True

    def _boot_report(self, host: dict) -> str:
        """What a stuck boot is waiting for: the guest's job queue, failed units, console tail."""
        parts = []
        try:
            proc = run(self._ssh_base(host) + ["systemctl --no-pager list-jobs; systemctl --no-pager --failed"],
                        check=False, timeout=15)
            parts.append((proc.stdout + proc.stderr).strip())
        except subprocess.TimeoutExpired:
            parts.append("(ssh to the guest did not answer)")
        console = Path(host["dir"]) / "console.log"
        if console.exists():
            tail = console.read_text(errors="replace").splitlines()[-20:]
            parts.append(f"last lines of {console}:\n" + "\n".join(tail))
        return "".join(f"\n{p}" for p in parts if p)

    # down ----------------------------------------------------------------
    def down(self) -> None:
        """Stop and remove everything recorded in the state file. Idempotent."""
        with labs_locked():
            self._down()

    def running(self) -> bool:
        """True while any recorded host's systemd-nspawn still runs (by its recorded pid and start)."""
        return any(alive(h.get("pid"), h.get("pid_start")) for h in self.load().get("hosts", []))

    def orphaned(self) -> bool:
        """True when the lab recorded an owner (see gateway.OWNER_ENV) and that process is gone: nobody will take it down."""
        owner = self.load().get("owner")
        return bool(owner) and not alive(owner["pid"], owner["start"])

    def _down(self) -> None:
        state = self.load()
        if not state:
            return
        errors = []
        # every host powers off at once (nspawn turns SIGTERM into an orderly shutdown), then each is waited for
        started = time.monotonic()
        for host in state.get("hosts", []):
            if host.get("pid") and alive(host["pid"], host.get("pid_start")):
                log(f"{host['name']}: shutting down (boot loop pid {host['pid']}, up to {STOP_TIMEOUT_S}s)")
                os.kill(host["pid"], signal.SIGTERM)
        for host in reversed(state.get("hosts", [])):
            try:
                remove_host(host, STOP_TIMEOUT_S)
                log(f"{host['name']}: stopped and removed ({time.monotonic() - started:.1f}s)")
            except Exception as exc:  # keep cleaning the rest
                errors.append(f"{host['name']}: {exc}")
        if state.get("bridge_created"):
            if run(["ip", "link", "show", state["bridge"]], check=False).returncode == 0:
                run(["ip", "link", "del", state["bridge"]], check=False)
            (OWNERS_DIR / state["bridge"]).unlink(missing_ok=True)
        if errors:
            self._save(state)
            raise LabError("down left things behind: " + "; ".join(errors))
        for sub in ("hosts",):
            shutil.rmtree(self.state_dir / sub, ignore_errors=True)
        for path in (self.state_file, self.key, self.key.with_suffix(".pub"), self.known_hosts):
            path.unlink(missing_ok=True)

    # helpers -------------------------------------------------------------
    def describe(self) -> dict:
        state = self.load()
        return {
            "state_dir": str(self.state_dir),
            "key": state.get("key"),
            "known_hosts": state.get("known_hosts"),
            "gateway": state.get("gateway"),
            # Each host entry is also a molecule instance-config entry.
            "hosts": [{"name": h["name"], "instance": h["name"], "address": h["address"], "user": "root",
                       "port": 22, "identity_file": state.get("key")}
                      for h in state.get("hosts", [])],
        }

    def ssh(self, name: str, command: str, check: bool = True, timeout: int = 120) -> subprocess.CompletedProcess:
        host = next((h for h in self.load().get("hosts", []) if h["name"] == name), None)
        if host is None:
            raise LabError(f"no host {name!r} in {self.state_file}")
        return run(self._ssh_base(host) + [command], check=check, timeout=timeout)

    def ansible_inventory(self, group: str = "all") -> dict:
        """An Ansible YAML/JSON inventory for the lab (strict host key checking on)."""
        d = self.describe()
        common = (f"-o UserKnownHostsFile={d['known_hosts']} -o StrictHostKeyChecking=yes -o IdentitiesOnly=yes")
        hosts = {h["name"]: {"ansible_host": h["address"], "ansible_user": "root",
                             "ansible_ssh_private_key_file": d["key"], "ansible_ssh_common_args": common}
                 for h in d["hosts"]}
        return {group: {"hosts": hosts}}


def reclaim_dead_lab(state_dir: Path) -> bool:
    """Remove the lab in ``state_dir`` if nobody will take it down; True if removed.

    Nobody will: none of its hosts runs (a killed run left it), or its recorded owner is gone
    (a test worker killed while its lab still ran). Called by ``up`` under the labs' lock about
    the lab holding its gateway, so no lab is being made or removed meanwhile; the removal goes
    by the lab's own recorded ids (its hosts are stopped by their recorded pids).
    """
    lab = Lab(state_dir)
    if not lab.load():
        return False
    if not lab.running():
        why = "none of its hosts runs (left by a run that was killed before its down)"
    elif lab.orphaned():
        owner = lab.load()["owner"]["pid"]
        why = f"its hosts run but its owner, pid {owner}, is gone (killed before it took the lab down)"
    else:
        return False
    log(f"the lab in {state_dir} holds the gateway but {why}: removing it by its recorded ids")
    lab._down()
    return True


def _parse_host(spec: str) -> tuple[str, str]:
    name, sep, addr = spec.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--host wants NAME=ADDRESS, got {spec!r}")
    return name, addr


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="boot test hosts")
    p_up.add_argument("--state-dir", required=True)
    p_up.add_argument("--host", action="append", type=_parse_host, required=True, help="NAME=ADDRESS (repeat)")
    p_up.add_argument("--gateway", default=DEFAULT_GATEWAY, help="this machine's address on the lab bridge")
    p_down = sub.add_parser("down", help="stop and remove the lab's hosts")
    p_down.add_argument("--state-dir", required=True)
    p_status = sub.add_parser("status", help="print the lab description")
    p_status.add_argument("--state-dir", required=True)
    sub.add_parser("rootfs", help="build the cached root filesystem")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            started = time.monotonic()
            print(json.dumps(Lab(args.state_dir).up(args.host, args.gateway), indent=2))
            log(f"{len(args.host)} host(s) up in {time.monotonic() - started:.1f}s")
        elif args.cmd == "down":
            Lab(args.state_dir).down()
        elif args.cmd == "status":
            print(json.dumps(Lab(args.state_dir).describe(), indent=2))
        elif args.cmd == "rootfs":
            print(ensure_rootfs())
    except LabError as exc:
        print(f"testhosts: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
