"""A fleet end to end on real SSH test hosts: three GPU hosts (stand-in servers), one storage host.

``fab extract --hosts`` runs one dataset over the three, one shard each, preflight on all
first, in the foreground in a terminal, with ``fab status --hosts`` in another; one host is
cut off mid-run (its network link down: to fab and to storage it is dead). Both screens show
it unreachable within the poll deadline while the other rows go on, each compared with the
host's own status, and both end (exit 3, naming it) once the rest is done and it stayed
silent. ``fab extract --reassign`` gives its shard to a host still running its own: queued
behind it. At the end, at storage: every sample of the dataset exactly once over the run's
parts, each part holding only its shard, verified, with the host and shard of each; the
reassigned driver redid nothing that had reached storage; the dead host, back, says that
another host shipped its samples; ``fab stop --hosts`` and ``fab ship --hosts`` reach every
job; the host back takes its shard back (``--reassign gpu2 --host gpu2``), redoing nothing. Then a run with a line that can never be extracted, on one host and on the fleet:
exit 1, its last line counting it, the line before naming it.
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

from lab.demo import Demo
from lab.pty_screen import Screen
from lab.runcheck import write_chats

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("lab-203.0.113"),  # its test hosts' network: one lab on it at a time, one worker
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("systemd-nspawn"),
                       reason="test hosts need root and systemd-nspawn (scripts/install-deps.sh)"),
]

ROOT = Path(__file__).resolve().parents[2]
GPUS = (("gpu1", "203.0.113.40"), ("gpu2", "203.0.113.41"), ("gpu3", "203.0.113.42"))
STORE = ("storage", "203.0.113.43")
RUN = "fleet"
DEAD_AFTER = 40        # --dead-after of the foreground commands here (default 120)
POLL_DEADLINE = 20     # hs_patch.control.poll.POLL_DEADLINE_S


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


def run_starts(d: Demo, host: str) -> list[dict]:
    out = d.ssh(host, f"cat /var/lib/hs-patch/runs/{RUN}/ledger.jsonl").stdout
    return [e for e in map(json.loads, out.splitlines()) if e["event"] == "run_start"]


def wait(what: str, predicate, timeout: float = 300, every: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def env(plan_dir: Path) -> dict[str, str]:
    return {**os.environ, "HS_FLEET_DIR": str(plan_dir), "PYTHONPATH": str(ROOT)}


def screen(d: Demo, plan_dir: Path, *args: str) -> Screen:
    """fab in a terminal of its own (the live dashboard as the operator sees it)."""
    cmd = ["fab", *args, "--inventory", str(d.inventory), "--known-hosts", d.lab.describe()["known_hosts"]]
    print("+ (pty) " + " ".join(cmd), flush=True)
    return Screen(cmd, cwd=str(ROOT), env=env(plan_dir))


def done_of(d: Demo, host: str, run: str) -> int:
    return ((status(d, host, run).get("samples") or {}).get("done")) or 0


def on_disk_status(d: Demo, host: str, run: str) -> dict:
    """A host's run status read on its root filesystem here (its link may be down)."""
    hdir = next(h["dir"] for h in d.lab.load()["hosts"] if h["name"] == host)
    p = Path(hdir) / "merged" / "var/lib/hs-patch/runs" / run / "status.json"
    return json.loads(p.read_text()) if p.exists() else {}


def shown_done(cells: list[str] | None) -> int | None:
    """The done count of a dashboard row (None unless the host was read)."""
    if not cells or len(cells) < 5 or cells[2].startswith(("unreachable", "reading", "error")):
        return None
    return int(cells[4].split("/")[0])


