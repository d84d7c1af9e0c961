"""fab reads host variables through Ansible itself, so it sees what a play sees."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hs_patch.control.inventory import ConfigError, Inventory, load, load_group

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
VAULT_PASSWORD = "correct horse"


def _tool(name: str) -> str:
    cand = BIN / name
    return str(cand) if cand.exists() else (shutil.which(name) or name)


def _vault(tmp: Path, secret: str) -> str:
    """An inline !vault value, encrypted by ansible-vault itself."""
    pw = tmp / "vault-pw"
    pw.write_text(VAULT_PASSWORD)
    out = subprocess.run([_tool("ansible-vault"), "encrypt_string", "--vault-password-file", str(pw), secret],
                         capture_output=True, text=True, check=True).stdout
    return out.strip()


def write_inventory(d: Path) -> Path:
    """hosts.yaml (not .yml), group_vars as a directory of .yaml files, host_vars with a vaulted
    sudo password and a Jinja value, a non-root SSH user."""
    (d / "group_vars" / "gpu_hosts").mkdir(parents=True)
    (d / "host_vars").mkdir()
    (d / "hosts.yaml").write_text(yaml.safe_dump({"all": {"children": {"gpu_hosts": {"hosts": {
        "gpu1": {"ansible_host": "198.51.100.10", "ansible_user": "ubuntu", "ansible_port": 2222,
                 "ansible_ssh_common_args": "-o StrictHostKeyChecking=yes -o UserKnownHostsFile=/etc/hs/known_hosts"},
        "gpu2": {"ansible_host": "198.51.100.12", "ansible_user": "root"}}}}}}))
    (d / "group_vars" / "gpu_hosts" / "main.yaml").write_text(
        "hs_venv: /opt/v\nhs_server_port: 31000\nhs_service_user: svc\n"
        "hs_dump_dir: \"/dev/shm/{{ hs_service_user }}-capture\"\n"
        "hs_server_api_key_file: \"/var/lib/{{ hs_service_user }}/api-key\"\n"
        "hs_sglang_wheelhouse: '{{ playbook_dir }}/../wheelhouse'\nhs_capture_layers: [1, 2]\n")
    (d / "group_vars" / "gpu_hosts" / "ship.yml").write_text("hs_ship_enabled: 'no'\n")
    (d / "host_vars" / "gpu1.yml").write_text(
        "hs_server_port: 32000\n" + _vault(d.parent, "s3cret sudo").replace("!vault", "ansible_become_password: !vault", 1)
        + "\n")
    return d


@pytest.fixture
def inv(tmp_path: Path) -> Path:
    return write_inventory(tmp_path / "inventory")


def test_every_layer_as_ansible_reads_it(inv):
    t = load("gpu1", str(inv), vault_password_files=[str(inv.parent / "vault-pw")])
    assert (t.host, t.name, t.user, t.port) == ("198.51.100.10", "gpu1", "ubuntu", 2222)
    assert t.venv == "/opt/v" and t.service_user == "svc" and t.capture_layers == [1, 2]
    assert t.server_port == 32000, "host_vars override group_vars"
    assert t.dump_dir == "/dev/shm/svc-capture" and t.api_key_file == "/var/lib/svc/api-key", "Jinja rendered"
    assert t.ship_enabled is False, "a .yml next to a .yaml in a group_vars directory; 'no' is a boolean"
    assert t.known_hosts == "/etc/hs/known_hosts", "UserKnownHostsFile from ansible_ssh_common_args"
    assert t.become and t.become_password == "s3cret sudo", "non-root user: sudo, with the vaulted password"
    assert "s3cret" not in repr(t), "the password never shows in a repr (logs, tracebacks)"
    assert t.state_dir("r1") == "/var/lib/hs-patch/runs/r1" and t.samples_dir("r1") == "/dev/shm/hs-runs/r1/samples"


def test_extra_vars_win_like_ansible_playbook_e(inv, tmp_path):
    f = tmp_path / "extra.yml"
    f.write_text("hs_gpu_count: 4\nhs_service_user: other\n")
    t = load("gpu2", str(inv), extra_vars=["hs_server_port=33000", f"@{f}", '{"hs_capture_final": "both"}'])
    assert (t.server_port, t.gpu_count, t.capture_final) == (33000, 4, "both")
    assert t.dump_dir == "/dev/shm/other-capture", "templates see the extra vars too"
    assert not t.become and t.user == "root"
    # a second read in the same process starts from no extra vars (Ansible caches them globally)
    assert load("gpu2", str(inv)).server_port == 31000


def test_a_bad_extra_var_is_named_not_the_inventory(inv, tmp_path):
    """-e '{bad json' was reported as 'inventory DIR: YAML parsing failed', after Ansible's warnings
    that each inventory plugin failed."""
    for value, said in (("{bad json", "YAML parsing failed"), ("[1, 2]", "could not be made into a dictionary"),
                        (f"@{tmp_path}/none.yml", "Unable to retrieve file contents"),
                        ("/x.yml", "prepend extra_vars filename")):
        with pytest.raises(ConfigError) as e:
            load("gpu2", str(inv), extra_vars=["hs_gpu_count=4", value])
        assert str(e.value).startswith(f"--extra-vars {value!r}: ") and said in str(e.value), str(e.value)
        assert str(inv) not in str(e.value) and "ansible-playbook -e" in str(e.value)
    assert load("gpu2", str(inv), extra_vars=["hs_server_port=33000"]).server_port == 33000, "a good one after"


def test_fab_only_knobs_are_documented_with_fabs_defaults(inv):
    """hs_runs_state_root, hs_runs_samples_root and hs_known_hosts_file are documented with the other knobs,
    with the defaults fab uses; the documented "" keeps the inventory's UserKnownHostsFile."""
    from hs_patch.control.inventory import Target

    knobs = yaml.safe_load((ROOT / "inventory/group_vars/gpu_hosts.yml").read_text())
    t = Target(host="h")
    assert (knobs["hs_runs_state_root"], knobs["hs_runs_samples_root"]) == (t.state_root, t.samples_root)
    assert knobs["hs_known_hosts_file"] == "" and t.known_hosts is None
    shutil.copy(ROOT / "inventory/group_vars/gpu_hosts.yml", inv / "group_vars" / "gpu_hosts" / "0-bundle.yml")
    (inv / "host_vars" / "gpu2.yml").write_text("hs_runs_state_root: /srv/state\nhs_known_hosts_file: /etc/kh\n"
                                               "sglang_service_check_dir: /opt/checks\n"
                                               "sglang_service_name: sglang-kimi\n")
    pw = [str(inv.parent / "vault-pw")]
    gpu1, gpu2 = load("gpu1", str(inv), vault_password_files=pw), load("gpu2", str(inv))
    assert gpu1.known_hosts == "/etc/hs/known_hosts", "the documented default keeps UserKnownHostsFile"
    assert (gpu1.state_root, gpu1.check_dir) == ("/var/lib/hs-patch/runs", "/usr/local/lib/hs-patch")
    assert (gpu2.state_root, gpu2.known_hosts, gpu2.check_dir) == ("/srv/state", "/etc/kh", "/opt/checks")
    role = yaml.safe_load((ROOT / "roles/sglang_service/defaults/main.yml").read_text())
    assert (gpu1.service, gpu2.service) == (role["sglang_service_name"], "sglang-kimi"), "the host's, else the role's"


