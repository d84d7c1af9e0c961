#!/usr/bin/env bash
# The README's install command: everything the tests and the tools need, on a stock Debian 12 or
# Ubuntu 24.04 control node, as root. Idempotent: run it again after a pull.
#
#   bash scripts/install.sh              # system packages + .venv with hs-patch[test] (the test suite)
#   bash scripts/install.sh control      # .venv with hs-patch[control] only (deploy and extract; no torch)
#
# Python packages go into a virtual environment, .venv at the repository root: Debian 12 and
# Ubuntu 24.04 refuse `pip install` into their own Python (PEP 668, "externally-managed-environment").
# Its tools (ansible-playbook, fab, molecule, hs-extract) are in .venv/bin: `. .venv/bin/activate`.
#
#   PYTHON=python3.12 bash scripts/install.sh   # another interpreter for the venv (3.10 or newer)
set -euo pipefail
cd "$(dirname "$0")/.."

what=${1:-test}
case "$what" in
    test | control) ;;
    *) echo "install.sh: unknown extra '$what': give test (default) or control" >&2; exit 2 ;;
esac
python=${PYTHON:-python3}
venv=.venv  # the test command names it: .venv/bin/python -m pytest ...

if ! command -v "$python" >/dev/null; then
    echo "install.sh: $python not found: install Python 3.10 or newer (apt-get install python3), or name it with PYTHON=" >&2
    exit 1
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    echo "install.sh: $("$python" -V 2>&1) is too old: hs-patch needs Python 3.10 or newer (Debian 12 has 3.11, Ubuntu 24.04 3.12)" >&2
    exit 1
fi

if [ "$what" = test ]; then
    bash scripts/install-deps.sh   # root: apt packages for the test hosts, and python3-venv
elif ! "$python" -c 'import ensurepip' 2>/dev/null; then
    echo "install.sh: $python cannot make a venv: apt-get install python3-venv (as root)" >&2
    exit 1
fi

# Space: the test venv takes about 2.1 GB, the test caches about 0.9 GB more (README, "Install").
need_mb=$([ "$what" = test ] && echo 3500 || echo 800)
free_mb=$(df -Pm . | awk 'NR==2 {print $4}')
if [ "$free_mb" -lt "$need_mb" ]; then
    echo "install.sh: $free_mb MB free on $(df -P . | awk 'NR==2 {print $6}'), the $what install needs about $need_mb MB" >&2
    exit 1
fi

if ! "$venv/bin/python" -c 'import sys' 2>/dev/null; then
    echo "install.sh: making the virtual environment $venv with $("$python" -V 2>&1)"
    rm -rf "$venv"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip)
# pip itself, pinned: the venv gets the interpreter's bundled pip (Debian 12's venv: 23.2.1), whose
# resolver took 49-54 s and 40 s of CPU for one SGLang pin's 207 wheels where 26.3 took 18 s and 10 s
# (the wheelhouse build on a control node, the PyPI resolution tests), and which kept scipy 1.17.1 where
# 1.18.1 (Python >= 3.12) is the newest for the GPU host's CPython 3.12
"${pip[@]}" install --quiet "pip==26.3"

if [ "$what" = test ]; then
    # torch for the tests is the CPU build. PyPI's Linux torch 2.13.0 is the CUDA one (it brings 15
    # nvidia-* wheels and triton, gigabytes more): unless pip's own indexes already offer the CPU
    # build (a local wheel cache), it comes from PyTorch's CPU index (HS_TORCH_INDEX: another).
    torch=$(grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
    chosen=$("${pip[@]}" install --quiet --dry-run --no-deps --ignore-installed --report - "$torch" |
             "$venv/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["metadata"]["version"])')
    case "$chosen" in
        *+cpu) ;;
        *) "${pip[@]}" install --quiet --extra-index-url "${HS_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" "$torch" ;;
    esac
fi
# -qq: setuptools' notice on every editable install ("Editable installation ... be careful with
# folders ... of the same name") is not for the user; pip's errors still show
"${pip[@]}" install --quiet --quiet -e ".[$what]"
if [ "$what" = test ]; then
    # the trainers whose own readers the export tests run, without their dependencies (why: that file)
    "${pip[@]}" install --quiet --no-deps -r tests/trainer-readers.txt
fi
echo "install.sh: hs-patch[$what] is installed in $venv ($(du -sh "$venv" | cut -f1)); its tools: . $venv/bin/activate"
