"""The SGLang unit on the test host, running the stand-in server."""

import json
import re

testinfra_hosts = ["ansible://gpu_hosts"]

UNIT = "/etc/systemd/system/sglang.service"
MODPROBE_LOG = "/var/log/hs-test/nvidia-modprobe.log"
# the cache variables the services role sets (roles/sglang_service/vars/main.yml)
CACHE_NAMES = {"XDG_CACHE_HOME", "HF_HOME", "HF_MODULES_CACHE", "TVM_FFI_CACHE_DIR", "FLASHINFER_WORKSPACE_BASE",
               "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "SGLANG_CACHE_DIR",
               "SGLANG_JIT_CACHE_DIR", "SGLANG_DG_CACHE_DIR", "CUDA_CACHE_PATH"}
KEY_FILE = "/var/lib/sglang/api-key"
GET = ("python3 -c \"import sys, urllib.request as u, urllib.error as e; h = {{'Authorization': 'Bearer ' + sys.argv[1]}} "
       "if sys.argv[1] else {{}}; r = u.Request('http://127.0.0.1:30000{path}', headers=h)\n"
       "try: print(u.urlopen(r).read().decode())\nexcept e.HTTPError as x: print(x.code)\" {key}")


def _key(host):
    return host.file(KEY_FILE).content_string.strip()


def _get(host, path, key=""):
    return host.check_output(GET.format(path=path, key=key or "''"))


def _debug(host):
    return json.loads(_get(host, "/debug", _key(host)))


def test_unit_passes_systemd_analyze_verify(host):
    host.run_test(f"systemd-analyze verify {UNIT}")


def test_unit_content(host):
    text = host.file(UNIT).content_string
    execstart = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    for part in ("--model-path /models/test-model", "--tp-size 8", "--host 127.0.0.1", "--port 30000",
                 "--disable-radix-cache", "--trust-remote-code",
                 # the memory plan (sglang_service_mem_fraction_static, _cuda_graph_max_bs; 0.5.9's flag name)
                 "--mem-fraction-static 0.83 --cuda-graph-max-bs 8"):
        assert part in execstart
    assert "--disable-prefill-cuda-graph" not in execstart  # 0.5.9 does not need it
    for line in ('Environment="HS_CAPTURE=1"', 'Environment="HS_CAPTURE_DIR=/dev/shm/hs_capture"',
                 'Environment="HS_CAPTURE_LAYERS=2,30,58"', 'Environment="HS_CAPTURE_FINAL=both"',
                 "Restart=on-failure", "LimitMEMLOCK=infinity", "User=sglang"):
        assert line in text.splitlines()


def test_unit_has_the_jit_toolchain_and_metrics(host):
    text = host.file(UNIT).content_string.splitlines()
    execstart = next(line for line in text if line.startswith("ExecStart="))
    assert "--enable-metrics" in execstart.split()
    for line in ('Environment="CUDA_HOME=/usr/local/cuda-12.8"',
                 'Environment="PATH=/opt/hs-patch/venv/bin:/usr/local/cuda-12.8/bin:/usr/local/sbin:/usr/local/bin:'
                 '/usr/sbin:/usr/bin:/sbin:/bin"',
                 'Environment="TVM_FFI_CACHE_DIR=/var/cache/sglang/tvm-ffi"',
                 'Environment="FLASHINFER_WORKSPACE_BASE=/var/cache/sglang"',
                 'Environment="TORCH_EXTENSIONS_DIR=/var/cache/sglang/torch_extensions"',
                 'Environment="TRITON_CACHE_DIR=/var/cache/sglang/triton"'):
        assert line in text
    # every device node made as root ('+') before anything else, for the 8 GPUs of hs_gpu_count, then the
    # caches check in the sandbox (the GPU checks are off on this host: no GPU)
    pre = [line for line in text if line.startswith("ExecStartPre=")]
    assert pre == ["ExecStartPre=+/usr/local/bin/nvidia-modprobe " + " ".join(f"-c={i}" for i in range(8)) + " -c=255",
                   "ExecStartPre=+/usr/local/bin/nvidia-modprobe -u -c=0",
                   "ExecStartPre=/opt/hs-patch/venv/bin/python /usr/local/lib/hs-patch/gpu_ready.py caches"], pre
    out = json.loads(host.check_output("/usr/local/lib/hs-patch/gpu-ready nccl --json"))
    assert out["ok"] and "not checked" in out["detail"]
    cache = host.file("/var/cache/sglang")
    assert cache.is_directory and cache.user == "sglang"


