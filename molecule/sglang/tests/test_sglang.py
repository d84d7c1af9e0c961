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


def test_wheelhouse_synchronized(host):
    files = host.check_output("ls /opt/hs-patch/wheelhouse/0.5.9").split()
    assert sorted(files) == ["nvidia_cudnn_cu12-9.16.0.29-py3-none-manylinux_2_27_x86_64.whl",
                             "requirements.txt", "sglang-0.5.9-py3-none-any.whl"]


def test_one_venv_per_release_behind_the_link(host):
    link = host.file(VENV)
    assert link.is_symlink and link.linked_to == "/opt/hs-patch/venvs/sglang-0.5.9"
    assert host.file("/opt/hs-patch/venvs/sglang-0.5.9").user == "root"


def test_the_cudnn_override_is_installed(host):
    # 0.5.9 refuses Kimi-K2.5 on torch 2.9.1 with cuDNN < 9.15; the lock installs 9.16.0.29 over torch's pin
    out = host.check_output(f"{VENV}/bin/python -c \"import importlib.metadata as m; print(m.version('nvidia-cudnn-cu12'))\"")
    assert out == "9.16.0.29"


def test_only_the_pin_was_installed(host):
    # the side effect's 0.5.10 never reached pip
    out = host.check_output(f"{VENV}/bin/python -m pip list --format=freeze")
    assert "sglang==0.5.9" in out.splitlines()
