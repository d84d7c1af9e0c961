"""After the side effect: upgraded to 0.5.14, a failed upgrade to 0.5.21 rolled back to it, then moved
down to 0.5.10.post1 (three families, a release with a replaced requirement, a shared file)."""

import json

testinfra_hosts = ["ansible://gpu_hosts"]

UNIT = "/etc/systemd/system/sglang.service"
RELEASES = "/opt/hs-patch/venvs"
DEBUG = ("python3 -c \"import sys, urllib.request as u; print(u.urlopen(u.Request('http://127.0.0.1:30000/debug', "
         "headers={'Authorization': 'Bearer ' + sys.argv[1]})).read().decode())\" ")


def _status(host, venv):
    return json.loads(host.check_output(f"{venv}/bin/hs-patch status --json"))


def test_the_venv_link_points_at_the_upgraded_release(host):
    link = host.file("/opt/hs-patch/venv")
    assert link.is_symlink
    assert link.linked_to == f"{RELEASES}/sglang-0.5.10.post1"


def test_the_server_runs_the_upgraded_release(host):
    assert host.service("sglang").is_running
    key = host.file("/var/lib/sglang/api-key").content_string.strip()
    debug = json.loads(host.check_output(DEBUG + key))
    assert debug["sglang"] == "0.5.10.post1"
    assert debug["venv"] == f"{RELEASES}/sglang-0.5.10.post1"
    assert "--disable-piecewise-cuda-graph" in debug["argv"]["rest"]


def test_the_served_release_is_patched_and_verifies(host):
    status = _status(host, "/opt/hs-patch/venv")
    assert (status["state"], status["release"]) == ("patched", "0.5.10.post1")
    host.run_test("/opt/hs-patch/venv/bin/hs-patch verify")


def test_every_release_venv_is_kept_and_patched(host):
    """The upgrade never deletes a venv: 0.5.9 (the first), 0.5.14, and 0.5.21 (patched, never served) stay."""
    for version in ("0.5.9", "0.5.14", "0.5.21", "0.5.10.post1"):
        status = _status(host, f"{RELEASES}/sglang-{version}")
        assert (status["state"], status["release"]) == ("patched", version)
        host.run_test(f"{RELEASES}/sglang-{version}/bin/hs-patch verify")


def test_the_unit_is_the_upgraded_release_s_not_the_failed_one(host):
    text = host.file(UNIT).content_string
    execstart = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert execstart.startswith("ExecStart=/opt/hs-patch/venv/bin/python ")
    assert "--disable-piecewise-cuda-graph" in execstart and "--disable-prefill-cuda-graph" not in execstart
    assert 'Environment="CUDA_HOME=/usr/local/cuda-12.8"' in text.splitlines()
    assert "HS_CAPTURE_SLOTS" not in text, "the failed release's unit was not rolled back"
    host.run_test(f"systemd-analyze verify {UNIT}")


def test_a_replaced_requirement_is_installed_as_the_release_names_it(host):
    """0.5.21 pins cuda-tile==1.6.0rc5, which only a stub serves on PyPI: its venv holds 1.6.0 instead."""
    out = host.check_output(f"{RELEASES}/sglang-0.5.21/bin/python -c "
                            "\"import importlib.metadata as m; print(m.version('cuda-tile'))\"")
    assert out.strip() == "1.6.0"
