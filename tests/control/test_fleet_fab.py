"""``fab extract --hosts`` and ``fab status --hosts`` as the operator runs them, against two
loopback sshd's standing for two GPU hosts that are not provisioned: preflight runs on
every host and fails, so nothing starts on any (and the run's name stays free); the plan is fixed at the
first start."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest
import yaml

from lab import loopback_sshd

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    servers = [loopback_sshd.start(tmp_path_factory.mktemp(f"sshd{i}")) for i in range(2)]
    yield servers
    for s in servers:
        s.stop()


def inventory(tmp_path: Path, servers, names) -> Path:
    known = tmp_path / "known_hosts"
    known.write_text("".join(s.known_hosts.read_text() for s in servers))
    hosts = {n: {"ansible_host": "127.0.0.1", "ansible_port": s.port, "ansible_user": s.host.split("@")[0],
                 "ansible_ssh_private_key_file": str(s.key), "hs_ship_enabled": False}
             for n, s in zip(names, servers)}
    inv = tmp_path / "inv"
    inv.mkdir(exist_ok=True)
    (inv / "hosts.yml").write_text(yaml.safe_dump({"all": {"children": {"gpu_hosts": {"hosts": hosts}}}}))
    return inv


def fab(tmp_path: Path, inv: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HS_FLEET_DIR": str(tmp_path / "plans"), "PYTHONPATH": str(ROOT)}
    return subprocess.run(["fab", *args, "--inventory", str(inv), "--known-hosts", str(tmp_path / "known_hosts")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_preflight_runs_on_every_host_and_one_failure_starts_nothing(hosts, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    inv = inventory(tmp_path, hosts, ["gpu-b", "gpu-a"])
    r = fab(tmp_path, inv, "extract", "--hosts", "--dataset", str(data), "--run", "f1")
    assert r.returncode != 0
    assert "preflight failed on gpu-a, gpu-b; nothing was started on any host" in r.stderr, r.stderr
    for name, shard in (("gpu-a", "0/2"), ("gpu-b", "1/2")):
        assert f"{name} (run f1, shard {shard})" in r.stdout and f"{name:12} ok   ssh" in r.stdout, r.stdout
        assert f"{name:12} FAIL patch" in r.stdout
    # the run's name is not used up: no plan was saved (it held gpu-a's shard for a host that never ran), so
    # the next start plans it with the group as it is then, or the name serves a one-host run
    assert "and run f1 is not planned: the next start plans it with the group as it is then" in r.stderr
    assert not (tmp_path / "plans" / "f1.json").exists()
    r = fab(tmp_path, inventory(tmp_path, hosts[:1], ["gpu-b"]), "extract", "--hosts", "--dataset", str(data),
            "--run", "f1")
    assert "gpu-b (run f1, shard 0/1)" in r.stdout and "gpu-a" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "plans" / "f1.json").exists()

    # a run started on gpu-a and gpu-b (as a passing preflight saves it): a host added to the group later takes
    # no shard; --host of a fleet run runs that host's shard only
    start_plan(tmp_path, "f1", {"gpu-a": 0, "gpu-b": 1})
    inv = inventory(tmp_path, hosts, ["gpu-b", "gpu-c"])
    r = fab(tmp_path, inv, "extract", "--hosts", "gpu_hosts", "--dataset", str(data), "--run", "f1")
    assert "gpu-c joined the group after run f1 started: it takes no shard" in r.stdout, r.stdout
    assert "gpu-a is not in the group: its shard 0/2 is not being extracted" in r.stdout
    assert "gpu-b (run f1, shard 1/2)" in r.stdout and "gpu-c (run" not in r.stdout
    r = fab(tmp_path, inv, "extract", "--host", "gpu-b", "--dataset", str(data), "--run", "f1")
    assert "gpu-b (run f1, shard 1/2)" in r.stdout and "preflight failed on gpu-b;" in r.stderr, r.stdout + r.stderr


def start_plan(tmp_path: Path, run: str, shards: dict[str, int]) -> None:
    """The plan a fleet run's first start saves once every preflight passed (these hosts never pass one)."""
    (tmp_path / "plans").mkdir(exist_ok=True)
    (tmp_path / "plans" / f"{run}.json").write_text(json.dumps({"run": run, "shards": shards, "reassigned": {},
                                                                "created": 1.0}))


