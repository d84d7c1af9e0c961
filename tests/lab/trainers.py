"""The trainers' OWN reader code, imported for the export tests (SpecForge 0.2.0, speculators 0.9.0).

Installed by ``bash scripts/install.sh`` (``pip install --no-deps -r tests/trainer-readers.txt`` into .venv; see
docs/testing.md: their full dependency sets would replace the CPU torch build). Outside CI a
missing install skips the tests that need it, with that command; in CI (``CI`` set) it fails.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest

INSTALL = "bash scripts/install.sh (it installs tests/trainer-readers.txt into .venv without their dependencies)"


def need(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"{module} is not installed ({e}): {INSTALL}")
