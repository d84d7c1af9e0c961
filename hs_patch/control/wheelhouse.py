"""Build the offline wheelhouse for a GPU host: the complete wheel set of one SGLang pin.

Run on any machine that reaches the package index (the control node is fine):

    python3 -m hs_patch.control.wheelhouse --pin 0.5.9 --dest wheelhouse
    python3 -m hs_patch.control.wheelhouse --pin 0.5.9 --pin 0.5.21 --dest wheelhouse --resolve-only

For each pin it resolves ``sglang==PIN`` with pip for the GPU host's interpreter and
platform (CPython 3.12, x86_64, every manylinux tag from 2_17 to the host's glibc, 2_39 on
Ubuntu 24.04, plus the legacy manylinux1/2010/2014 aliases: the set mixes all of them; a
single tag resolves no pin), applies the release's ``pip_overrides`` (hs_patch.engine.releases;
0.5.9's cuDNN) over the resolved set, and writes ``DEST/PIN/requirements.txt``: every
package pinned to one file by sha256. Then it downloads exactly those files with
``pip download --no-deps --require-hashes`` (``--resolve-only`` stops before: no wheel is
downloaded, only metadata). The GPU host installs the set with ``pip install --no-index
--no-deps --require-hashes -r requirements.txt``: no resolution on the host, so it gets
precisely what was resolved here. A release with ``replaces`` (0.5.18 .. 0.5.22: cuda-tile,
whose pinned 1.6.0rc5 PyPI serves only as a stub that downloads from pypi.nvidia.com while
installing) resolves sglang alone, then its own requirements with those replaced.

Resolution uses pip's ``--dry-run --report`` with ``--use-feature=fast-deps``: pip reads
each wheel's metadata from the index (PEP 658) or, where an index does not serve it, with
HTTP range requests, instead of downloading the wheels (torch, cuDNN and cuBLAS are
gigabytes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from hs_patch.control.sglang_requires import ReplaceError, replaced_requirements
from hs_patch.engine.releases import RELEASES
from hs_patch.samples.store import file_sha256, write_text_atomic

PYTHON_VERSION = "3.12"
GLIBC_MAX = 39  # Ubuntu 24.04 ships glibc 2.39
LOCK = "requirements.txt"
REPORT = "resolution.json"


class WheelhouseError(RuntimeError):
    """The wheel set cannot be built; the message says what to do."""


@dataclass(frozen=True)
class Target:
    """The GPU host's interpreter and platform, as pip's --python-version/--platform see them."""

    python_version: str = PYTHON_VERSION
    glibc_max: int = GLIBC_MAX
    arch: str = "x86_64"

    def platforms(self) -> list[str]:
        tags = [f"manylinux_2_{m}_{self.arch}" for m in range(self.glibc_max, 16, -1)]
        return tags + [f"manylinux2014_{self.arch}", f"manylinux2010_{self.arch}", f"manylinux1_{self.arch}"]

    def pip_args(self) -> list[str]:
        abi = "cp" + self.python_version.replace(".", "")
        out = ["--only-binary=:all:", "--python-version", self.python_version, "--implementation", "cp", "--abi", abi]
        for tag in self.platforms():
            out += ["--platform", tag]
        return out

    def marker_env(self) -> dict[str, str]:
        """Environment markers of the host, to evaluate requirements as pip does there."""
        return {"python_version": self.python_version, "python_full_version": self.python_version + ".0",
                "sys_platform": "linux", "platform_system": "Linux", "platform_machine": self.arch,
                "os_name": "posix", "implementation_name": "cpython",
                "platform_python_implementation": "CPython", "extra": ""}


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    filename: str
    url: str
    sha256: str
    requires: tuple[str, ...] = ()

    def lock_line(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _pip(pip: Sequence[str], args: Sequence[str], timeout: int) -> subprocess.CompletedProcess:
    cmd = [*pip, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        raise WheelhouseError(f"pip ran past {timeout}s: {' '.join(cmd[:6])} ...; is the index reachable?") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-25:])
        raise WheelhouseError(f"pip failed (exit {proc.returncode}) for {' '.join(args[-3:])}:\n{tail}")
    return proc


def resolve(requirements: Sequence[str], target: Target, *, pip: Sequence[str], index_args: Sequence[str] = (),
            no_deps: bool = False, timeout: int = 1800) -> list[Wheel]:
    """The wheels pip would install for ``requirements`` on ``target``, downloading metadata only."""
    with tempfile.TemporaryDirectory(prefix="hs-wheelhouse-") as tmp:
        report = Path(tmp) / "report.json"
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--disable-pip-version-check",
                "--use-feature=fast-deps", "--report", str(report), "--target", str(Path(tmp) / "t"),
                *target.pip_args(), *index_args, *(["--no-deps"] if no_deps else []), *requirements]
        _pip(pip, args, timeout)
        data = json.loads(report.read_text())
    wheels = []
    for item in data.get("install", []):
        meta, info = item["metadata"], item["download_info"]
        sha = (info.get("archive_info", {}).get("hashes") or {}).get("sha256") \
            or (info.get("archive_info", {}).get("hash", "").partition("sha256=")[2])
        filename = info["url"].rsplit("/", 1)[-1].split("#")[0]
        if not filename.endswith(".whl") or not sha:
            raise WheelhouseError(f"{meta['name']} {meta['version']}: no wheel with a sha256 ({info['url']}); "
                                  "the GPU host installs wheels only")
        wheels.append(Wheel(meta["name"], meta["version"], filename, info["url"], sha,
                            tuple(meta.get("requires_dist") or ())))
    return sorted(wheels, key=lambda w: _norm(w.name))


def apply_overrides(wheels: list[Wheel], overrides: list[Wheel], target: Target) -> list[Wheel]:
    """Replace resolved wheels by the override wheels, after checking the overrides' own needs."""
    from packaging.requirements import Requirement  # pip's own dependency; on every control node

    by_name = {_norm(w.name): w for w in wheels}
    for o in overrides:
        by_name[_norm(o.name)] = o
    env = target.marker_env()
    for o in overrides:
        for spec in o.requires:
            req = Requirement(spec)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            have = by_name.get(_norm(req.name))
            if have is None or not req.specifier.contains(have.version, prereleases=True):
                raise WheelhouseError(f"override {o.name}=={o.version} needs {spec}, the set has "
                                      f"{have.name + '==' + have.version if have else 'none'}: change the override "
                                      "in hs_patch/engine/releases.py")
    return sorted(by_name.values(), key=lambda w: _norm(w.name))


