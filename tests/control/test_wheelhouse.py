"""The offline wheelhouse builder (hs_patch.control.wheelhouse).

- Offline: real pip against a local index of small stand-in wheels carrying the real
  names, versions and platform tags of the packages that matter (sglang 0.5.9 -> torch
  2.9.1 -> nvidia-cudnn-cu12==9.10.2.21, and 0.5.9's cuDNN override): the lock, the
  override, the download with --require-hashes, stale-file removal, and the refusals.
- Offline too: a release whose SGLang pin only a stub serves (0.5.21: cuda-tile==1.6.0rc5)
  resolves with its replacement, and a replacement sglang does not ask for is refused.
- Slow: the REAL resolution on PyPI for CPython 3.12 / x86_64 (metadata only: nothing of the
  gigabytes is downloaded), timed: the complete set of one pin per stack the builder treats
  differently (torch, CUDA, overrides, replacements), and of every pin its sglang wheel, its
  torch pin and the pins it replaces.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import sys
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hs_patch.control import wheelhouse as wh
from hs_patch.engine.releases import RELEASES

def _wheel(dirpath: Path, name: str, version: str, tag: str, requires: list[str] = ()) -> Path:
    dist = f"{name.replace('-', '_')}-{version}"
    path = dirpath / f"{dist}-{tag}.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    files = {f"{dist}.dist-info/METADATA": meta,
             f"{dist}.dist-info/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {tag}\n"}
    record = []
    with zipfile.ZipFile(path, "w") as z:
        for arc, text in files.items():
            z.writestr(arc, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{arc},sha256={digest},{len(text)}")
        z.writestr(f"{dist}.dist-info/RECORD", "\n".join(record + [f"{dist}.dist-info/RECORD,,"]) + "\n")
    return path


@pytest.fixture
def index(tmp_path: Path) -> Path:
    d = tmp_path / "index"
    d.mkdir()
    _wheel(d, "sglang", "0.5.9", "py3-none-any", ["torch==2.9.1", "ninja"])
    _wheel(d, "torch", "2.9.1", "cp312-cp312-manylinux_2_28_x86_64",
           ['nvidia-cudnn-cu12==9.10.2.21; platform_system == "Linux" and platform_machine == "x86_64"',
            'nvidia-cublas-cu12==12.8.4.1; platform_system == "Linux"', 'pywin32; sys_platform == "win32"'])
    _wheel(d, "torch", "2.9.1", "cp311-cp311-manylinux_2_28_x86_64", ["nvidia-cudnn-cu12==9.10.2.21"])
    _wheel(d, "nvidia-cudnn-cu12", "9.10.2.21", "py3-none-manylinux_2_27_x86_64", ["nvidia-cublas-cu12"])
    _wheel(d, "nvidia-cudnn-cu12", "9.16.0.29", "py3-none-manylinux_2_27_x86_64", ["nvidia-cublas-cu12"])
    _wheel(d, "nvidia-cublas-cu12", "12.8.4.1", "py3-none-manylinux_2_27_x86_64")
    _wheel(d, "ninja", "1.13.2", "py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64")
    return d


def _build(index: Path, dest: Path, **kw):
    return wh.build(["0.5.9"], dest, index_args=["--no-index", "--find-links", str(index)], **kw)


@pytest.fixture(autouse=True)
def _clean_pip_env(monkeypatch):
    """pip as the builder runs it, but blind to this machine's pip configuration (a local
    find-links and a constraints file that caps torch): the resolution must be the index's alone."""
    for k in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)


