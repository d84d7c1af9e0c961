"""Apply, verify and revert the capture patch on an installed SGLang, without importing it.

Everything here is standard library: it runs on hosts where importing SGLang or torch
needs a GPU, and in Ansible before anything else is installed.
"""

from __future__ import annotations

import ast
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

from hs_patch.files import write_all
from hs_patch.host.patching.earlier import from_earlier_layout, from_earlier_patch
from hs_patch.families import LAYER_POINT
from hs_patch.releases import (RELEASES, TARGET, PatchError, Release, apply_edits, by_patched_sha,
                               by_pristine_sha)

BACKUP_SUFFIX = ".hs_patch.orig"
TARGET_DIR = os.path.dirname(TARGET)
SUPPORTED = f"every release from {next(iter(RELEASES))} to {list(RELEASES)[-1]}"


class Refused(Exception):
    """The target is not something we can safely patch; nothing was written (exit 2)."""


class VerifyFailed(Exception):
    """The patch is absent or damaged (exit 3)."""


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


def pristine_text(release: Release, patched: str) -> str:
    """Undo the edits (each replacement occurs exactly once in the patched text)."""
    for edit in reversed(release.edits):
        if patched.count(edit.replacement) != 1:
            raise PatchError(f"cannot undo an edit of {release.version}: the patched text was changed")
        patched = patched.replace(edit.replacement, edit.anchor)
    return patched


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


# --------------------------------------------------------------------------- AST checks


def _calls(node: ast.AST, dotted: str) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call) and ast.unparse(n.func) == dotted]


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for c in tree.body:
        if isinstance(c, ast.ClassDef) and c.name == cls:
            for f in c.body:
                if isinstance(f, ast.FunctionDef) and f.name == name:
                    return f
    raise VerifyFailed(f"{cls}.{name} not found")


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise VerifyFailed(f"the capture hook is not where it must be: {what}")


def check_patched(text: str, release: Release) -> None:
    """Check on the syntax tree that the hook sits where it must, and nothing else changed.

    - ``DeepseekV2Model.__init__`` attaches the hook only inside ``if ... HS_CAPTURE ...``,
      and imports ``hs_patch`` only there;
    - ``forward`` begins the pass before the layer loop, passes ``_hs.collector(i, ...)``
      as every layer's ``captured_last_layer_outputs``, captures the pre-norm state at the
      final norm, and finishes after the norm and before returning;
    - the decoder layer hands the hook what its attention reads right after its input step
      (the family's ``prepare``); the layer-point family's also captures ``residual`` there;
    - undoing the edits gives back the release's pristine file, byte for byte.
    """
    tree = ast.parse(text)
    init = _method(tree, "DeepseekV2Model", "__init__")
    attach = _calls(init, "_hs_attach")
    _need(len(attach) == 1 and ast.literal_eval(attach[0].args[2]) == release.version,
          "DeepseekV2Model.__init__ must call _hs_attach(self, config, release) once")
    guards = [n for n in ast.walk(init) if isinstance(n, ast.If) and "HS_CAPTURE" in ast.unparse(n.test)]
    _need(len(guards) == 1 and attach[0] in list(ast.walk(guards[0])), "_hs_attach must be under `if HS_CAPTURE`")
    imports = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("hs_patch")]
    _need(len(imports) == 1 and imports[0] in list(ast.walk(guards[0])),
          "hs_patch may be imported only under `if HS_CAPTURE`")

    fwd = _method(tree, "DeepseekV2Model", "forward")
    begin = _calls(fwd, "self._hs_capture.begin")
    loops = [n for n in fwd.body if isinstance(n, ast.For) and ast.unparse(n.iter).startswith("range(normal_start")]
    _need(len(begin) == 1 and len(loops) == 1 and begin[0].lineno < loops[0].lineno,
          "forward must call self._hs_capture.begin once, before the layer loop")
    layer_calls = [c for c in _calls(loops[0], "layer")]
    _need(len(layer_calls) == 1, "the layer loop must call layer(...) once")
    kw = {k.arg: k.value for k in layer_calls[0].keywords}
    cap = kw.get("captured_last_layer_outputs")
    _need(cap is not None and any(ast.unparse(c.func) == "_hs.collector" and ast.unparse(c.args[0]) == "i"
                                  for c in ast.walk(cap) if isinstance(c, ast.Call)),
          "each layer must get captured_last_layer_outputs=_hs.collector(i, ...)")
    pre = [n for n in ast.walk(fwd) if isinstance(n, ast.Attribute) and ast.unparse(n) == "_hs.final_prenorm"]
    finish = _calls(fwd, "_hs.finish")
    returns = [n for n in ast.walk(fwd) if isinstance(n, ast.Return)]
    _need(pre and all(loops[0].end_lineno < n.lineno for n in pre), "_hs.final_prenorm must follow the layer loop")
    _need(len(finish) == 1 and max(n.lineno for n in pre) < finish[0].lineno < returns[-1].lineno
          and ast.unparse(finish[0].args[0]) == "hidden_states",
          "_hs.finish(hidden_states) must come after the final norm and before the last return")

    lfwd = _method(tree, "DeepseekV2DecoderLayer", "forward")
    prepare = release.family.prepare
    prep = [n for n in lfwd.body if isinstance(n, ast.Assign) and _calls(n, prepare)]
    idx = lfwd.body.index(prep[0]) if len(prep) == 1 else -1
    nxt = lfwd.body[idx + 1] if idx >= 0 else None
    attn = _calls(nxt, "captured_last_layer_outputs.hs_attn_input") if isinstance(nxt, ast.If) else []
    _need(len(attn) == 1 and ast.unparse(attn[0].args[0]) == "hidden_states",
          f"the decoder layer must hand the hook its attention's input right after {prepare.split('.')[-1]}")
    if release.family is LAYER_POINT:
        _need("captured_last_layer_outputs" in [a.arg for a in lfwd.args.args],
              "DeepseekV2DecoderLayer.forward must take captured_last_layer_outputs")
        _need(_calls(nxt, "captured_last_layer_outputs.capture")
              and ast.unparse(_calls(nxt, "captured_last_layer_outputs.capture")[0].args[0]) == "residual",
              "the decoder layer must capture `residual` right after prepare_attn")

    try:
        original = pristine_text(release, text)
    except PatchError as e:
        raise VerifyFailed(f"the patched lines were changed ({e})") from None
    _need(_sha(original) == release.pristine_sha256,
          f"code outside the patched lines differs from SGLang {release.version}'s deepseek_v2.py")