def test_vault_without_password_says_how(inv):
    with pytest.raises(ConfigError, match="--vault-password-file"):
        load("gpu1", str(inv))


def test_inventory_file_dir_and_address(inv):
    by_file = load("gpu2", str(inv / "hosts.yaml"))
    by_dir = load("gpu2", str(inv))
    assert by_file == by_dir and by_file.venv == "/opt/v"
    assert load("198.51.100.12", str(inv)).name == "gpu2", "an address finds its inventory host"
    with pytest.raises(ConfigError, match="not in inventory"):
        load("gpu9", str(inv))
    with pytest.raises(ConfigError, match=r"no inventory at .*/nowhere/hosts.yml:"):
        load("gpu1", str(inv / "nowhere" / "hosts.yml"))


def test_group_gives_every_host_with_its_variables(inv):
    hosts = load_group("gpu_hosts", str(inv), vault_password_files=[str(inv.parent / "vault-pw")])
    assert [(t.name, t.server_port, t.become) for t in hosts] == [("gpu1", 32000, True), ("gpu2", 31000, False)]
    with pytest.raises(ConfigError, match="groups there"):
        Inventory(str(inv)).group("nope")



def test_a_group_naming_one_machine_twice_is_refused(tmp_path):
    """Two names for one machine both got a shard, and the second's job was taken for the first's (the same
    unit names): its shard never ran."""
    inv = write_inventory(tmp_path / "inventory")
    (inv / "host_vars" / "gpu2.yml").write_text("ansible_host: 198.51.100.10\nansible_port: 2222\n")
    with pytest.raises(ConfigError, match=r"'gpu_hosts': gpu1 and gpu2 are one machine \(198.51.100.10:2222\)"):
        load_group("gpu_hosts", str(inv), vault_password_files=[str(inv.parent / "vault-pw")])


