"""SGLang 0.5.9 installed in the venv from the wheelhouse (after playbooks/sglang.yml)."""

testinfra_hosts = ["ansible://gpu_hosts"]

VENV = "/opt/hs-patch/venv"


def test_installed_version_is_the_pin(host):
    out = host.check_output(f"{VENV}/bin/python -c \"import importlib.metadata as m; print(m.version('sglang'))\"")
    assert out == "0.5.9"


def test_deepseek_v2_source_present(host):
    site = host.check_output(f"{VENV}/bin/python -c \"import sysconfig; print(sysconfig.get_paths()['purelib'])\"")
    f = host.file(f"{site}/sglang/srt/models/deepseek_v2.py")
    assert f.is_file
    assert f.size > 100_000
    assert "class DeepseekV2ForCausalLM" in f.content_string


def test_wheelhouse_copied(host):
    files = host.check_output("ls /opt/hs-patch/wheelhouse").split()
    assert "sglang-0.5.9-py3-none-any.whl" in files


def test_only_the_pin_was_installed(host):
    # the side effect's 0.5.10 never reached pip
    out = host.check_output(f"{VENV}/bin/python -m pip list --format=freeze")
    assert "sglang==0.5.9" in out.splitlines()
