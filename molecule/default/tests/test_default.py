"""site.yml's result as fab sees it: the deploy user with sudo, fab's preflight, fab verify, and a
sample shipped by the real hs-extract ship through the storage host's forced command."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import testinfra

ROOT = Path(__file__).resolve().parents[3]
VAULT = str(ROOT / "molecule" / "default" / "vault-password")
sys.path.insert(0, str(ROOT))

testinfra_hosts = ["ansible://gpu1"]

WRITE_SAMPLE = """
from hs_patch.samples import store
ids = list(range(1000, 1016))
key = store.sample_key(ids)
t = store.TensorBytes("input_ids", "I64", (len(ids),), [store.ids_bytes(ids)])
w = store.write_sample("/dev/shm/hs-mol/samples", key, [t], {"format": store.FORMAT, "key": key}, fsync=True)
store.Manifest("/dev/shm/hs-mol/samples").add(w, tokens=len(ids))
print(w.key, w.sha256)
"""


@pytest.fixture(scope="module")
def inventory(request):
    return request.config.option.ansible_inventory


@pytest.fixture(scope="module")
def root(inventory):
    """gpu1 as root over the lab's own key (testinfra's sudo cannot give deploy's password)."""
    from hs_patch.control.inventory import load

    t = load("gpu1", inventory, vault_password_files=[VAULT])
    return testinfra.get_host(f"ssh://root@{t.host}", ssh_identity_file=t.key_file,
                              ssh_extra_args=f"-o UserKnownHostsFile={t.known_hosts} -o StrictHostKeyChecking=yes")


@pytest.fixture(scope="module")
def storage(inventory):
    return testinfra.get_host("ansible://storage1", ansible_inventory=inventory)


def test_fab_reads_the_scenario_inventory_through_ansible(inventory):
    from hs_patch.control.inventory import load

    t = load("gpu1", inventory, vault_password_files=[VAULT])
    assert (t.host, t.user, t.become) == ("198.51.100.10", "deploy", True)
    assert t.become_password == "deploy-sudo-pw", "decrypted from host_vars/gpu1.yml with the vault password"
    assert t.known_hosts and t.known_hosts.endswith("/lab/known_hosts"), "UserKnownHostsFile from molecule's ssh args"
    assert t.model_path == "/models/test-model" and t.api_key_file == "/var/lib/sglang/api-key"


def test_fab_preflight_passes_as_deploy_with_sudo(inventory):
    import fabfile
    from hs_patch.control import host_checks
    from hs_patch.control.inventory import load

    t = load("gpu1", inventory, vault_password_files=[VAULT])
    c = fabfile._connect(t)
    checks = host_checks.preflight(c, t, estimated_bytes=1 << 20, bytes_per_token=100)
    table = "\n".join(f"{'ok' if ch.ok else 'FAIL'} {ch.name}: {ch.detail}" for ch in checks)
    print(table)
    assert [ch.name for ch in checks] == ["ssh", "patch", "gpus", "gpu ready", "server flags", "api key", "model",
                                          "dirs", "dump space", "samples space", "storage"]
    assert all(ch.ok for ch in checks), table
    assert "(sudo to root)" in checks[0].detail
    assert c.run(["id", "-u"]).stdout.strip() == "0", "fab's commands run as root through sudo"
    assert c.run(["id", "-un"], as_root=False).stdout.strip() == "deploy"


def test_fab_verify(inventory):
    out = subprocess.run(["fab", "verify", "-h", "gpu1", "-i", inventory, "--vault-password-file", VAULT],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "patch intact on SGLang 0.5.9" in out.stdout, out.stdout


def test_the_real_shipper_ships_through_the_forced_command(root, storage):
    as_sglang = "runuser -u sglang -- "
    root.run_test("install -d -o sglang -g sglang -m 0750 /dev/shm/hs-mol /var/lib/sglang/mol-state")
    key, sha = root.check_output(as_sglang + "/opt/hs-patch/venv/bin/python -c '%s'" % WRITE_SAMPLE).split()
    ship = root.run(as_sglang + "/opt/hs-patch/venv/bin/hs-extract ship --samples-dir /dev/shm/hs-mol/samples "
                    "--state-dir /var/lib/sglang/mol-state --dest hs-storage:/srv/hs-samples/mol")
    assert ship.rc == 0, ship.stdout + ship.stderr
    assert not root.file(f"/dev/shm/hs-mol/samples/{key}.safetensors").exists, "deleted once verified"
    refused = root.run(as_sglang + "ssh hs-storage id")
    assert refused.rc != 0 and "hs-ingest-gate: refused" in refused.stderr
    root.run_test("rm -rf /dev/shm/hs-mol /var/lib/sglang/mol-state")
    entries = [json.loads(x) for x in storage.file("/srv/hs-samples/mol/manifest.jsonl").content_string.splitlines()]
    assert [(e["key"], e["sha256"], e["file"]) for e in entries] == [(key, sha, f"samples/{key}.safetensors")]
    assert storage.check_output(f"sha256sum /srv/hs-samples/mol/samples/{key}.safetensors").split()[0] == sha
    storage.run_test("rm -rf /srv/hs-samples/mol")


def test_server_running_with_its_key_and_sandbox(root):
    assert root.service("sglang").is_running
    out = root.check_output("systemd-analyze security sglang.service")
    print(out.splitlines()[-1])
    assert "Overall exposure level for sglang.service: 2." in out
    f = root.file("/var/lib/sglang/api-key")
    assert (f.user, f.mode) == ("sglang", 0o600) and len(f.content_string.strip()) >= 40
