"""The test hosts' root filesystem: Debian 12 from debootstrap, built once and cached.

Each host boots on its own overlay of this one tree (:mod:`lab.testhosts`).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from pathlib import Path

from lab.hostcmd import file_locked, log, run

CACHE_DIR = Path(os.environ.get("HS_TESTHOSTS_CACHE", "/var/cache/hs-patch-tests"))
MIRROR = os.environ.get("HS_TESTHOSTS_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"
# What the test hosts need: sshd, python for Ansible (+ python3-apt for the apt
# module, acl for become_user), venv for the project's venv, systemd as PID 1,
# rsync for shipping, procps for ps/kill in tests. The roles' Debian package
# lists only name packages from this list: the guests have no network.
PACKAGES = (
    "openssh-server,openssh-client,python3,python3-venv,python3-apt,systemd,systemd-sysv,"
    "dbus,iproute2,rsync,sudo,ca-certificates,acl,procps"
)
ROOTFS_REVISION = "1"  # bump when the post-processing below changes


def rootfs_path() -> Path:
    tag = hashlib.sha256(f"{SUITE}|{PACKAGES}|{ROOTFS_REVISION}".encode()).hexdigest()[:10]
    return CACHE_DIR / f"{SUITE}-{tag}"


def ensure_rootfs() -> Path:
    """Return the cached root filesystem, building it once (about 45 s) under a lock."""
    final = rootfs_path()
    if (final / ".hs-rootfs-ok").exists():
        return final
    with file_locked(CACHE_DIR / ".lock"):
        if (final / ".hs-rootfs-ok").exists():
            return final
        tmp = final.with_name(final.name + ".tmp")
        if tmp.exists():
            shutil.rmtree(tmp)
        log(f"building root filesystem {final} (debootstrap {SUITE}, ~1 min)")
        run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, str(tmp), MIRROR])
        # Every host gets its own SSH host key at boot time (see _prepare_guest).
        for key in (tmp / "etc/ssh").glob("ssh_host_*"):
            key.unlink()
        (tmp / "etc/machine-id").write_text("")
        # No apt network here: keep apt from trying periodic jobs.
        for unit in ("apt-daily.timer", "apt-daily-upgrade.timer"):
            link = tmp / "etc/systemd/system" / unit
            if not link.exists():
                link.symlink_to("/dev/null")
        (tmp / ".hs-rootfs-ok").write_text(time.strftime("%Y-%m-%dT%H:%M:%S\n"))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        return final