def lock_text(pin: str, wheels: list[Wheel], overrides: Sequence[str], replaces: Sequence[str] = ()) -> str:
    head = [f"# sglang=={pin}: the complete wheel set, written by python3 -m hs_patch.control.wheelhouse.",
            "# Install with: pip install --no-index --find-links DIR --no-deps --require-hashes -r requirements.txt"]
    head += [f"# override (installed over the resolved set): {o}" for o in overrides]
    head += [f"# replaces sglang's own requirement on the same package: {r}" for r in replaces]
    return "\n".join(head + [w.lock_line() for w in wheels]) + "\n"


def resolve_pin(pin: str, target: Target, *, pip: Sequence[str], index_args: Sequence[str] = (),
                extras: str = "") -> tuple[list[Wheel], dict[str, Any]]:
    """The complete locked set of one pin, and a summary of the resolution."""
    release = RELEASES.get(pin)
    if release is None:
        raise WheelhouseError(f"sglang {pin} is not a release hs-patch supports ({', '.join(RELEASES)})")
    started = time.monotonic()
    if release.replaces:
        sglang = resolve([f"sglang{extras}=={pin}"], target, pip=pip, index_args=index_args, no_deps=True)
        try:
            needs = replaced_requirements(sglang[0].requires, release.replaces, target.marker_env(), extras)
        except ReplaceError as e:
            raise WheelhouseError(str(e)) from None
        wheels = sorted(sglang + resolve(needs, target, pip=pip, index_args=index_args), key=lambda w: _norm(w.name))
    else:
        wheels = resolve([f"sglang{extras}=={pin}"], target, pip=pip, index_args=index_args)
    torch = next((w for w in wheels if _norm(w.name) == "torch"), None)
    if torch is None or torch.version.split("+")[0] != release.torch:
        raise WheelhouseError(f"sglang {pin} resolved torch {torch.version if torch else 'none'}, "
                              f"hs_patch.engine.releases says {release.torch}: update hs_patch/engine/releases.py")
    overrides = resolve(list(release.pip_overrides), target, pip=pip, index_args=index_args,
                        no_deps=True) if release.pip_overrides else []
    final = apply_overrides(wheels, overrides, target)
    tags = sorted({t for w in final for t in w.filename[:-4].split("-")[-1].split(".")})
    summary = {"pin": pin, "python": target.python_version, "packages": len(final),
               "overrides": list(release.pip_overrides), "replaces": list(release.replaces), "platform_tags_used": tags,
               "resolve_seconds": round(time.monotonic() - started, 1)}
    return final, summary


