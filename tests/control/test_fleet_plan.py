"""The fleet plan (shards fixed at a run's first start), the fleet dashboard, Fabric's group steps."""

from __future__ import annotations

import pytest
from rich.console import Console

from hs_patch.control import fleet, fleet_dashboard, fleet_run, verdict
from lab.snapshots import progress
from hs_patch.control.inventory import ConfigError, Target
from hs_patch.control.shell import RemoteError


@pytest.fixture(autouse=True)
def plan_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HS_FLEET_DIR", str(tmp_path / "fleet"))


def test_the_first_start_fixes_the_shards_by_sorted_host_name():
    plan, notes = fleet.plan_for("r1", ["gpu-c", "gpu-a", "gpu-b"])
    assert notes == [] and plan.shards == {"gpu-a": 0, "gpu-b": 1, "gpu-c": 2} and plan.shard("gpu-c") == "2/3"
    assert (fleet.plan_path("r1").stat().st_mode & 0o777) == 0o600
    again, _ = fleet.plan_for("r1", ["gpu-b", "gpu-a", "gpu-c"])
    assert again.shards == plan.shards


def test_a_host_added_later_gets_no_shard_and_a_removed_one_keeps_its_own():
    fleet.plan_for("r2", ["a", "b", "c"])
    plan, notes = fleet.plan_for("r2", ["a", "c", "d"])
    assert plan.shards == {"a": 0, "b": 1, "c": 2}
    assert any(n.startswith("d joined the group after run r2 started: it takes no shard") for n in notes)
    assert any("b is not in the group: its shard 1/3 is not being extracted" in n and "--reassign b" in n
               for n in notes)
    plan.reassigned["b"] = "c"
    fleet.save_plan(plan)
    _, notes = fleet.plan_for("r2", ["a", "c"])
    assert notes == ["b is not in the group; its shard 1/3 runs on c"]
    rows = fleet_run.rows_for(fleet.load_plan("r2"), [Target(host="x", name=n) for n in ("a", "c")])
    assert [(r.label, r.host, r.run, r.shard) for r in rows] == [
        ("a", "a", "r2", "0/3"), ("c", "c", "r2", "2/3"), ("c (shard of b)", "c", "r2.b", "1/3")]


def test_fab_ship_of_a_fleet_host_ships_into_its_part():
    plan, _ = fleet.plan_for("r5", ["a", "b"])
    plan.reassigned["b"] = "a"
    fleet.save_plan(plan)
    a = Target(host="10.0.0.1", name="a", storage_alias="st", storage_dir="/srv/s")
    assert fleet_run.destination_of(a, "r5") == "st:/srv/s/r5/a"
    assert fleet_run.destination_of(a, "r5.b") == "st:/srv/s/r5/b"
    # a host the shard moved on from (or back from) ships what it still holds of r5.b into the shard's part too,
    # never into a stray r5.b/ that no inspect or export of r5 reads
    c = Target(host="10.0.0.3", name="c", storage_alias="st", storage_dir="/srv/s")
    assert fleet_run.destination_of(c, "r5.b") == "st:/srv/s/r5/b"
    assert fleet_run.destination_of(a, "r5.zz") is None  # not a shard of r5: a run of its own
    assert fleet_run.destination_of(a, "single") is None


def test_a_host_name_that_cannot_name_a_directory_is_refused():
    with pytest.raises(ConfigError, match="cannot name its directory at the destination"):
        fleet.plan_for("r3", ["ok", "../evil"])


def test_a_group_without_hosts_plans_nothing_and_keeps_the_run_name_free():
    """An empty group used to save a plan of no shards: every later host of that run then "joined after
    it started" and was refused, for ever."""
    with pytest.raises(ConfigError, match="the group has no hosts"):
        fleet.plan_for("r4", [])
    assert fleet.load_plan("r4") is None
    plan, notes = fleet.plan_for("r4", ["gpu1", "gpu2"])
    assert plan.shards == {"gpu1": 0, "gpu2": 1} and notes == []