def test_device_nodes_made_as_root_before_each_start(host):
    """The fake nvidia-modprobe logs each call: both came as root, before the server's last start."""
    calls = [json.loads(x) for x in host.file(MODPROBE_LOG).content_string.splitlines()]
    last_start = float(host.file("/var/lib/sglang/starts.log").content_string.split()[-1])
    before = [c for c in calls if c["time"] < last_start][-2:]
    assert [c["argv"] for c in before] == [[f"-c={i}" for i in range(8)] + ["-c=255"], ["-u", "-c=0"]], calls
    assert {c["uid"] for c in calls} == {0}


def test_the_server_wrote_into_every_cache_the_unit_sets(host):
    """The stand-in writes a file into each cache directory at start (and dies naming one it cannot):
    the sandbox must let it, for every cache variable in the unit and the directories the libraries derive."""
    show = host.check_output("systemctl show --property=Environment --value sglang")
    env = dict(x.split("=", 1) for x in show.split())
    caches = {k: v for k, v in env.items() if "CACHE" in k or k in CACHE_NAMES}
    assert set(caches) >= CACHE_NAMES, sorted(caches)
    assert all(v == "/var/cache/sglang" or v.startswith("/var/cache/sglang/") for v in caches.values()), caches
    written = _debug(host)["caches"]
    derived = {"transformers modules": "/var/cache/sglang/huggingface/modules",
               "flashinfer": "/var/cache/sglang/.cache/flashinfer"}
    for what, directory in {**caches, **derived}.items():
        marker = host.file(f"{directory}/.hs-standin-{what.replace(' ', '-')}")
        assert written[what] == marker.path and marker.exists and marker.user == "sglang", (what, directory)
    # the same check, as the unit's ExecStartPre and fab's preflight run it: in the server's sandbox
    out = json.loads(host.check_output("/usr/local/lib/hs-patch/gpu-ready caches --json"))
    assert out["name"] == "caches" and out["ok"], out


def test_model_check_installed_and_passing_as_the_service_user(host):
    out = host.check_output("runuser -u sglang -- python3 /usr/local/lib/hs-patch/model_check.py /models/test-model "
                            "--architecture KimiK25ForConditionalGeneration --json")
    checks = {c["name"]: c for c in map(json.loads, out.splitlines())}
    assert all(c["ok"] for c in checks.values())
    assert checks["index"]["detail"] == "1 tensors in 1 shard(s)"


def test_running_and_enabled(host):
    """A run of the role ends serving, and the server comes back after a reboot."""
    svc = host.service("sglang")
    assert svc.is_running
    assert svc.is_enabled


def test_waits_for_its_mounts_the_driver_and_a_crash_loop_is_bounded(host):
    show = dict(line.split("=", 1) for line in host.check_output(
        "systemctl show --property=RequiresMountsFor,After,StartLimitBurst,StartLimitIntervalUSec sglang").splitlines())
    # at boot a DKMS build for a new kernel, or a slow module load, ends before the unit's first start
    assert set(show["After"].split()) >= {"dkms.service", "nvidia-persistenced.service",
                                           "nvidia-fabricmanager.service"}
    assert set(show["RequiresMountsFor"].split()) >= {"/models/test-model", "/var/cache/sglang", "/opt/hs-patch/venv"}
    # burst 5 x (the health wait, 30 x 1 s here, + RestartSec 1): a server failing after each long load still trips it
    assert show["StartLimitBurst"] == "5" and show["StartLimitIntervalUSec"] == "2min 35s"


def test_server_sees_the_unit_wiring(host):
    d = _debug(host)
    assert d["env"] == {"HS_CAPTURE": "1", "HS_CAPTURE_DIR": "/dev/shm/hs_capture",
                        "HS_CAPTURE_LAYERS": "2,30,58", "HS_CAPTURE_FINAL": "both", "HS_CAPTURE_DTYPE": "bf16"}
    assert d["argv"]["tp_size"] == 8 and d["argv"]["host"] == "127.0.0.1"
    assert "--disable-radix-cache" in d["argv"]["rest"]
    assert d["uid"] == host.user("sglang").uid
    # systemd applies LimitMEMLOCK=infinity; inside a test host it is capped by the
    # container's own hard limit when this machine may not raise it (no CAP_SYS_RESOURCE).
    assert host.check_output("systemctl show --property=LimitMEMLOCK --value sglang") == "infinity"
    pid1_hard = host.check_output("awk '/Max locked memory/ {print $5}' /proc/1/limits")
    assert d["memlock"] == "unlimited" or str(d["memlock"]) == pid1_hard
    assert d["cwd"] == "/var/lib/sglang"