def test_three_hosts_one_dataset_a_host_dies_its_shard_is_reassigned(lab, tmp_path):
    from hs_patch import shard
    from hs_patch.samples import reader, store

    data = tmp_path / "chats.jsonl"
    expected = set(write_chats(data, 300, words=24))
    plans = tmp_path / "plans"
    extract = screen(lab, plans, "extract", "--hosts", "--dataset", str(data), "--run", RUN, "--interval", "1",
                     "--dead-after", str(DEAD_AFTER))
    live = None
    try:
        wait("the drivers to start", lambda: all(unit_state(lab, g, f"hs-drive-{RUN}") == "active" for g, _ in GPUS),
             timeout=600, every=2)
        out = extract.text()
        for g, _ in GPUS:  # preflight on every host before any starts
            assert f"{g} (run {RUN}, shard" in out and out.index(f"{g} (run") < out.index("starting the server units")
        plan = json.loads((plans / f"{RUN}.json").read_text())
        assert plan["shards"] == {"gpu1": 0, "gpu2": 1, "gpu3": 2}
        live = screen(lab, plans, "status", "--hosts", "--run", RUN, "--interval", "1", "--dead-after", str(DEAD_AFTER))
        mine = {g: {s for s in expected if shard.parse(f"{i}/3").owns(s)} for i, (g, _) in enumerate(GPUS)}

        # gpu2 dies mid-run: some of its samples shipped, the rest not
        def shipped_some() -> bool:
            st = status(lab, "gpu2", RUN)
            assert st.get("state") not in ("stopped", "failed"), f"gpu2's driver ended: {st.get('message')}"
            # and both screens have drawn its count once (a cut before that leaves them nothing to keep)
            return (st.get("shipping") or {}).get("shipped", 0) >= 10 and all(
                shown_done(sc.row("gpu2")) is not None for sc in (extract, live))

        wait("gpu2 to ship some samples, shown on both screens", shipped_some, every=0.5)
        link(lab, "gpu2", up=False)
        cut = time.monotonic()

        # the other rows go on: each shows what its host's own status said, fresh (read after the
        # cut, at most what the host says now), on both screens, while gpu2 does not answer
        for _ in range(3):
            for g in ("gpu1", "gpu3"):
                before, t = done_of(lab, g, RUN), time.monotonic()
                time.sleep(5)
                for sc in (extract, live):
                    shown = shown_done(sc.row(g, since=t + 3))
                    assert shown is not None and before <= shown <= done_of(lab, g, RUN), (g, before, shown)
        for sc in (extract, live):  # gpu2: unreachable on the screen within the read deadline of the cut
            seen = sc.first("gpu2", lambda cells: cells[2].startswith("unreachable"), since=cut)
            assert seen is not None, sc.row("gpu2")
            at, cells = seen
            assert at - cut <= POLL_DEADLINE + 6, f"gpu2 shown unreachable {at - cut:.0f} s after its link went down"
            print(f"gpu2 shown unreachable {at - cut:.1f} s after the cut: {cells}", flush=True)
            last = int(cells[4].strip("()").split("/")[0])   # its last known count, not more than it did
            assert last <= ((on_disk_status(lab, "gpu2", RUN).get("samples") or {}).get("done") or 0)

        # gpu1 still runs its own shard (one server, one capture dir, one driver at a time): gpu2's
        # shard is queued behind it
        own_running = unit_state(lab, "gpu1", f"hs-drive-{RUN}") == "active"
        moved = f"{RUN}.gpu2"
        out = fab(lab, plans, "extract", "--reassign", "gpu2", "--host", "gpu1", "--dataset", str(data), "--run", RUN,
                  "--detach").stdout
        if own_running and unit_state(lab, "gpu1", f"hs-drive-{RUN}") == "active":
            assert f"queued behind hs-drive-{RUN}" in out, out
            assert status(lab, "gpu1", moved)["state"] == "queued"
        assert json.loads((plans / f"{RUN}.json").read_text())["reassigned"] == {"gpu2": "gpu1"}

        # both foreground commands end once gpu1 and gpu3 are done and gpu2 stayed silent: exit 3
        for sc in (extract, live):
            assert sc.wait(900) == 3, sc.last_lines(8)
            *_, dead, verdict = sc.last_lines(2)
            assert dead.startswith("gpu2: no answer for ") and "last seen" in dead and "of its shard 1/3" in dead, dead
            assert verdict == ("unreachable: gpu2: their shards are not being extracted; when a host is back: fab "
                               f"status --hosts gpu_hosts --run {RUN}; to finish a shard on a host that is done: fab "
                               f"extract --reassign HOST --host OTHER --run {RUN} --dataset DATASET (HOST: gpu2)"), verdict
        for g in ("gpu1", "gpu3"):
            assert status(lab, g, RUN)["state"] == "finished"
        st = fab(lab, plans, "status", "--hosts", "--run", RUN, "--once").stdout
        assert "gpu1 (shard of gpu2)" in st and "gpu3" in st, st
        # the fleet as it is now: the reassigned shard runs to its end, then every line is held
        after = screen(lab, plans, "status", "--hosts", "--run", RUN, "--interval", "1")
        try:
            assert after.wait(900) == 0, after.last_lines(8)
            assert after.last_lines(1) == [f"complete: every line is held ({len(expected)} samples, shipped and "
                                           "verified at the destination)"], after.last_lines(3)
        finally:
            after.close()
        assert status(lab, "gpu1", moved)["state"] == "finished"
    finally:
        extract.close()
        if live is not None:
            live.close()

    # gpu2 comes back: its shipper brings what it extracted meanwhile; the destination keeps gpu1's
    # copies, and the words say so
    link(lab, "gpu2", up=True)
    wait("gpu2's shipper to meet gpu1's copies", lambda: "shipped by host gpu1 of run fleet.gpu2" in lab.ssh(
        "gpu2", f"journalctl -u hs-ship-{RUN} --no-pager", check=False).stdout, timeout=300, every=5)
    r = fab(lab, plans, "stop", "--hosts", "--run", RUN)
    for label in ("gpu1", "gpu2", "gpu3", "gpu1 (shard of gpu2)"):
        assert f"[fab] {label}: hs-drive-" in r.stdout, r.stdout
    assert unit_state(lab, "gpu2", f"hs-ship-{RUN}") == "inactive"
    r = fab(lab, plans, "ship", "--hosts", "--run", RUN)
    assert "[fab] every job's samples are at the destination, verified" in r.stdout, r.stdout

    # at storage: every sample once, each part only its shard, all verified, each saying where it was made
    dest = tmp_path / "dest"
    lab.rsync(f"{lab.addr(STORE[0])}:/srv/hs-samples/{RUN}/", f"{dest}/")
    assert sorted(p.name for p in dest.iterdir()) == ["gpu1", "gpu2", "gpu3"]
    ids: dict[str, str] = {}
    for i, (g, _) in enumerate(GPUS):
        entries = store.read_manifest(dest / g).values()
        part = {e["sample_id"] for e in entries}
        assert part <= mine[g], f"{g}/ holds samples of another shard: {sorted(part - mine[g])[:5]}"
        for sid in part:
            assert sid not in ids, f"{sid} in {ids[sid]}/ and {g}/"
            ids[sid] = g
        where = {(e["host"], e["shard"], e["run"]) for e in entries}
        assert where <= ({(g, f"{i}/3", RUN)} | ({("gpu1", "1/3", moved)} if g == "gpu2" else set())), where
    assert {e["host"] for e in store.read_manifest(dest / "gpu2").values()} == {"gpu1", "gpu2"}
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

    # gpu2 takes its shard back (its driver of it on gpu1 has ended): the plan no longer moves it, gpu2 runs it
    # as its own run again, and what storage holds counts as done; then the resume fab names works
    # (--reassign gpu2 --host gpu2 was refused with 'fab extract --host gpu2', which refused gpu2 as reassigned)
    starts = len(run_starts(lab, "gpu2"))
    out = fab(lab, plans, "extract", "--reassign", "gpu2", "--host", "gpu2", "--dataset", str(data), "--run", RUN,
              "--detach").stdout
    assert "the shard of gpu2 was given to gpu1, whose driver of it is not running (inactive)" in out, out
    assert f"gpu2 takes its shard 1/3 back as run {RUN}" in out, out
    assert json.loads((plans / f"{RUN}.json").read_text())["reassigned"] == {}
    wait("gpu2's driver to end", lambda: len(run_starts(lab, "gpu2")) > starts
         and unit_state(lab, "gpu2", f"hs-drive-{RUN}") == "inactive", every=2)
    assert status(lab, "gpu2", RUN)["state"] == "finished"
    again = run_starts(lab, "gpu2")[-1]
    assert again["done_shipped"] == len(mine["gpu2"]), (again, len(mine["gpu2"]))  # nothing to redo
    fab(lab, plans, "extract", "--host", "gpu2", "--dataset", str(data), "--run", RUN, "--detach")
    st = fab(lab, plans, "status", "--hosts", "--run", RUN, "--once", check=False).stdout
    assert "gpu2" in st and "shard of gpu2" not in st, st