@pytest.mark.parametrize("var, value, message", [
    ("ansible_become_method", "su\nansible_user: ubuntu", "sudo"),
    ("ansible_become_user", "sglang\nansible_user: ubuntu", "sudo to root"),
    ("hs_server_port", "'{{ undefined_thing }}'", "undefined_thing"),
    ("hs_venv", "opt/v", "absolute path"),
    ("sglang_service_name", "'sglang; touch /tmp/x'", "not a valid name"),
    ("hs_service_user", "'-o'", "not a valid name"),
    ("hs_server_port", "thirty", "hs_server_port"),
    ("sglang_service_check_dir", "usr/lib/checks", "absolute path"),
    ("hs_runs_samples_root", "'/dev/shm/hs runs'", "holds whitespace: the run's sandbox"),
    ("hs_dump_dir", "'/dev/shm/hs\tcapture'", "holds whitespace"),
])
def test_unusable_values_are_refused_with_the_variable_named(inv, var, value, message):
    (inv / "host_vars" / "gpu2.yml").write_text(f"{var}: {value}\n")
    with pytest.raises(ConfigError, match=message):
        load("gpu2", str(inv))


def test_production_inventory_has_the_seed_host():
    t = load("10.1.230.174", str(ROOT / "inventory"))
    assert t.user == "root" and not t.become and t.venv.startswith("/")
    assert t.api_key_file == "/var/lib/sglang/api-key"


def test_fab_sees_what_a_play_sees(inv, tmp_path):
    """The same knobs rendered by a real ansible run (local connection, this machine) and by fab."""
    extra = ['{"hs_gpu_count": 2}']  # JSON: k=v extra vars are strings to Ansible
    t = load("gpu2", str(inv), extra_vars=extra)
    knobs = {"hs_venv": t.venv, "hs_dump_dir": t.dump_dir, "hs_server_port": t.server_port,
             "hs_server_api_key_file": t.api_key_file, "hs_capture_layers": t.capture_layers,
             "hs_gpu_count": t.gpu_count, "hs_ship_enabled": t.ship_enabled}
    # (a play reads hs_ship_enabled through | bool, as fab does)
    msg = "{{ {" + ", ".join(f"'{k}': {k}" + (" | bool" if k == "hs_ship_enabled" else "") for k in knobs) + "} | to_json }}"
    proc = subprocess.run([_tool("ansible"), "gpu2", "-i", str(inv), "-c", "local", "-e", extra[0],
                           "-e", f"ansible_python_interpreter={sys.executable}", "-m", "ansible.builtin.debug",
                           "-a", f"msg={msg}"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_COLOR": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    seen = json.loads(proc.stdout.split("=>", 1)[1])["msg"]  # gpu2 | SUCCESS => {"msg": ...}
    assert (json.loads(seen) if isinstance(seen, str) else seen) == knobs
