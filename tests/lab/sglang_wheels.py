"""The real SGLang release wheels the tests run against: downloaded once, cached.

Used by the fixtures (conftest.py) and the stand-in server. Set HS_PATCH_TEST_CACHE to
cache them elsewhere; on a host without network, copy the wheels into
``$HS_PATCH_TEST_CACHE/wheels`` (or give the stand-in ``--sglang-wheel PATH``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from lab.hostcmd import file_locked

CACHE = Path(os.environ.get("HS_PATCH_TEST_CACHE", Path.home() / ".cache" / "hs-patch-tests"))

# What the tests need from a wheel: the patched module, its neighbours the capture harness runs
# (aux_hidden_states.py, communicator.py), the version, and the files whose code the per-release
# rules are checked against (EAGLE-3 ids: the Kimi-K2.5 wrapper, the CUDA-graph runner; server
# flags: server_args.py and, from 0.5.20, the field definitions it was split into). Absent ones
# are skipped: releases differ.
MEMBERS = ("sglang/__init__.py", "sglang/version.py", "sglang/srt/models/deepseek_v2.py",
           "sglang/srt/models/kimi_k25.py", "sglang/srt/layers/aux_hidden_states.py",
           "sglang/srt/layers/communicator.py", "sglang/srt/model_executor/cuda_graph_runner.py",
           "sglang/srt/server_args.py", "sglang/srt/arg_groups/fields/exec_.py",
           "sglang/srt/arg_groups/fields/serving.py", "sglang/srt/entrypoints/engine.py")


def sglang_wheel(version: str) -> Path:
    """The real ``sglang==version`` wheel, downloaded once into the test cache."""
    wheels = CACHE / "wheels"
    with file_locked(CACHE / ".wheels.lock"):  # pip writes in place: no reader may see a half file
        found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
        if not found:
            wheels.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                            "-q", "-d", str(wheels), f"sglang=={version}"], check=True)
            found = sorted(wheels.glob(f"sglang-{version}-*.whl"))
    assert found, f"pip download gave no sglang {version} wheel"
    return found[0]


def extract_site(wheel: Path, dest: Path) -> Path:
    """A minimal site-packages with the wheel's files the tests need (and dist-info for its version)."""
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            if name in MEMBERS or ".dist-info/" in name:
                z.extract(name, dest)
    return dest
