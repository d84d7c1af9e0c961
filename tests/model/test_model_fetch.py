"""hs-model: the model placed from the hub (huggingface_hub's own downloader against a local stand-in of
the hub's download API, tests/lab/fake_hub.py), an HTTP mirror and an rsync mirror; every file verified
against the source's own metadata; resumed downloads, damaged files refused, no room refused, the token
never shown, and a second run that needs neither the network nor a read of the files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from hs_patch.host.model import cli
from hs_patch.host.model import fetch as dl
from lab.fake_hub import COMMIT, FakeHub

EXTRA = "weights/extra.bin"  # an LFS file larger than huggingface_hub's 10 MiB read chunk
EXTRA_SIZE = 24 << 20


@pytest.fixture(scope="module")
def repo_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model as a hub repository holds it, with one larger LFS file in a subdirectory."""
    d = tmp_path_factory.mktemp("repo") / "tiny"
    shutil.copytree(tiny_model_dir, d)
    (d / EXTRA).parent.mkdir()
    (d / EXTRA).write_bytes(os.urandom(EXTRA_SIZE))
    return d


@pytest.fixture
def hub(repo_dir: Path):
    h = FakeHub(repo_dir, "hs-test/tiny")
    yield h
    h.close()


def fetch(dest: Path, *args: str) -> tuple[int, dict]:
    return _run(["fetch", "--dest", str(dest), *args])


def from_hub(dest: Path, hub: FakeHub, *args: str) -> tuple[int, dict]:
    return fetch(dest, "--source", "hub", "--repo", "hs-test/tiny", "--revision", COMMIT, "--endpoint", hub.url, *args)


def _run(argv: list[str]) -> tuple[int, dict]:
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    with redirect_stdout(out):
        rc = cli.main([*argv, "--json"])
    return rc, json.loads(out.getvalue().strip().splitlines()[-1])


