"""Shipping from the GPU stand-in to the storage host, as the service user, with rsync over SSH."""

import pytest
import testinfra

testinfra_hosts = ["ansible://gpu1"]


@pytest.fixture(scope="module")
def storage(request):
    return testinfra.get_host("ansible://storage1", ansible_inventory=request.config.option.ansible_inventory)


def test_shipping_key(host):
    key = host.file("/var/lib/sglang/.ssh/id_hs_ship")
    assert key.user == "sglang" and key.mode == 0o600
    assert host.file("/var/lib/sglang/.ssh").mode == 0o700


def test_ssh_alias(host):
    cfg = host.file("/var/lib/sglang/.ssh/config").content_string
    for line in ("Host hs-storage", "HostName 198.51.100.11", "User hs-ingest", "StrictHostKeyChecking yes"):
        assert line in cfg


def test_known_hosts_pins_the_storage_host_key(host, storage):
    real = storage.file("/etc/ssh/ssh_host_ed25519_key.pub").content_string.split()[1]
    known = host.file("/var/lib/sglang/.ssh/known_hosts_hs-storage").content_string
    assert real in known
    assert len([l for l in known.splitlines() if l.strip()]) == 1


def test_rsync_on_both_ends(host, storage):
    assert host.package("rsync").is_installed
    assert storage.package("rsync").is_installed


GATE = "/usr/local/lib/hs-ingest"
SHIP = "runuser -u sglang -- "


def test_storage_side(storage):
    d = storage.file("/srv/hs-samples")
    assert d.is_directory and d.user == "hs-ingest" and d.mode == 0o750
    home = storage.user("hs-ingest").home
    auth = storage.file(f"{home}/.ssh/authorized_keys").content_string
    assert auth.startswith(f'restrict,command="/usr/bin/python3 {GATE}/gate.py /srv/hs-samples" ssh-ed25519 ')
    for name in ("gate.py", "at_destination.py"):
        f = storage.file(f"{GATE}/{name}")
        assert (f.user, f.mode) == ("root", 0o644), "the ingest account cannot change its own gate"


def test_service_user_ships_a_file_the_way_the_shipper_does(host, storage):
    host.run_test("head -c 1048576 /dev/urandom > /tmp/sample.bin && chmod 644 /tmp/sample.bin")
    sha = host.check_output("sha256sum /tmp/sample.bin").split()[0]
    storage.run_test("install -d -o hs-ingest -g hs-ingest /srv/hs-samples/t1/.incoming")
    # the options hs_patch.host.shipping.link.Link.send passes
    host.run_test(SHIP + "rsync --times --partial-dir=.rsync-partial --timeout=120 /tmp/sample.bin "
                  "hs-storage:/srv/hs-samples/t1/.incoming/")
    assert storage.check_output("sha256sum /srv/hs-samples/t1/.incoming/sample.bin").split()[0] == sha
    assert storage.file("/srv/hs-samples/t1/.incoming/sample.bin").user == "hs-ingest"
    assert host.run(SHIP + "ssh hs-storage df -Pk /srv/hs-samples").rc == 0
    storage.run_test("rm -rf /srv/hs-samples/t1")


@pytest.mark.parametrize("attempt", [
    "ssh hs-storage id",
    "ssh hs-storage 'cat /etc/passwd'",
    "ssh hs-storage 'rm -rf /srv/hs-samples'",
    "rsync -a /tmp/sample.bin hs-storage:/srv/hs-samples/",            # outside .incoming, with -a's options
    "rsync --times /tmp/sample.bin hs-storage:/tmp/",                    # outside the storage directory
    "rsync --times hs-storage:/etc/passwd /tmp/stolen",                 # reading from storage
])
def test_the_key_can_do_nothing_else(host, storage, attempt):
    host.run_test("touch /tmp/sample.bin && chmod 644 /tmp/sample.bin")
    r = host.run(SHIP + attempt)
    assert r.rc != 0 and "hs-ingest-gate: refused" in r.stderr, (r.rc, r.stdout, r.stderr)
    assert storage.file("/srv/hs-samples").is_directory
    assert not host.file("/tmp/stolen").exists
