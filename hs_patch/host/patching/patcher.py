"""Apply, verify and revert the capture patch on an installed SGLang, without importing it.

Everything here is standard library: it runs on hosts where importing SGLang or torch
needs a GPU, and in Ansible before anything else is installed.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import os
import pwd
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from hs_patch.engine.releases import (RELEASES, TARGET, Release, apply_edits, by_patched_sha, by_pristine_sha,
                                      pristine_text)
from hs_patch.host.patching.earlier import from_earlier_layout, from_earlier_patch
from hs_patch.host.patching.hook_check import VerifyFailed, check_patched
from hs_patch.samples.files import write_all

BACKUP_SUFFIX = ".hs_patch.orig"
TARGET_DIR = os.path.dirname(TARGET)
SUPPORTED = f"every release from {next(iter(RELEASES))} to {list(RELEASES)[-1]}"


class Refused(Exception):
    """The target is not something we can safely patch; nothing was written (exit 2)."""


def default_site() -> Path:
    """The directory holding ``sglang/`` for the running interpreter (venv, PYTHONPATH or
    editable install), found with ``find_spec``, which locates without importing."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise Refused("SGLang is not installed for this Python; pass --site DIR (the directory that "
                      "contains sglang/), or run the hs-patch of the venv that has SGLang")
    return Path(list(spec.submodule_search_locations)[0]).parent


@dataclass
class Target:
    site: Path
    path: Path
    sha256: str
    text: str
    release: Release | None
    state: str  # pristine | patched | outdated (patched by an earlier hs-patch) | unknown
    installed_version: str | None
    backup: Path = field(init=False)

    def __post_init__(self) -> None:
        self.backup = self.path.with_name(self.path.name + BACKUP_SUFFIX)

    def describe(self) -> dict:
        return {"path": str(self.path), "sha256": self.sha256, "state": self.state}


