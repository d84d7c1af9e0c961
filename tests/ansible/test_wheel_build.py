"""playbooks/tasks/hs-patch-wheel.yml, the control node's wheel build that patch.yml and upgrade.yml import:
run as it is, on a copy of this checkout, on the local connection. Its build directory goes whatever the build
did, and the ones killed runs left are removed by the next run, while another run's live one is kept."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
import yaml

from lab.local_play import run_local_play

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """What the task file reads of a checkout (the package, pyproject.toml, README.md, the task file itself),
    copied, with a play that imports the task file as patch.yml does."""
    root = tmp_path / "checkout"
    shutil.copytree(ROOT / "hs_patch", root / "hs_patch", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "playbooks/tasks/hs-patch-wheel.yml"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, root / name)
    (root / "playbooks" / "build.yml").write_text(yaml.safe_dump([{
        "name": "Build the wheel as patch.yml does", "hosts": "localhost", "gather_facts": False,
        "vars": {"hs_patch_dist_dir": str(tmp_path / "dist")},
        "pre_tasks": [{"name": "Build", "ansible.builtin.import_tasks": "tasks/hs-patch-wheel.yml"}],
        "tasks": [{"name": "Say which wheel", "ansible.builtin.debug": {"msg": "wheel={{ hs_patch_wheel }}"}}]}]))
    (tmp_path / "dist").mkdir()
    (tmp_path / "tmp").mkdir()
    return root


def _build(checkout: Path, **env: str) -> subprocess.CompletedProcess:
    return run_local_play(checkout / "playbooks" / "build.yml", env={"TMPDIR": str(checkout.parent / "tmp"), **env})


def _planted(tmp: Path, name: str, age_s: float) -> Path:
    path = tmp / name
    (path / "hs_patch").mkdir(parents=True)
    (path / "hs_patch" / "left.py").write_text("")
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_the_build_leaves_only_the_wheel_and_removes_what_killed_runs_left(checkout):
    tmp = checkout.parent / "tmp"
    stale = _planted(tmp, "hs-patch-wheel.killedrun", age_s=2 * 3600)  # a run killed mid-build, hours ago
    live = _planted(tmp, "hs-patch-wheel.otherrun", age_s=5)  # another playbook building right now
    proc = _build(checkout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    wheels = list((checkout.parent / "dist").glob("hs_patch-*.whl"))
    assert len(wheels) == 1 and f"wheel={wheels[0]}" in proc.stdout
    with zipfile.ZipFile(wheels[0]) as whl:
        assert "hs_patch/__init__.py" in whl.namelist()
    assert not stale.exists(), "the build directory a killed run left hours ago was kept"
    assert live.exists(), "another run's build directory, in use, was removed"
    assert sorted(p.name for p in tmp.iterdir()) == [live.name], "this run's build directory was left"


def test_a_failed_build_says_so_and_leaves_no_build_directory(checkout):
    tmp = checkout.parent / "tmp"
    proc = _build(checkout, PIP_CONSTRAINT=str(tmp / "no-such-constraints.txt"))  # pip refuses to start
    assert proc.returncode != 0
    assert "Build the hs_patch wheel on the control node" in proc.stdout and "no-such-constraints" in proc.stdout
    assert not list(tmp.iterdir()), "a failed build left its build directory"
    assert not list((checkout.parent / "dist").iterdir())
