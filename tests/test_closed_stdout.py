"""hs-patch and hs-extract piped into a reader that closes early (``hs-patch status | head -1``) end
quietly with exit 141, as a shell reports such a writer: no BrokenPipeError traceback on stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hs_patch.samples import files

ROOT = Path(__file__).resolve().parent.parent


def _into_closed_reader(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a CLI with its stdout a pipe whose reader already closed (as ``head -1`` does once it has its
    line): every write the command makes to stdout meets a reader that has gone."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", *args], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env={**os.environ, **(env or {})}, timeout=120, check=False)
    finally:
        os.close(write_end)


@pytest.mark.parametrize("site", ["0.5.9"], indirect=True)
def test_hs_patch_status_into_a_closed_reader_exits_quietly(site: Path):
    proc = _into_closed_reader(["hs_patch.host.patch_cli", "status", "--site", str(site)])
    assert (proc.returncode, proc.stderr) == (141, "")
    # the same command into a reader that stays prints the status (what was dropped above)
    out = subprocess.run([sys.executable, "-m", "hs_patch.host.patch_cli", "status", "--site", str(site)],
                         capture_output=True, text=True, cwd=ROOT, timeout=120, check=True).stdout
    assert "pristine" in out and "0.5.9" in out


def test_hs_extract_into_a_closed_reader_exits_quietly():
    args = ["drafter-config", "--serve-release", "0.5.16", "--layers", "2,30,58", "--num-layers", "61"]
    proc = _into_closed_reader(["hs_patch.host.extract_cli", *args])
    assert (proc.returncode, proc.stderr) == (141, "")


def test_a_broken_pipe_elsewhere_is_still_raised(capfd):
    """Only stdout's own reader going away is quiet: a BrokenPipeError from a socket or a subprocess's
    stdin, with stdout still open, is the error it was."""
    @files.quiet_when_stdout_closes
    def main() -> int:
        print("written")
        raise BrokenPipeError(32, "Broken pipe (a subprocess's stdin)")

    with pytest.raises(BrokenPipeError, match="subprocess's stdin"):
        main()
    assert capfd.readouterr().out == "written\n"
    assert files.quiet_when_stdout_closes(lambda: 3)() == 3