def test_fleet_options_that_cannot_work_are_refused_with_what_to_give(hosts, tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    inv = inventory(tmp_path, hosts, ["gpu-a", "gpu-b"])
    r = fab(tmp_path, inv, "extract", "--hosts", "--dataset", str(data))
    assert "a fleet run needs --run NAME" in r.stderr
    r = fab(tmp_path, inv, "extract", "--reassign", "gpu-a", "--host", "gpu-b", "--dataset", str(data), "--run", "f2")
    assert "run f2 has no fleet plan" in r.stderr and "fab extract --hosts GROUP" in r.stderr, r.stderr
    r = fab(tmp_path, inv, "status", "--hosts", "--run", "f2")
    assert "run f2 has no fleet plan" in r.stderr
    for task in ("stop", "ship"):
        r = fab(tmp_path, inv, task, "--hosts", "--run", "f2")
        assert r.returncode == 1 and f"fab {task}: run f2 has no fleet plan" in r.stderr and \
            f"for one host: fab {task} --host H --run NAME" in r.stderr, r.stderr
        r = fab(tmp_path, inv, task, "--hosts")
        assert f"fab {task} --hosts: give --run NAME (the fleet run)" in r.stderr, r.stderr
    r = fab(tmp_path, inv, "extract", "--hosts", "nogroup", "--dataset", str(data), "--run", "f3")
    assert "group 'nogroup' is not in inventory" in r.stderr, r.stderr


def test_a_reassignment_whose_host_fails_preflight_is_not_recorded(hosts, tmp_path):
    """--reassign recorded the move before OTHER's preflight: a refused one stayed in the plan, and a
    reassignment to a third host was then refused with 'stop it there first' (fab stop of a run never started)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    start_plan(tmp_path, "f4", {"gpu-a": 0, "gpu-b": 1})
    later = inventory(tmp_path, hosts, ["gpu-b", "gpu-c"])  # gpu-a gone, gpu-c new
    for other in ("gpu-b", "gpu-c"):
        r = fab(tmp_path, later, "extract", "--reassign", "gpu-a", "--host", other, "--dataset", str(data),
                "--run", "f4")
        assert r.returncode == 1 and f"preflight failed on {other}; nothing was started" in r.stderr, r.stderr
        assert f"{other:12} FAIL patch" in r.stdout and "already runs on" not in r.stderr, r.stdout + r.stderr
        assert ("gpu-a does not answer (not in the inventory): if it comes back, stop its run there before it "
                "extracts and ships more of this shard: fab stop --host gpu-a --run f4") in r.stdout, r.stdout
        assert json.loads((tmp_path / "plans" / "f4.json").read_text())["reassigned"] == {}


def test_the_first_move_of_a_shard_whose_host_still_extracts_it_is_refused(hosts, tmp_path, monkeypatch):
    """The first --reassign never asked the host it takes the shard from: one the control node merely could not
    reach (its link cut) went on extracting and shipping the shard beside its new host (with --regenerate,
    other tokens: both copies of its lines kept). A driver still running refuses it; a host that does not answer
    is named, with how to stop it when it is back."""
    from hs_patch.control import fleet_run
    from hs_patch.control.inventory import ConfigError, Inventory

    monkeypatch.setenv("HS_FLEET_DIR", str(tmp_path / "plans"))
    inv = Inventory(str(inventory(tmp_path, hosts, ["gpu-a", "gpu-b"])))
    start_plan(tmp_path, "f7", {"gpu-a": 0, "gpu-b": 1})
    asked: list[tuple[str, str]] = []
    monkeypatch.setattr(fleet_run, "holder_state", lambda i, host, run: asked.append((host, run)) or "active")
    with pytest.raises(ConfigError, match="gpu-a's driver of run f7 is active: .*fab stop --host gpu-a --run f7"):
        fleet_run.reassign(inv, "gpu-a", "gpu-b", "f7", "d.jsonl", False, 0, False, 60, 1.0, True, print)
    assert asked == [("gpu-a", "f7")]
    assert json.loads((tmp_path / "plans" / "f7.json").read_text())["reassigned"] == {}


def test_a_shard_whose_new_host_is_gone_or_idle_can_be_reassigned_again(hosts, tmp_path):
    """A recorded --reassign whose host then died: a second --reassign of the shard was refused with 'stop it
    there first (fab stop --host gpu-x ...)', which cannot reach a dead host and never clears the record."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    start_plan(tmp_path, "f5", {"gpu-a": 0, "gpu-b": 1})
    inv = inventory(tmp_path, hosts, ["gpu-b", "gpu-c"])  # gpu-a gone
    doc = yaml.safe_load((inv / "hosts.yml").read_text())
    with socket.socket() as s:  # a port nothing listens on: gpu-x, dead
        s.bind(("127.0.0.1", 0))
        dead = {**doc["all"]["children"]["gpu_hosts"]["hosts"]["gpu-b"], "ansible_port": s.getsockname()[1]}
    doc["all"]["children"]["gpu_hosts"]["hosts"]["gpu-x"] = dead
    (inv / "hosts.yml").write_text(yaml.safe_dump(doc))
    plan = tmp_path / "plans" / "f5.json"
    for holder, said in (("gpu-x", "unreachable: "), ("gpu-gone", "not in the inventory"), ("gpu-b", "unknown")):
        # as a reassignment to HOLDER whose preflight passed records it
        plan.write_text(json.dumps({**json.loads(plan.read_text()), "reassigned": {"gpu-a": holder}}))
        r = fab(tmp_path, inv, "extract", "--reassign", "gpu-a", "--host", "gpu-c", "--dataset", str(data),
                "--run", "f5")
        assert "already runs on" not in r.stderr and "stop it there first" not in r.stderr, r.stderr
        assert f"the shard of gpu-a was given to {holder}, whose driver of it is not running ({said}" in r.stdout, \
            r.stdout
        comes_back = f"if {holder} comes back, stop it there: fab stop --host {holder} --run f5.gpu-a"
        assert (comes_back in r.stdout) == (holder != "gpu-b"), r.stdout
        # then gpu-c's own preflight (not provisioned here): refused, so the record stays as it was
        assert r.returncode == 1 and "preflight failed on gpu-c; nothing was started" in r.stderr, r.stderr
        assert json.loads(plan.read_text())["reassigned"] == {"gpu-a": holder}


def test_a_host_back_takes_its_reassigned_shard_back_with_the_commands_fab_names(hosts, tmp_path):
    """After gpu-a's shard went to gpu-b, --reassign gpu-a --host gpu-a was refused with 'fab extract --host gpu-a
    --run R', which failed with 'no host of gpu-a has a shard of run R to run': a host back could not take its
    own shard back without editing the plan."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    inv = inventory(tmp_path, hosts, ["gpu-a", "gpu-b"])
    start_plan(tmp_path, "f6", {"gpu-a": 0, "gpu-b": 1})
    # not reassigned: --reassign gpu-a --host gpu-a names fab extract --host gpu-a, which runs gpu-a's shard
    # (refused here by preflight only: these hosts are not provisioned)
    r = fab(tmp_path, inv, "extract", "--reassign", "gpu-a", "--host", "gpu-a", "--dataset", str(data), "--run", "f6")
    assert "(to resume gpu-a itself: fab extract --host gpu-a --run f6)" in r.stderr, r.stderr
    r = fab(tmp_path, inv, "extract", "--host", "gpu-a", "--dataset", str(data), "--run", "f6")
    assert "gpu-a (run f6, shard 0/2)" in r.stdout and "preflight failed on gpu-a;" in r.stderr, r.stdout + r.stderr

    plan = tmp_path / "plans" / "f6.json"  # as a reassignment to gpu-b whose preflight passed records it
    plan.write_text(json.dumps({**json.loads(plan.read_text()), "reassigned": {"gpu-a": "gpu-b"}}))
    back = "to take it back: fab extract --reassign gpu-a --host gpu-a --run f6 --dataset DATASET"
    r = fab(tmp_path, inv, "extract", "--host", "gpu-a", "--dataset", str(data), "--run", "f6")
    assert r.returncode == 1 and "gpu-a's shard 0/2 runs on gpu-b" in r.stderr and back in r.stderr, r.stderr
    r = fab(tmp_path, inv, "extract", "--hosts", "--dataset", str(data), "--run", "f6")
    assert back in r.stdout and "gpu-b (run f6, shard 1/2)" in r.stdout and "gpu-a (run f6" not in r.stdout, r.stdout
    # the way back: gpu-b's driver of the shard is not running, so gpu-a's own job (run f6) after its preflight
    r = fab(tmp_path, inv, "extract", "--reassign", "gpu-a", "--host", "gpu-a", "--dataset", str(data), "--run", "f6")
    assert "the shard of gpu-a was given to gpu-b, whose driver of it is not running (unknown)" in r.stdout, r.stdout
    assert "gpu-a takes its shard 0/2 back as run f6, shipping into" in r.stdout, r.stdout
    assert "gpu-a (run f6, shard 0/2)" in r.stdout and "give another host" not in r.stderr, r.stdout + r.stderr
    assert r.returncode == 1 and "preflight failed on gpu-a; nothing was started" in r.stderr, r.stderr
    assert json.loads(plan.read_text())["reassigned"] == {"gpu-a": "gpu-b"}  # a refused preflight moves nothing
