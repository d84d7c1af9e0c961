"""SGLang's own requirements with a release's ``replaces`` swapped in (standard library + packaging).

Two places need the list: the wheelhouse builder, from the resolved sglang wheel's metadata
on the control node, and the ``sglang`` role's pypi install on the GPU host, which installs
sglang alone and then runs this file with the venv's Python (before any dependency is there,
so ``packaging`` comes from pip's vendored copy):

    python sglang_requires.py '[all]' '["cuda-tile==1.6.0"]'   # prints the JSON list

Why a release replaces a requirement: docs/deployment.md ("Releases that replace a pin").
"""

from __future__ import annotations

import json
import sys
from typing import Mapping, Sequence

try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv: pip's own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]


class ReplaceError(ValueError):
    """A replacement names a package sglang does not require."""


def norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def replaced_requirements(requires: Sequence[str], replaces: Sequence[str], env: Mapping[str, str] | None = None,
                          extras: str = "") -> list[str]:
    """The requirements in ``requires`` that apply in ``env`` with ``extras``, each named in ``replaces`` swapped.

    ``env``: environment markers (None: this interpreter's); ``extras``: e.g. "[all]".
    """
    swap = {norm(Requirement(r).name): r for r in replaces}
    wanted = [e.strip() for e in extras.strip("[]").split(",") if e.strip()] or [""]
    out, seen = [], set()
    for spec in requires:
        req = Requirement(spec)
        if req.marker is not None and not any(req.marker.evaluate({**(env or {}), "extra": e}) for e in wanted):
            continue
        seen.add(norm(req.name))
        out.append(swap.get(norm(req.name)) or str(req).split(";")[0].strip())
    missing = sorted(set(swap) - seen)
    if missing:
        raise ReplaceError(f"sglang does not require {', '.join(missing)}: drop it from the release's replaces in "
                           "hs_patch/engine/releases.py")
    return out


def main(argv: Sequence[str]) -> int:
    import importlib.metadata

    extras = argv[0] if argv else ""
    try:
        replaces = json.loads(argv[1]) if len(argv) > 1 else []
        print(json.dumps(replaced_requirements(importlib.metadata.requires("sglang") or [], replaces, extras=extras)))
    except (importlib.metadata.PackageNotFoundError, ReplaceError, ValueError) as e:
        print(f"sglang_requires: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
