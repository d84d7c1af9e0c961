"""Shared fixtures: real SGLang release sources (downloaded once, cached) and a tiny model."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from hs_patch.engine.releases import RELEASES
from lab import sglang_wheels
from lab.hostcmd import tools_of_this_python
from lab.gateway import OWNER_ENV

pytest_plugins = ["lab.stop_on_sigterm"]  # SIGTERM tears the fixtures down, as Ctrl-C does

tools_of_this_python()  # the README's test command runs .venv/bin/python -m pytest, the venv not activated
# Every lab a test makes belongs to this test process (each xdist worker sets its own pid): a lab still
# running after its worker was killed (before the teardown took it down) is removed by the next lab's up.
os.environ[OWNER_ENV] = str(os.getpid())

ROOT = Path(__file__).resolve().parent.parent
SUPPORTED = tuple(RELEASES)  # every release the patch knows: each is patched, verified and captured from
UNSUPPORTED = "0.5.8"  # a real release the patch does not know
# One release per spelling of the edits (a family and its release's own slots), the newest of
# each: the tests that exercise one code path in depth run on these, the rest on every release.
REPRESENTATIVES = tuple({(r.family.name, tuple(sorted(r.own.items()))): v for v, r in RELEASES.items()}.values())
# One release per family, the three hs-patch knew first: for the costliest tests of one code path.
FAMILY_REPRESENTATIVES = ("0.5.9", "0.5.16", "0.5.23")
assert sorted(RELEASES[v].family.name for v in FAMILY_REPRESENTATIVES) == sorted({r.family.name for r in RELEASES.values()})


# Importing Ansible replaces sys.intern, after which torch._dynamo (loaded by transformers with a
# model) refuses to import; both load into this one test process. So when a session holds tests
# that load Ansible in-process (fab's inventory reading), torch._dynamo is imported before any test
# runs (a test of the same directory may build a model after one that read an inventory), and
# those tests run after the others.
ANSIBLE_IN_PROCESS = ("control", "ansible", "end_to_end")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if any(Path(str(item.path)).parent.name in ANSIBLE_IN_PROCESS for item in items):
        import torch._dynamo  # noqa: F401
    items.sort(key=_start_order)


def _start_order(item: pytest.Item) -> int:
    """xdist (--dist loadgroup) hands out the groups first, largest first, then every other test in this
    order. A long test marked `early` (it must load neither Ansible nor a model in-process) goes first of
    those: handed out last, it ran alone at the end while the other worker idled (the PyPI resolution
    test, ~6 minutes with pip 23.2.1; ~40 s since install.sh pins pip 26.3). One run since: no detectable
    change of the suite's time (docs/testing.md)."""
    if item.get_closest_marker("early"):
        return 0
    return 2 if Path(str(item.path)).parent.name in ANSIBLE_IN_PROCESS else 1


def _own_dir(env: str, prefix: str) -> str | None:
    """A directory of this session's own for ``env`` (unless one is set), removed when the session ends."""
    if env in os.environ:
        return None
    os.environ[env] = made = tempfile.mkdtemp(prefix=prefix)
    return made


# torch makes its Inductor cache dir (/tmp/torchinductor_<user>) as soon as transformers builds a
# model, nothing compiled; the driver remembers which class AutoTokenizer picked for a model directory
# (driver/tokenizer.py) in the user's cache: the tests, and the stand-ins, drivers and scripts they
# start, keep both in directories of this session's own instead.
_OWN_DIRS = [_own_dir("TORCHINDUCTOR_CACHE_DIR", "hs-tests-inductor-"),
             _own_dir("HS_PATCH_CACHE_DIR", "hs-tests-cache-")]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    for made in _OWN_DIRS:
        if made:
            shutil.rmtree(made, ignore_errors=True)


def extract_site(version: str, dest: Path) -> Path:
    return sglang_wheels.extract_site(sglang_wheels.sglang_wheel(version), dest)


@pytest.fixture(autouse=True)
def _keep_umask():
    """hs-extract and hs-patch set umask 077 for their process; run in-process, that must not
    leak into the tests after (a lab booted under it once hung CI)."""
    old = os.umask(0o022)
    os.umask(old)
    yield
    os.umask(old)


class _Sources(dict):
    """version -> a pristine extracted site, each downloaded (once, cached) and extracted on first use."""

    def __init__(self, base: Path):
        super().__init__()
        self.base = base

    def __missing__(self, version: str) -> Path:
        self[version] = extract_site(version, self.base / version)
        return self[version]


@pytest.fixture(scope="session")
def release_sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """version -> a pristine extracted site (read-only use; copy before changing), once per session."""
    return _Sources(tmp_path_factory.mktemp("sglang-sources"))


@pytest.fixture
def site(release_sources: dict[str, Path], tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    """A writable copy of one release's site; parametrize indirectly with the version."""
    dest = tmp_path / "site"
    shutil.copytree(release_sources[request.param], dest)
    return dest


@pytest.fixture(scope="session")
def tiny_model():
    """A tiny random DeepseekV3 (MLA + MoE + yarn rope), bf16, seeded."""
    from lab.tiny_model import random_model

    return random_model(vocab_size=256)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A served-model directory (config, bf16 weights, tokenizer with a chat template), built once."""
    from lab.tiny_model import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def standin(tiny_model_dir, tmp_path_factory):
    """A stand-in server (SGLang 0.5.16's patched forward, capture hook) in this process, per test module."""
    from lab.drive_runs import start_standin

    srv = start_standin(tiny_model_dir, tmp_path_factory.mktemp("capture"), "0.5.16")
    yield srv
    srv.close()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """The run's one S3 server (SeaweedFS in a network namespace: tests/lab/seaweed.py), shared by every S3
    test. Their modules are all in the xdist group "s3", so one worker starts it, once."""
    from lab import seaweed

    why = seaweed.available()
    if why:
        pytest.skip(why)
    server = seaweed.Seaweed(tmp_path_factory.mktemp("s3"), buckets=S3_BUCKETS).up()
    yield server
    server.down()


S3_BUCKETS = ("hs-runs", "hs-quota")  # the shipper's identity may read, write and list these; nothing else