def test_an_unreadable_plan_says_what_to_do(tmp_path):
    fleet.plan_dir().mkdir(parents=True)
    fleet.plan_path("r4").write_text("{")
    with pytest.raises(ConfigError, match="unreadable .* start a new run"):
        fleet.load_plan("r4")


def test_group_steps_run_on_every_host_and_name_each_failure():
    group = fleet.FleetGroup.of([Target(host="127.0.0.1", name=n, port=p) for n, p in (("h1", 1), ("h2", 2))])
    with pytest.raises(RemoteError, match=r"h1: cannot reach 127\.0\.0\.1:1.*; h2: cannot reach 127\.0\.0\.1:2"):
        group.each(lambda c, t: t.name)
    res = group.try_each(lambda c, t: t.name)
    assert set(res) == {"h1", "h2"} and all(isinstance(r, RemoteError) for r in res.values())


def test_a_login_that_fails_says_why_not_cannot_reach_or_host_key(tmp_path):
    """A key missing here read as "cannot reach"; a key that needs its passphrase and a refused login read as
    "Is the host key in known_hosts?": each now says what to fix."""
    import paramiko

    t = Target(host="10.0.0.1", name="gpu-a", user="ops", key_file=str(tmp_path / "id_gone"))
    with pytest.raises(RemoteError, match=r"the SSH key .*id_gone for 10\.0\.0\.1 is not on this machine"):
        fleet.open_connection(None, t)  # refused before any connection is tried

    class Refusing:
        def __init__(self, e):
            self.e = e

        def open(self):
            raise self.e

    key = tmp_path / "id_ed25519"
    key.write_text("k")
    t = Target(host="10.0.0.1", name="gpu-a", user="ops", key_file=str(key))
    for e, said in ((paramiko.PasswordRequiredException("private key file is encrypted"),
                     r"the SSH key .*id_ed25519 needs its passphrase: load it into ssh-agent"),
                    (paramiko.AuthenticationException("Authentication failed."),
                     r"cannot log in to ops@10\.0\.0\.1:22 \(Authentication failed\.\): check ansible_user and the key"),
                    (paramiko.SSHException("Server '10.0.0.1' not found in known_hosts"), r"Is the host key in"),
                    (OSError(113, "No route to host"), r"cannot reach 10\.0\.0\.1:22")):
        with pytest.raises(RemoteError, match=said):
            fleet.open_connection(Refusing(e), t)


def test_the_fleet_dashboard_shows_each_host_and_the_total():
    rows = [fleet_dashboard.Row("a", "a", "r", "0/3"), fleet_dashboard.Row("b", "b", "r", "1/3"),
            fleet_dashboard.Row("c (shard of x)", "c", "r.x", "2/3")]
    rates = fleet_dashboard.Rates()
    snaps = {"a": progress("r", 10, 40), "b": progress("r", 5, 30, paused=True),
             "c (shard of x)": fleet_dashboard.Unreachable(25, RemoteError("gone"), progress("r.x", 3, 30))}
    fleet_dashboard.render(rows, snaps, "t", rates, now=100.0)
    snaps["a"] = progress("r", 20, 40)
    console = Console(width=200, record=True)
    console.print(fleet_dashboard.render(rows, snaps, "t", rates, now=110.0))
    out = console.export_text()
    assert "20/40" in out and "5/30" in out and "25/70" in out  # per host and total
    assert "PAUSED" in out and "unreachable 25s" in out and "(3/30)" in out and "c: gone" not in out
    assert "c (shard of x): no answer for 25 s (gone)" in out
    assert "0:00:20" in out  # a: 10 samples in 10 s, 20 to go
    assert not verdict.ended(snaps["a"]) and verdict.ended(progress("r", 40, 40, "finished"))


