"""A fleet end to end on real SSH test hosts: three GPU hosts (stand-in servers), one storage host.

``fab extract --hosts`` runs one dataset over the three, one shard each, preflight on all
first; one host is cut off mid-run (its network link down: to fab and to storage it is
dead); ``fab extract --reassign`` gives its shard to a host that has finished its own.
At the end, at storage: every sample of the dataset exactly once over the run's parts,
each part holding only its shard, verified; the reassigned driver redid nothing that had
reached storage.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab.demo import STORAGE, Demo
from lab.runcheck import write_chats

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("systemd-nspawn"),
                       reason="test hosts need root and systemd-nspawn (scripts/install-deps.sh)"),
]

ROOT = Path(__file__).resolve().parents[2]
GPUS = (("gpu1", "198.51.100.40"), ("gpu2", "198.51.100.41"), ("gpu3", "198.51.100.42"))
STORE = ("storage", "198.51.100.43")
RUN = "fleet"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    d = Demo(tmp_path_factory.mktemp("fleet"), gpus=GPUS, storage=STORE)
    try:
        d.up()
        d.provision()
        yield d
    finally:
        link(d, "gpu2", up=True)
        d.down()


def link(d: Demo, host: str, *, up: bool) -> None:
    """The host's network link on the lab bridge (down: unreachable, as a dead host)."""
    veth = next((h["veth"] for h in d.lab.load().get("hosts", []) if h["name"] == host), None)
    if veth:
        subprocess.run(["ip", "link", "set", veth, "up" if up else "down"], check=False)


def fab(d: Demo, plan_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["fab", *args, "--inventory", str(d.inventory), "--known-hosts", d.lab.describe()["known_hosts"]]
    env = {**os.environ, "HS_FLEET_DIR": str(plan_dir), "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    print("+ " + " ".join(cmd), flush=True)
    r = subprocess.run(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=1200)
    print(r.stdout[-4000:], r.stderr[-2000:], flush=True)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def status(d: Demo, host: str, run: str) -> dict:
    out = d.ssh(host, f"cat /var/lib/hs-patch/runs/{run}/status.json 2>/dev/null || true", check=False).stdout
    return json.loads(out) if out.strip() else {}


def unit_state(d: Demo, host: str, unit: str) -> str:
    return d.ssh(host, f"systemctl show -p ActiveState --value {unit}.service").stdout.strip()


def wait(what: str, predicate, timeout: float = 300, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_three_hosts_one_dataset_a_host_dies_its_shard_is_reassigned(lab, tmp_path):
    from hs_patch import reader, shard, store

    data = tmp_path / "chats.jsonl"
    expected = set(write_chats(data, 600, words=24))
    plans = tmp_path / "plans"
    out = fab(lab, plans, "extract", "--hosts", "--dataset", str(data), "--run", RUN, "--detach").stdout
    for g, _ in GPUS:  # preflight on every host before any starts
        assert f"{g} (run {RUN}, shard" in out and out.index(f"{g} (run") < out.index("starting the server units")
    plan = json.loads((plans / f"{RUN}.json").read_text())
    assert plan["shards"] == {"gpu1": 0, "gpu2": 1, "gpu3": 2}
    mine = {g: {s for s in expected if shard.parse(f"{i}/3").owns(s)} for i, (g, _) in enumerate(GPUS)}

    # gpu2 dies mid-run: some of its samples shipped, the rest not
    def shipped_some() -> bool:
        st = status(lab, "gpu2", RUN)
        assert st.get("state") not in ("stopped", "failed"), f"gpu2's driver ended: {st.get('message')}"
        return (st.get("shipping") or {}).get("shipped", 0) >= 10

    wait("gpu2 to ship some samples", shipped_some, every=0.5)
    link(lab, "gpu2", up=False)
    for g in ("gpu1", "gpu3"):
        wait(f"{g} to finish", lambda g=g: unit_state(lab, g, f"hs-drive-{RUN}") == "inactive"
             and unit_state(lab, g, f"hs-ship-{RUN}") == "inactive", timeout=600, every=3)
        assert status(lab, g, RUN)["state"] == "finished"
    st = fab(lab, plans, "status", "--hosts", "--run", RUN, "--once").stdout
    assert "unreachable" in st and "gpu1" in st and "gpu3" in st, st

    # gpu1 has finished its own shard (its server serves one driver at a time): it takes gpu2's
    out = fab(lab, plans, "extract", "--reassign", "gpu2", "--host", "gpu1", "--dataset", str(data), "--run", RUN)
    assert "finished" in out.stdout
    moved = f"{RUN}.gpu2"
    assert status(lab, "gpu1", moved)["state"] == "finished"
    assert json.loads((plans / f"{RUN}.json").read_text())["reassigned"] == {"gpu2": "gpu1"}
    st = fab(lab, plans, "status", "--hosts", "--run", RUN, "--once").stdout
    assert "gpu1 (shard of gpu2)" in st, st

    # at storage: every sample once, each part only its shard, all verified
    dest = tmp_path / "dest"
    lab.rsync(f"{lab.addr(STORE[0])}:/srv/hs-samples/{RUN}/", f"{dest}/")
    assert sorted(p.name for p in dest.iterdir()) == ["gpu1", "gpu2", "gpu3"]
    ids: dict[str, str] = {}
    for g, _ in GPUS:
        part = {e["sample_id"] for e in store.read_manifest(dest / g).values()}
        assert part <= mine[g], f"{g}/ holds samples of another shard: {sorted(part - mine[g])[:5]}"
        for sid in part:
            assert sid not in ids, f"{sid} in {ids[sid]}/ and {g}/"
            ids[sid] = g
    assert set(ids) == expected, f"lost {sorted(expected - set(ids))[:5]}"
    rep = reader.check_dir(dest, deep=True)
    assert rep.clean and len(rep.ok) == len(expected), rep
    inspect = subprocess.run([sys.executable, "-m", "hs_patch.host.patch_cli", "inspect", str(dest)], cwd=ROOT,
                             capture_output=True, text=True)
    assert inspect.returncode == 0, inspect.stdout + inspect.stderr

    # never duplicated: what gpu2 had shipped counted as done for gpu1, which sent only the rest
    ledger = [json.loads(x) for x in lab.ssh("gpu1", f"cat /var/lib/hs-patch/runs/{moved}/ledger.jsonl")
              .stdout.splitlines()]
    start = next(e for e in ledger if e["event"] == "run_start")
    sent = {e["key"] for e in ledger if e["event"] == "sent"}
    assert start["done_shipped"] >= 10 and 0 < len(sent) == len(mine["gpu2"]) - start["done_shipped"], \
        (start["done_shipped"], len(sent), len(mine["gpu2"]))