def test_bound_to_loopback_only(host):
    assert host.socket("tcp://127.0.0.1:30000").is_listening
    assert not host.socket("tcp://0.0.0.0:30000").is_listening
    assert not host.socket("tcp://198.51.100.10:30000").is_listening


def test_restarted_after_the_kill(host):
    # the side effect saw systemd restart it (NRestarts=1), then restarted it for a changed unit, twice
    starts = host.file("/var/lib/sglang/starts.log").content_string.splitlines()
    assert len(starts) >= 4
    status = host.check_output("python3 -c \"import urllib.request as u; "
                               "print(u.urlopen('http://127.0.0.1:30000/health_generate').status)\"")
    assert status == "200"


def test_api_key_owner_only_and_never_on_a_command_line(host):
    key = _key(host)
    assert len(key) >= 40
    for path in (KEY_FILE, "/var/lib/sglang/server-config.yaml"):
        f = host.file(path)
        assert (f.user, f.group, f.mode) == ("sglang", "sglang", 0o600), path
    assert json.loads(host.file("/var/lib/sglang/server-config.yaml").content_string) == {"api-key": key}
    assert key not in host.file(UNIT).content_string
    pid = host.check_output("systemctl show --property=MainPID --value sglang")
    assert key not in host.check_output(f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    assert "--config /var/lib/sglang/server-config.yaml" in host.check_output(f"tr '\\0' ' ' < /proc/{pid}/cmdline")
    # the server logs every argument at start, the key among them (SGLang's engine does; the stand-in as it):
    # journald drops those lines where systemd reads LogFilterPatterns= (253 and later: Ubuntu 24.04's 255); this
    # Debian 12 test host's 252 cannot, and the role says so (the journal gets the key there)
    journal = host.check_output("journalctl -u sglang --no-pager")
    if int(host.check_output("systemctl --version").split()[1]) >= 253:
        assert "LogFilterPatterns=~api_key[^a-z_]?[=:]" in host.file(UNIT).content_string and key not in journal
    else:
        assert "LogFilterPatterns" not in host.file(UNIT).content_string
        assert f"api_key='{key}')" in journal, journal[-2000:]


def test_api_key_required_but_not_for_health(host):
    assert _get(host, "/debug") == "401"
    assert _get(host, "/debug", "wrong-key") == "401"
    assert json.loads(_get(host, "/debug", _key(host)))["api_key"] is True
    assert json.loads(_get(host, "/health_generate")) == {}


def test_sandbox_score_and_what_the_process_gets(host):
    out = host.check_output("systemd-analyze security sglang.service")
    score = float(re.search(r"Overall exposure level for sglang.service: ([0-9.]+)", out).group(1))
    print(f"systemd-analyze security sglang.service: {score}")
    assert score <= 3.0, out
    pid = host.check_output("systemctl show --property=MainPID --value sglang")
    status = host.file(f"/proc/{pid}/status").content_string
    assert re.search(r"^NoNewPrivs:\s+1$", status, re.M) and re.search(r"^CapBnd:\s+0+$", status, re.M)
    host.run_test("touch /tmp/hs-host-tmp-marker")
    d = _debug(host)
    assert "hs-host-tmp-marker" not in d["tmp"], "PrivateTmp: the server has its own /tmp"
    # the writable paths are the working dir, the caches and the capture dir (ProtectSystem=strict elsewhere)
    show = lambda prop: host.check_output(f"systemctl show --property={prop} --value sglang")  # noqa: E731
    assert show("ReadWritePaths") == "/var/lib/sglang /var/cache/sglang -/dev/shm/hs_capture"
    assert show("ProtectSystem") == "strict"


def test_pip_extra_args_reach_every_install(host):
    """sglang_pip_extra_args (here --log FILE, host_vars/gpu1.yml) goes to sglang's install and to the
    overrides' install on top (0.5.9's cuDNN): both appear in the log pip kept as told."""
    log = host.file("/var/log/hs-test-pip.log").content_string
    assert "Successfully installed sglang-0.5.9" in log
    assert "Successfully installed nvidia-cudnn-cu12-9.16.0.29" in log, "the overrides' install got no extra args"