def test_lock_holds_the_complete_set_with_the_cudnn_override(index, tmp_path):
    (summary,) = _build(index, tmp_path / "wh", resolve_only=True)
    pin = tmp_path / "wh" / "0.5.9"
    lines = [x for x in (pin / wh.LOCK).read_text().splitlines() if not x.startswith("#")]
    names = {x.split("==")[0]: x.split("==")[1].split()[0] for x in lines}
    assert names == {"sglang": "0.5.9", "torch": "2.9.1", "nvidia-cudnn-cu12": "9.16.0.29",
                     "nvidia-cublas-cu12": "12.8.4.1", "ninja": "1.13.2"}
    assert all(" --hash=sha256:" in x for x in lines)
    assert summary["packages"] == 5 and summary["overrides"] == ["nvidia-cudnn-cu12==9.16.0.29"]
    assert "manylinux_2_28_x86_64" in summary["platform_tags_used"] and "any" in summary["platform_tags_used"]
    # the cp312 torch, not the cp311 one; resolve-only downloads nothing
    assert "torch-2.9.1-cp312-cp312-manylinux_2_28_x86_64.whl" in json.loads((pin / wh.REPORT).read_text())["files"]
    assert not list(pin.glob("*.whl"))


def test_download_fetches_exactly_the_locked_files_and_drops_stale_ones(index, tmp_path):
    pin = tmp_path / "wh" / "0.5.9"
    pin.mkdir(parents=True)
    (pin / "torch-2.8.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"old build")
    (summary,) = _build(index, tmp_path / "wh")
    got = sorted(p.name for p in pin.glob("*.whl"))
    assert got == sorted(json.loads((pin / wh.REPORT).read_text())["files"])
    assert "nvidia_cudnn_cu12-9.16.0.29-py3-none-manylinux_2_27_x86_64.whl" in got
    assert "nvidia_cudnn_cu12-9.10.2.21-py3-none-manylinux_2_27_x86_64.whl" not in got
    assert summary["removed_stale"] == ["torch-2.8.0-cp312-cp312-manylinux_2_28_x86_64.whl"]


def test_a_damaged_download_is_refused(index, tmp_path, monkeypatch):
    real = wh._pip

    def corrupting(pip, args, timeout):
        proc = real(pip, args, timeout)
        if args[0] == "download":
            (tmp_path / "wh" / "0.5.9" / "ninja-1.13.2-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"
             ).write_bytes(b"truncated")
        return proc

    monkeypatch.setattr(wh, "_pip", corrupting)
    with pytest.raises(wh.WheelhouseError, match="is not the locked"):
        _build(index, tmp_path / "wh")


def test_an_override_whose_needs_the_set_lacks_is_refused(index, tmp_path):
    (index / "nvidia_cudnn_cu12-9.16.0.29-py3-none-manylinux_2_27_x86_64.whl").unlink()
    _wheel(index, "nvidia-cudnn-cu12", "9.16.0.29", "py3-none-manylinux_2_27_x86_64", ["nvidia-cublas-cu12>=12.9"])
    with pytest.raises(wh.WheelhouseError, match=r"needs nvidia-cublas-cu12>=12.9, the set has nvidia-cublas-cu12==12.8"):
        _build(index, tmp_path / "wh", resolve_only=True)


def test_a_torch_that_disagrees_with_releases_is_refused(index, tmp_path):
    for p in index.glob("sglang-*"):
        p.unlink()
    _wheel(index, "sglang", "0.5.9", "py3-none-any", ["torch==2.9.0"])
    _wheel(index, "torch", "2.9.0", "cp312-cp312-manylinux_2_28_x86_64")
    with pytest.raises(wh.WheelhouseError, match="resolved torch 2.9.0, hs_patch.engine.releases says 2.9.1"):
        _build(index, tmp_path / "wh", resolve_only=True)


def test_a_pin_only_a_stub_serves_is_replaced(index, tmp_path):
    """0.5.21 pins cuda-tile==1.6.0rc5 (on PyPI a stub sdist that downloads from pypi.nvidia.com):
    no wheel resolves it, the release's replacement does, and the lock says so."""
    _wheel(index, "sglang", "0.5.21", "py3-none-any", ["torch==2.13.0", "cuda-tile==1.6.0rc5", "ninja",
                                                       'pywin32; sys_platform == "win32"'])
    _wheel(index, "torch", "2.13.0", "cp312-cp312-manylinux_2_28_x86_64")
    _wheel(index, "cuda-tile", "1.6.0", "cp312-cp312-manylinux2014_x86_64", ["typing-extensions"])
    _wheel(index, "typing-extensions", "4.15.0", "py3-none-any")
    args = ["--no-index", "--find-links", str(index)]
    with pytest.raises(wh.WheelhouseError, match="pip failed"):  # what a plain resolution meets
        wh.resolve(["sglang==0.5.21"], wh.Target(), pip=(sys.executable, "-m", "pip"), index_args=args)
    (summary,) = wh.build(["0.5.21"], tmp_path / "wh", index_args=args, resolve_only=True)
    lock = (tmp_path / "wh" / "0.5.21" / wh.LOCK).read_text()
    assert summary["replaces"] == ["cuda-tile==1.6.0"] and summary["packages"] == 5
    assert "# replaces sglang's own requirement on the same package: cuda-tile==1.6.0" in lock
    assert "cuda-tile==1.6.0 --hash=sha256:" in lock and "sglang==0.5.21 --hash" in lock and "pywin32" not in lock
    (index / "sglang-0.5.21-py3-none-any.whl").unlink()
    _wheel(index, "sglang", "0.5.21", "py3-none-any", ["torch==2.13.0"])
    with pytest.raises(wh.WheelhouseError, match="sglang does not require cuda-tile"):
        wh.build(["0.5.21"], tmp_path / "wh", index_args=args, resolve_only=True)


def test_an_unsupported_pin_and_an_unresolvable_set_say_what_to_do(index, tmp_path):
    with pytest.raises(wh.WheelhouseError, match="not a release hs-patch supports"):
        wh.build(["0.5.8"], tmp_path / "wh", resolve_only=True)
    (index / "nvidia_cublas_cu12-12.8.4.1-py3-none-manylinux_2_27_x86_64.whl").unlink()
    with pytest.raises(wh.WheelhouseError, match="pip failed"):
        _build(index, tmp_path / "wh", resolve_only=True)


def test_platform_tags_cover_every_manylinux_level_up_to_the_host_glibc():
    tags = wh.Target().platforms()
    assert tags[0] == "manylinux_2_39_x86_64" and "manylinux_2_17_x86_64" in tags
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"} <= set(tags)
    assert len(tags) == 23 + 3


def _unmet(wheels: list[wh.Wheel], target: wh.Target, overridden: set[str]) -> list[str]:
    """The requirements of ``wheels`` (on ``target``) the set does not meet, but those on an overridden package."""
    from packaging.requirements import Requirement

    have = {wh._norm(w.name): w.version for w in wheels}
    env = target.marker_env()
    unmet = []
    for w in wheels:
        for spec in w.requires:
            req = Requirement(spec)
            name = wh._norm(req.name)
            if (req.marker is not None and not req.marker.evaluate(env)) or name in overridden:
                continue
            if name not in have or not req.specifier.contains(have[name], prereleases=True):
                unmet.append(f"{w.name} {w.version} needs {spec}, the set has {have.get(name, 'none')}")
    return unmet


def _installable(filename: str, target: wh.Target) -> bool:
    """A wheel pip installs on ``target``: one of its tags is among the interpreter's (packaging.tags, pip's own)."""
    from packaging import tags
    from packaging.utils import parse_wheel_filename

    version = tuple(int(x) for x in target.python_version.split("."))
    cp = "cp" + target.python_version.replace(".", "")
    supported = {*tags.cpython_tags(version, abis=[cp], platforms=target.platforms()),
                 *tags.compatible_tags(version, cp, platforms=target.platforms())}
    return bool(parse_wheel_filename(filename)[3] & supported)


def _stacks() -> list[str]:
    """One pin per stack the builder resolves differently (torch, CUDA, overrides, replacements): the newest."""
    return list({(r.torch, r.cuda, r.pip_overrides, r.replaces): v for v, r in RELEASES.items()}.values())


@pytest.mark.slow
@pytest.mark.early  # PyPI answers (~35 s with pip 26.3, 6 min with 23.2.1), no group: started first (tests/conftest.py)
def test_every_stack_resolves_on_pypi_for_python_3_12():
    """The real complete set of one pin per stack, metadata only (no wheel downloaded), all at once: every
    requirement met inside the set (but those on an overridden or replaced package), every wheel
    installable on the GPU host, the overrides and replacements in. (With pip 23.2.1 every pin at once took 3
    to 8 minutes of 2 cores for three pins, 40 s of CPU each; pip 26.3, which install.sh pins, 10 s for one alone.)"""
    target = wh.Target()

    def one(pin: str):
        started = time.monotonic()
        wheels, s = wh.resolve_pin(pin, target, pip=(sys.executable, "-m", "pip"))
        return pin, wheels, s, time.monotonic() - started

    stacks = _stacks()
    assert "0.5.9" in stacks and "0.5.23" in stacks and len(stacks) >= 5
    with ThreadPoolExecutor(len(stacks)) as pool:
        results = list(pool.map(one, stacks))
    for pin, wheels, s, took in results:
        print(f"sglang {pin}: {s['packages']} wheels resolved in {took:.0f}s; tags {s['platform_tags_used']}")
        lock = wh.lock_text(pin, wheels, s["overrides"], s["replaces"])
        assert f"sglang=={pin} --hash=sha256:" in lock
        assert f"torch=={RELEASES[pin].torch} --hash" in lock
        for pinned in RELEASES[pin].pip_overrides + RELEASES[pin].replaces:
            assert f"{pinned} --hash" in lock
        overridden = {wh._norm(o.split("==")[0]) for o in RELEASES[pin].pip_overrides + RELEASES[pin].replaces}
        assert not _unmet(wheels, target, overridden), (pin, _unmet(wheels, target, overridden))
        assert [w.filename for w in wheels if not _installable(w.filename, target)] == [], pin
        assert len({wh._norm(w.name) for w in wheels}) == len(wheels) == s["packages"], "one wheel a package"


@pytest.mark.slow
@pytest.mark.early
def test_every_pin_has_a_wheel_for_the_host_and_the_stack_releases_py_names():
    """Each of the 19 pins on PyPI: an sglang wheel installable on CPython 3.12 / x86_64, its torch pin
    the one hs_patch.engine.releases names, and each package it replaces pinned by sglang itself (where the
    replacement lies, the pinned version has no wheel: see the stub test above)."""
    from packaging.requirements import Requirement

    target = wh.Target()

    def one(pin: str) -> tuple[str, wh.Wheel]:
        (w,) = wh.resolve([f"sglang=={pin}"], target, pip=(sys.executable, "-m", "pip"), no_deps=True)
        return pin, w

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, RELEASES))
    for pin, w in results:
        assert w.version == pin and _installable(w.filename, target), w.filename
        pins = {wh._norm(r.name): str(r.specifier) for r in map(Requirement, w.requires) if r.marker is None}
        assert pins["torch"] == f"=={RELEASES[pin].torch}", (pin, pins["torch"])
        for replaced in RELEASES[pin].replaces:
            name, version = replaced.split("==")
            assert pins[wh._norm(name)].startswith("==") and pins[wh._norm(name)] != f"=={version}", (pin, replaced)


def test_the_role_reads_sglangs_own_requirements_with_the_replacements(release_sources):
    """What the sglang role runs on the host after installing sglang 0.5.18 alone (pypi source): the
    release's requirements, markers evaluated there, cuda-tile's stub-only pin swapped; a replacement
    sglang does not ask for stops the install with what to do."""
    import subprocess

    script = Path(wh.__file__).with_name("sglang_requires.py")
    env = {**os.environ, "PYTHONPATH": str(release_sources["0.5.18"])}
    out = subprocess.run([sys.executable, str(script), "", json.dumps(list(RELEASES["0.5.18"].replaces))], env=env,
                         capture_output=True, text=True, check=True)
    reqs = json.loads(out.stdout)
    assert "cuda-tile==1.6.0" in reqs and "torch==2.13.0" in reqs
    assert not [r for r in reqs if "1.6.0rc5" in r or ";" in r]
    bad = subprocess.run([sys.executable, str(script), "", '["not-a-dependency==1"]'], env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 1 and "sglang does not require not-a-dependency" in bad.stderr