def download(dest: Path, target: Target, *, pip: Sequence[str], index_args: Sequence[str] = (),
             timeout: int = 7200) -> list[str]:
    """Fetch exactly the files of ``dest/requirements.txt`` and check each one's sha256; returns stale files."""
    _pip(pip, ["download", "--quiet", "--disable-pip-version-check", "--no-deps", "--require-hashes",
               "--dest", str(dest), *target.pip_args(), *index_args, "-r", str(dest / LOCK)], timeout)
    expected = json.loads((dest / REPORT).read_text())["files"]
    for name, sha in expected.items():
        path = dest / name
        if not path.is_file():
            raise WheelhouseError(f"{path} is missing after pip download: run the build again")
        size, digest = file_sha256(path)
        if digest != sha:
            raise WheelhouseError(f"{path}: sha256 {digest[:12]} is not the locked {sha[:12]}; delete it and rebuild")
    return sorted(p.name for p in dest.glob("*.whl") if p.name not in expected)


def build(pins: Sequence[str], dest: Path, *, resolve_only: bool = False, target: Target = Target(),
          pip: Sequence[str] = (sys.executable, "-m", "pip"), index_args: Sequence[str] = (),
          extras: str = "") -> list[dict[str, Any]]:
    """Resolve (and unless ``resolve_only``, download) each pin into ``dest/<pin>/``."""
    out = []
    for pin in pins:
        wheels, summary = resolve_pin(pin, target, pip=pip, index_args=index_args, extras=extras)
        pin_dir = dest / pin
        pin_dir.mkdir(parents=True, exist_ok=True)
        summary["files"] = {w.filename: w.sha256 for w in wheels}
        write_text_atomic(pin_dir / LOCK, lock_text(pin, wheels, summary["overrides"], summary["replaces"]))
        write_text_atomic(pin_dir / REPORT, json.dumps(summary, indent=1) + "\n")
        if not resolve_only:
            started = time.monotonic()
            stale = download(pin_dir, target, pip=pip, index_args=index_args)
            for name in stale:  # left from an earlier build: the host must get exactly the set
                (pin_dir / name).unlink()
            summary["download_seconds"] = round(time.monotonic() - started, 1)
            summary["removed_stale"] = stale
        out.append(summary)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m hs_patch.control.wheelhouse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pin", action="append", required=True, help=f"SGLang release (repeatable): {', '.join(RELEASES)}")
    ap.add_argument("--dest", type=Path, default=Path("wheelhouse"), help="root directory; each pin goes to DEST/PIN/")
    ap.add_argument("--resolve-only", action="store_true", help="write the lock file only, download no wheel")
    ap.add_argument("--python-version", default=PYTHON_VERSION, help="the GPU host's Python (default %(default)s)")
    ap.add_argument("--glibc-max", type=int, default=GLIBC_MAX, help="the GPU host's glibc minor (2.N; default 39)")
    ap.add_argument("--index-url", default="", help="package index to use instead of pip's configured one")
    ap.add_argument("--extras", default="", help='extras of the sglang package, e.g. "[all]"')
    a = ap.parse_args(argv)
    index_args = ["--index-url", a.index_url] if a.index_url else []
    try:
        results = build(a.pin, a.dest.resolve(), resolve_only=a.resolve_only,
                        target=Target(a.python_version, a.glibc_max), index_args=index_args, extras=a.extras)
    except WheelhouseError as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return 1
    for s in results:
        took = f"resolved in {s['resolve_seconds']} s" + (f", downloaded in {s['download_seconds']} s"
                                                          if "download_seconds" in s else " (resolve only)")
        print(f"sglang {s['pin']}: {s['packages']} wheels, {took} -> {a.dest / s['pin'] / LOCK}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