def _installed_version(site: Path) -> str | None:
    """The installed SGLang version from its dist-info (or ``sglang/_version.py``), without importing it."""
    import importlib.metadata

    found = sorted({d.version for d in importlib.metadata.distributions(path=[str(site)])
                    if (d.metadata["Name"] or "").lower() == "sglang"})
    if len(found) > 1:  # which one the file belongs to would be a guess (0.5.12 and 0.5.12.post1 share it)
        raise Refused(f"{site} holds the metadata of {len(found)} SGLang installs ({', '.join(found)}): a broken "
                      "install; pip uninstall -y sglang until none is left, then install one release. Nothing was "
                      "written.")
    if found:
        return found[0]
    try:
        text = (site / "sglang" / "_version.py").read_text()
    except OSError:
        return None
    m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?["']([^"']+)["']""", text)
    return m.group(1) if m else None


def inspect_target(site: str | os.PathLike | None) -> Target:
    """Read the installed ``deepseek_v2.py`` and classify it. Raises :class:`Refused`."""
    site = Path(site) if site else default_site()
    path = site / TARGET
    if not path.is_file():
        raise Refused(f"{path} does not exist: --site must be the directory that contains sglang/")
    data = path.read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    installed = _installed_version(site)
    release, state = by_pristine_sha(sha, installed), "pristine"  # a shared file: the installed release
    if release is None:
        release, state = by_patched_sha(sha), "patched"
    # every release's file is UTF-8; one that is not (a hand edit, a damaged copy) is no release's: unknown,
    # so status reports it and apply/verify/revert refuse it like any other unknown file
    text = data.decode("utf-8", errors="replace")
    if release is None:
        current = from_earlier_layout(text)
        release, state = by_patched_sha(_sha(current)), "outdated"
        if release is None:  # patched by an hs-patch before the attention input was handed to the hook
            release, current = from_earlier_patch(current) or (None, current)
        text = current if release is not None else text
    if release is None:
        state = "unknown"
    return Target(site, path, sha, text, release, state, installed)


def _refuse_unknown(t: Target) -> Refused:
    hint = ""
    if t.installed_version and t.installed_version not in RELEASES:
        hint = f" SGLang {t.installed_version} is installed; install a supported one ({SUPPORTED})."
    elif t.installed_version:
        hint = (f" SGLang {t.installed_version} is installed but this file differs from its release"
                f" (edited by hand?); reinstall with pip install --force-reinstall --no-deps "
                f"sglang=={t.installed_version}.")
    return Refused(f"{t.path} has sha256 {t.sha256}, which is neither the pristine nor the patched "
                   f"deepseek_v2.py of a supported SGLang release ({SUPPORTED}).{hint} hs-patch status shows the "
                   "nearest known release and what differs. Nothing was written.")


def check_version(t: Target) -> None:
    if t.release and t.installed_version and t.installed_version != t.release.version:
        raise Refused(f"{t.path} is the file of SGLang {t.release.version} but the installed SGLang's metadata "
                      f"(its dist-info, else sglang/_version.py, in "
                      f"{t.site}) says {t.installed_version}: a mixed install; reinstall with pip "
                      f"install --force-reinstall --no-deps sglang=={t.installed_version}. Nothing was written.")


def _atomic_write(path: Path, data: bytes, like: Path) -> None:
    """Write ``data`` to ``path`` via a temp file + fsync + rename, with ``like``'s mode and owner.

    Every byte is checked written (a nearly full disk raises instead of leaving a short
    file); on any error the temp file is removed and ``path`` is left as it was.
    """
    st = like.stat()
    tmp = path.with_name(f".{path.name}.hs_patch.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            write_all(fd, data)
            os.fchmod(fd, st.st_mode & 0o7777)
            try:
                os.fchown(fd, st.st_uid, st.st_gid)
            except PermissionError:
                pass
            os.fsync(fd)
        finally:
            os.close(fd)
        if tmp.stat().st_size != len(data) or tmp.read_bytes() != data:
            raise OSError(f"{tmp}: what is on disk differs from what was written")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _drop_pycache(path: Path) -> list[str]:
    removed = []
    for pyc in (path.parent / "__pycache__").glob(f"{path.stem}.*.pyc"):
        pyc.unlink(missing_ok=True)
        removed.append(str(pyc))
    return removed


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def result(action: str, t: Target, changed: bool, message: str, **extra) -> dict:
    return {"action": action, "changed": changed, "release": t.release.version if t.release else None,
            "state": t.state, "site": str(t.site), "files": [t.describe()], "message": message, **extra}


@contextlib.contextmanager
def _one_at_a_time(site: str | os.PathLike | None) -> Iterator[Path]:
    """Hold an exclusive lock on the directory of ``deepseek_v2.py`` (flock; released when the process ends,
    however it ends) while one apply or revert reads, decides and writes: two at once (two Ansible runs,
    an operator beside one) would share the temp file and one fail midway. Yields the site."""
    site = Path(site) if site else default_site()
    try:
        fd = os.open(site / TARGET_DIR, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # no such directory: inspect_target says what --site must be
        fd = -1
    try:
        if fd >= 0:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # a file system without locks (NFS without lockd): go on unlocked, as before
                pass
        yield site
    finally:
        if fd >= 0:
            os.close(fd)


def apply(site: str | os.PathLike | None = None) -> dict:
    with _one_at_a_time(site) as where:
        try:
            return _apply(where)
        except OSError as e:
            raise _cannot_write(where, e) from None


def _apply(site: Path) -> dict:
    t = inspect_target(site)
    if t.state == "unknown":
        raise _refuse_unknown(t)
    check_version(t)
    release = t.release
    if t.state == "patched":
        if not t.backup.exists():  # restore the keepsake for revert
            _atomic_write(t.backup, pristine_text(release, t.text).encode(), t.path)
        check_patched(t.text, release)
        return result("apply", t, False, f"already applied (SGLang {release.version}); nothing changed")
    if t.state == "outdated":  # t.text is already today's patched text
        check_patched(t.text, release)
        if not t.backup.exists():
            _atomic_write(t.backup, pristine_text(release, t.text).encode(), t.path)
        _atomic_write(t.path, t.text.encode(), t.path)
        _drop_pycache(t.path)
        return result("apply", inspect_target(t.site), True,
                      f"upgraded the patch of an earlier hs-patch on SGLang {release.version}: {t.path}")
    patched = apply_edits(release, t.text)
    if _sha(patched) != release.patched_sha256:
        raise Refused(f"internal error: patching {release.version} gave sha256 {_sha(patched)}, expected "
                      f"{release.patched_sha256}. Nothing was written; please report this.")
    check_patched(patched, release)
    compile(patched, str(t.path), "exec")
    _atomic_write(t.backup, t.text.encode(), t.path)
    _atomic_write(t.path, patched.encode(), t.path)
    _drop_pycache(t.path)
    after = inspect_target(t.site)
    return result("apply", after, True, f"patched SGLang {release.version}: {t.path}")


def verify(site: str | os.PathLike | None = None) -> dict:
    t = inspect_target(site)
    if t.state == "pristine":
        raise VerifyFailed(f"{t.path} is the pristine file of SGLang {t.release.version}: run hs-patch apply")
    if t.state == "unknown":
        msg = str(_refuse_unknown(t)).replace(" Nothing was written.", "")
        if t.backup.exists():
            msg += (f" It was patched and then changed (the original is kept at {t.backup}): reinstall "
                    "SGLang, then run hs-patch apply.")
        raise VerifyFailed(msg)
    if t.state == "outdated":
        raise VerifyFailed(f"{t.path} was patched by an earlier hs-patch (its hook calls no longer match this "
                           "hs_patch: the hook refuses its passes): run hs-patch apply to upgrade the patch")
    try:
        check_version(t)
    except Refused as e:  # verify writes nothing: it failed (exit 3), like any other wrong install
        raise VerifyFailed(str(e).replace(" Nothing was written.", "")) from None
    try:
        compile(t.text, str(t.path), "exec")
    except SyntaxError as e:
        raise VerifyFailed(f"{t.path} does not compile: {e}") from None
    check_patched(t.text, t.release)
    return result("verify", t, False, f"patch intact on SGLang {t.release.version}: {t.path}")


def revert(site: str | os.PathLike | None = None) -> dict:
    with _one_at_a_time(site) as where:
        try:
            return _revert(where)
        except OSError as e:
            raise _cannot_write(where, e) from None


def _cannot_write(site: Path, e: OSError) -> OSError:
    """A write refused by permissions or a read-only mount, said with the directory and what to do next
    (otherwise: the error as it is). The temp file is gone and ``deepseek_v2.py`` is whole, old or new."""
    if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
        return e
    d = Path(e.filename).parent if e.filename else site / TARGET_DIR  # models/, or its __pycache__/
    try:
        owner = pwd.getpwuid(d.stat().st_uid).pw_name
    except (OSError, KeyError):
        owner = "the owner of the venv"
    how = ("it is on a read-only mount: remount it read-write, or patch the venv where it is built"
           if e.errno == errno.EROFS else f"run hs-patch as {owner}, who owns it" + ("" if owner == "root" else
                                                                                     " (or as root)"))
    return type(e)(e.errno, f"cannot write in {d} ({e.strerror}): {how}; hs-patch status shows what was left")


def _revert(site: Path) -> dict:
    t = inspect_target(site)
    if t.state == "unknown":
        raise _refuse_unknown(t)
    if t.state == "pristine":
        t.backup.unlink(missing_ok=True)
        return result("revert", t, False, f"not patched (pristine SGLang {t.release.version}); nothing changed")
    release = t.release
    original = None
    if t.backup.exists():
        data = t.backup.read_bytes()
        if hashlib.sha256(data).hexdigest() == release.pristine_sha256:
            original = data
    if original is None:
        original = pristine_text(release, t.text).encode()
        if hashlib.sha256(original).hexdigest() != release.pristine_sha256:
            raise Refused(f"cannot rebuild the original {t.path}; reinstall sglang=={release.version}")
    _atomic_write(t.path, original, t.path)
    t.backup.unlink(missing_ok=True)
    _drop_pycache(t.path)
    return result("revert", inspect_target(t.site), True, f"restored the original {t.path}")
