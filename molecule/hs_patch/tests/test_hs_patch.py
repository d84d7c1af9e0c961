"""The real deepseek_v2.py of sglang 0.5.9 on the test host, patched and verified by the real hs-patch."""

import json

testinfra_hosts = ["ansible://gpu_hosts"]

HS = "/opt/hs-patch/venv/bin/hs-patch"


def _json(host, args, rc=0):
    cmd = host.run(f"{HS} {args} --json")
    assert cmd.rc == rc, cmd.stdout + cmd.stderr
    return json.loads(cmd.stdout)


def test_cli_installed_from_the_wheel(host):
    assert host.file(HS).is_file
    out = host.check_output("/opt/hs-patch/venv/bin/python -m pip list --format=freeze")
    assert "hs-patch==0.1.0" in out.splitlines() or any(l.startswith("hs_patch==") for l in out.splitlines())
    assert host.file("/opt/hs-patch/dist").is_directory


def test_status_patched_0_5_9(host):
    st = _json(host, "status")
    assert st["state"] == "patched"
    assert st["release"] == "0.5.9"
    assert "--disable-radix-cache" in st["required_server_flags"]


def test_verify_passes(host):
    res = _json(host, "verify")
    assert "error" not in res


def test_second_apply_reports_no_change(host):
    res = _json(host, "apply")
    assert res["changed"] is False
    assert res["state"] == "patched"


def test_patched_file_is_valid_python(host):
    site = host.check_output("/opt/hs-patch/venv/bin/python -c \"import sysconfig; print(sysconfig.get_paths()['purelib'])\"")
    host.run_test(f"/opt/hs-patch/venv/bin/python -m py_compile {site}/sglang/srt/models/deepseek_v2.py")
    assert "# local tweak by an operator" not in host.file(f"{site}/sglang/srt/models/deepseek_v2.py").content_string