def test_a_group_without_a_job_in_the_run_is_refused_not_reported_complete():
    """fab status --hosts G for a group none of whose hosts is in the run's plan printed 'complete: every line is
    held (0 samples ...)' and exited 0."""
    plan = fleet.Plan("f6", {"gpu-a": 0, "gpu-b": 1})
    inv = type("Inv", (), {"group": lambda self, g: [Target(host="10.0.0.9", name="gpu-z")]})()
    with pytest.raises(ConfigError, match=r"no host of staging has a job in run f6 .*the plan's hosts: gpu-a, gpu-b"):
        fleet_run.group_rows(inv, plan, "staging")
    inv_ab = type("Inv", (), {"group": lambda self, g: [Target(host="10.0.0.1", name="gpu-a")],
                              "host_names": lambda self: ["gpu-a", "gpu-b"]})()
    assert [r.label for r in fleet_run.group_rows(inv_ab, plan, "gpus")] == ["gpu-a"]


def test_a_shard_reassigned_to_a_host_since_dropped_from_the_inventory_says_where_it_runs():
    """Its row kept the dropped host, and fab status/stop/ship --hosts failed on 'host gpu-c is not in inventory'
    without a word of the shard or how to move it."""
    plan = fleet.Plan("f7", {"gpu-a": 0, "gpu-b": 1}, reassigned={"gpu-b": "gpu-c"})
    inv = type("Inv", (), {"group": lambda self, g: [Target(host="10.0.0.1", name="gpu-a")],
                           "host_names": lambda self: ["gpu-a", "gpu-b"]})()
    with pytest.raises(ConfigError, match=r"gpu-b's shard of run f7 runs on gpu-c, which is not in the inventory now "
                                          r".*fab extract --reassign gpu-b --host OTHER --run f7"):
        fleet_run.group_rows(inv, plan, "gpus")


def test_one_host_failing_its_preflight_or_start_hides_neither_the_others_findings_nor_their_started_jobs(
        monkeypatch, capsys):
    """run_jobs raised at the first host that failed: an unreachable host's preflight hid another's failed check,
    and a failed start hid that the other hosts' units had started (no 'started' line, no way to watch them)."""
    from hs_patch.control import extraction
    from hs_patch.control.extraction import Job
    from hs_patch.control.host_checks import Check

    targets = [Target(host="10.0.0.1", name="gpu-a"), Target(host="10.0.0.2", name="gpu-b")]
    jobs = {t.name: Job("f1", "d.jsonl", False, []) for t in targets}
    outcome: dict = {}

    class Group:
        def try_each(self, fn):
            out = {}
            for t in targets:
                try:
                    out[t.name] = fn(None, t)
                except Exception as e:  # noqa: BLE001 - as Fabric's GroupResult holds it
                    out[t.name] = e
            return out

    def preflight(c, t, job):
        if outcome[t.name] == "unreachable":
            raise RemoteError(f"cannot reach {t.host}:22: timed out")
        return [Check("patch", outcome[t.name] != "bad patch", "not applied", "run the playbook")]

    def start(c, t, job, timeout, say):
        if outcome[t.name] == "start fails":
            raise RemoteError("the server was not healthy after 3600s")
        return ["hs-drive-f1", "hs-ship-f1"]

    monkeypatch.setattr(fleet_run.FleetGroup, "of", classmethod(lambda cls, ts: Group()))
    monkeypatch.setattr(extraction, "preflight", preflight)
    monkeypatch.setattr(extraction, "start", start)
    said: list[str] = []
    outcome.update({"gpu-a": "bad patch", "gpu-b": "unreachable"})
    with pytest.raises(SystemExit, match="preflight failed on gpu-a, gpu-b; nothing was started"):
        fleet_run.run_jobs(targets, jobs, 60, said.append)
    out = capsys.readouterr().out
    assert "FAIL patch" in out and "gpu-b: no preflight: cannot reach 10.0.0.2:22" in out, out
    outcome.update({"gpu-a": "ok", "gpu-b": "start fails"})
    with pytest.raises(RemoteError, match="the start failed on gpu-b; the jobs started on the other hosts go on"):
        fleet_run.run_jobs(targets, jobs, 60, said.append)
    assert "gpu-a: started hs-drive-f1, hs-ship-f1" in said and \
        "gpu-b: NOT started: the server was not healthy after 3600s" in said, said