def test_from_the_hub_every_file_is_verified_and_a_second_run_needs_no_network(hub, repo_dir, tmp_path):
    dest = tmp_path / "model"
    rc, res = from_hub(dest, hub)
    assert rc == 0 and res["changed"], res
    manifest = json.loads((dest / "hs-model-manifest.json").read_text())
    assert manifest["identity"] == f"hub {hub.url} hs-test/tiny@{COMMIT}"
    files = sorted(p.relative_to(repo_dir).as_posix() for p in repo_dir.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == files
    for name, spec in manifest["files"].items():
        data = (repo_dir / name).read_bytes()
        assert (dest / name).read_bytes() == data and spec["size"] == len(data)
        assert spec["sha256"] == __import__("hashlib").sha256(data).hexdigest()
        assert ("git_sha1" in spec) != name.endswith((".safetensors", ".bin"))  # LFS: sha256 from the hub itself
        assert (dest / name).stat().st_mode & 0o444 == 0o444, f"{name} unreadable by the server's user"
    assert "every file verified" in res["message"]
    hub.close()  # the hub is gone: the next run must not need it
    rc, res = from_hub(dest, hub)
    assert rc == 0 and not res["changed"] and "unchanged since" in res["message"], res


def test_a_connection_cut_mid_file_resumes_where_it_stopped(hub, tmp_path):
    hub.cut[EXTRA] = 15 << 20  # the first GET of the file ends after 15 MiB
    rc, res = from_hub(tmp_path / "model", hub)
    assert rc == 0, res
    ranges = hub.requests_for(EXTRA)
    assert ranges[0] == "" and len(ranges) == 2 and ranges[1].startswith("bytes=") and ranges[1] != "bytes=0-", ranges


def test_a_file_the_source_serves_damaged_is_fetched_again_then_refused(hub, tmp_path):
    dest = tmp_path / "model"
    hub.damaged.add("model.safetensors")
    rc, res = from_hub(dest, hub)
    assert rc == cli.EXIT_DAMAGED, res
    assert "model.safetensors: sha256" in res["message"] and "(damaged)" in res["message"] and "twice" in res["message"]
    assert len(hub.requests_for("model.safetensors")) == 2, "fetched once more before refusing"
    assert not (dest / "model.safetensors").exists(), "the damaged file stays on disk"
    assert not (dest / "hs-model-manifest.json").exists() and not (dest / ".hs-model-verified.json").exists()
    # the source is fixed: the next run fetches that file only, the others were kept
    hub.damaged.clear()
    before = len(hub.requests_for("config.json"))
    rc, res = from_hub(dest, hub)
    assert rc == 0, res
    assert len(hub.requests_for("model.safetensors")) == 3 and len(hub.requests_for("config.json")) == before


def test_a_pinned_revision_is_a_commit_and_an_unknown_one_is_said(hub, tmp_path):
    rc, res = fetch(tmp_path / "m", "--source", "hub", "--repo", "hs-test/tiny", "--revision", "main",
                    "--endpoint", hub.url)
    assert rc == cli.EXIT_SOURCE and "is not a commit" in res["message"], res
    rc, res = fetch(tmp_path / "m", "--source", "hub", "--repo", "hs-test/tiny", "--revision", "f" * 40,
                    "--endpoint", hub.url)
    assert rc == cli.EXIT_SOURCE and "could not list hs-test/tiny" in res["message"], res


def test_the_hub_token_comes_from_a_file_and_is_never_shown(repo_dir, tmp_path):
    hub = FakeHub(repo_dir, "hs-test/tiny", token="hf_s3cret_token")
    try:
        rc, res = from_hub(tmp_path / "without", hub)
        assert rc == cli.EXIT_SOURCE and "token" in res["message"], res
        token = tmp_path / "token"
        token.write_text("hf_s3cret_token\n")
        rc, res = from_hub(tmp_path / "with", hub, "--token-file", str(token))
        assert rc == 0, res
        assert "hf_s3cret_token" not in json.dumps(res)
        assert "hf_s3cret_token" not in "".join(p.read_text(errors="replace") for p in (tmp_path / "with").glob(".hs-model*"))
    finally:
        hub.close()


def test_no_room_is_refused_before_anything_is_downloaded(hub, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small filesystem")
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "hs-test-small", str(small)], check=True)
    try:
        rc, res = from_hub(small / "model", hub)
        assert rc == cli.EXIT_ROOM, res
        assert "for 7 file(s) still to download" in res["message"] and "Nothing was downloaded" in res["message"]
        assert not [r for r in hub.log if "/resolve/" in r[1]], "a file was requested"
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_an_http_mirror_resumes_a_file_across_runs(hub, tmp_path):
    placed = tmp_path / "placed"
    assert from_hub(placed, hub)[0] == 0  # a verified directory is a mirror: it holds its manifest
    mirror = FakeHub(placed, "unused")
    try:
        mirror.cut[EXTRA] = 2 << 20  # every GET of the file ends after 2 MiB: 5 tries get 10 of 24 MiB
        mirror.cut_times = 5
        dest = tmp_path / "from-mirror"
        rc, res = fetch(dest, "--source", "http", "--url", f"{mirror.url}/mirror")
        assert rc == cli.EXIT_SOURCE and "resumes there" in res["message"], res
        assert (dest / dl.PARTIAL / EXTRA).stat().st_size == 10 << 20
        rc, res = fetch(dest, "--source", "http", "--url", f"{mirror.url}/mirror")
        assert rc == 0, res
        assert mirror.requests_for(EXTRA)[-1] == f"bytes={10 << 20}-"
        assert (dest / EXTRA).read_bytes() == (placed / EXTRA).read_bytes()
        assert not (dest / dl.PARTIAL).exists()
        identity = json.loads((dest / "hs-model-manifest.json").read_text())["identity"]
        assert identity == f"hub {hub.url} hs-test/tiny@{COMMIT}", "the mirror passes the source's identity on"
    finally:
        mirror.close()


def test_an_rsync_mirror_and_verify_later(hub, tmp_path):
    if not shutil.which("rsync"):
        pytest.skip("rsync not installed")
    placed = tmp_path / "placed"
    assert from_hub(placed, hub)[0] == 0
    dest = tmp_path / "from-rsync"
    rc, res = fetch(dest, "--source", "rsync", "--url", str(placed))
    assert rc == 0, res
    assert not (dest / ".cache").exists(), "only the model's files come over"
    rc, res = _run(["verify", str(dest)])
    assert rc == 0 and not res["changed"] and "unchanged since" in res["message"], res
    # a file changed since (same size, one byte): verify reads it again and refuses
    data = bytearray((dest / "config.json").read_bytes())
    data[10] ^= 0x01
    (dest / "config.json").write_bytes(bytes(data))
    rc, res = _run(["verify", str(dest)])
    assert rc == cli.EXIT_DAMAGED and "config.json: sha256" in res["message"], res
    rc, res = _run(["verify", str(tmp_path)])
    assert rc == cli.EXIT_NOTHING and "no hs-model-manifest.json" in res["message"]