def test_a_run_with_a_line_that_cannot_be_extracted_exits_1_naming_it(lab, tmp_path):
    """One line's id is over the 16 KiB of provenance a sample carries: it fails on every run. fab
    said 'finished' and exited 0 for such a run; one host or the fleet, it must exit 1 and say so."""
    data = tmp_path / "small.jsonl"
    write_chats(data, 12, words=8)
    lines = data.read_text().splitlines()
    lines[4] = json.dumps({**json.loads(lines[4]), "id": "x" * 20000})
    data.write_text("\n".join(lines) + "\n")
    plans = tmp_path / "plans"
    why = ("small.jsonl:5 failed at intent: cannot write the sample's intent into /dev/shm/hs_capture: provenance "
           "metadata over 16384 bytes: shorten the record's id or source; it can never be extracted as it is")
    verdict = ("incomplete: 1 of 12 line(s) not held (1 failed); running it again will not extract them: change those "
               "lines (missing.jsonl says why)")
    r = fab(lab, plans, "extract", "--host", "gpu3", "--dataset", str(data), "--run", "one", "--interval", "1",
            check=False)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    assert r.stdout.rstrip().splitlines()[-2:] == [f"gpu3: {why}", verdict], r.stdout[-2000:]
    r = fab(lab, plans, "extract", "--hosts", "--dataset", str(data), "--run", "two", "--interval", "1", check=False)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-2000:]
    *_, named, last = r.stdout.rstrip().splitlines()
    assert last == verdict and named.endswith(f": {why}") and named.split(":")[0] in ("gpu1", "gpu2", "gpu3"), \
        r.stdout[-2000:]
