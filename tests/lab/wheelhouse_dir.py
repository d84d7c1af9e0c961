"""The test hosts' wheelhouse, laid out as python3 -m hs_patch.control.wheelhouse lays it out.

``DEST/<pin>/`` holds the REAL sglang wheel (5 to 40 MB; the tests patch its sources), a
stand-in for the release's pip overrides and replacements (0.5.9: nvidia-cudnn-cu12
9.16.0.29, metadata only: the real one is 650 MB of GPU libraries the test hosts cannot
use; 0.5.18 .. 0.5.22: cuda-tile 1.6.0), and the lock
file ``requirements.txt`` with both files' sha256, so the sglang role's production path
(synchronize, ``pip install --no-index --no-deps --require-hashes -r``, the override
assertion) runs for real on the test hosts. The GPU stack (torch and the rest) is what
the test hosts do without.

    python3 tests/lab/wheelhouse_dir.py DEST 0.5.9     # molecule/shared/tasks/wheelhouse.yml
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import sys
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[1])]  # run as a script: `lab` and the checkout's hs_patch

from hs_patch.engine.releases import RELEASES  # noqa: E402
from hs_patch.samples.store import file_sha256, write_text_atomic  # noqa: E402
from lab.hostcmd import file_locked  # noqa: E402
from lab.sglang_wheels import sglang_wheel  # noqa: E402



def standin_wheel(dest: Path, requirement: str) -> Path:
    """A metadata-only wheel named and versioned as ``requirement`` (name==version)."""
    name, version = requirement.split("==")
    dist = f"{name.replace('-', '_')}-{version}"
    path = dest / f"{dist}-py3-none-manylinux_2_27_x86_64.whl"
    if path.exists():
        return path
    files = {f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                           "Summary: hs-patch test stand-in (metadata only)\n",
             f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hs-patch-tests\nRoot-Is-Purelib: false\n"
                                        "Tag: py3-none-manylinux_2_27_x86_64\n"}
    record = []
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w") as z:
        for arc, text in files.items():
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            z.writestr(zipfile.ZipInfo(arc, (1980, 1, 1, 0, 0, 0)), text)
            record.append(f"{arc},sha256={digest},{len(text)}")
        z.writestr(zipfile.ZipInfo(f"{dist}.dist-info/RECORD", (1980, 1, 1, 0, 0, 0)),
                   "\n".join(record + [f"{dist}.dist-info/RECORD,,"]) + "\n")
    tmp.replace(path)
    return path


def _pinned(path: Path) -> str:
    """``name==version`` of a wheel or sdist file."""
    from packaging.utils import parse_sdist_filename, parse_wheel_filename

    name, version = (parse_wheel_filename(path.name) if path.suffix == ".whl" else parse_sdist_filename(path.name))[:2]
    return f"{name}=={version}"


def build(dest: Path, pin: str, extra: Path | None = None) -> Path:
    """``dest/pin/`` with the sglang wheel, the overrides' and replacements' stand-ins and the lock; returns it.

    ``extra``: a directory of wheels (a complete set, as ``pip download`` leaves it) added to the pin dir and
    its lock, so the venv gets them through the role's own lock install (the end-to-end tests: the
    stand-in server's torch and transformers, which a real host gets with SGLang's dependencies)."""
    with file_locked(dest.parent / f".{dest.name}.lock"):  # a molecule scenario and a demo may build it at once
        pin_dir = dest / pin
        pin_dir.mkdir(parents=True, exist_ok=True)
        real = sglang_wheel(pin)
        wheel = pin_dir / real.name
        if not wheel.exists() or file_sha256(wheel) != file_sha256(real):
            tmp = wheel.with_suffix(".tmp")
            tmp.write_bytes(real.read_bytes())
            tmp.replace(wheel)
        lines = [f"# sglang=={pin} for the test hosts: the real sglang wheel, stand-ins for the overrides and replacements"]
        lines.append(f"sglang=={pin} --hash=sha256:{file_sha256(wheel)[1]}")
        for req in RELEASES[pin].pip_overrides + RELEASES[pin].replaces:
            lines.append(f"{req} --hash=sha256:{file_sha256(standin_wheel(pin_dir, req))[1]}")
        for path in sorted(extra.iterdir()) if extra else []:
            if path.suffix in (".whl", ".gz", ".zip") and not path.name.startswith("sglang-"):
                copy = pin_dir / path.name
                if not copy.exists() or copy.stat().st_size != path.stat().st_size:
                    tmp = copy.with_suffix(".tmp")
                    shutil.copyfile(path, tmp)
                    tmp.replace(copy)
                lines.append(f"{_pinned(copy)} --hash=sha256:{file_sha256(copy)[1]}")
        write_text_atomic(pin_dir / "requirements.txt", "\n".join(lines) + "\n")
        return pin_dir


if __name__ == "__main__":
    print(build(Path(sys.argv[1]), sys.argv[2]))
