"""Reading a run back from the bucket (issue #37): ``hs-extract fetch s3://... DIR`` brings a shipped fleet run onto
local disk, each file verified against its manifest line; ``hs-patch inspect`` and ``hs-extract export`` read it
as any shipped run, and SpecForge's own reader loads the export bit for bit. Against the run's real S3 server."""

from __future__ import annotations

import uuid

import pytest
import torch

from hs_patch.host import extract_cli, patch_cli
from hs_patch.host.shipping import shipper
from hs_patch.samples import reader
from lab.sample_files import flip_byte, write_finished
from lab.ship_runs import ship_cmd

pytestmark = pytest.mark.xdist_group("s3")


def test_a_fleet_run_fetched_from_the_bucket_inspects_and_exports_bit_for_bit(tmp_path, s3_server, capsys):
    run = f"s3://hs-runs/fetch-{uuid.uuid4().hex[:8]}/r1"
    want = {}
    for n, host in enumerate(("gpu1", "gpu2")):
        samples = tmp_path / host / "samples"
        for i, length in enumerate((5, 17, 1, 40)):  # each host its own lines of the dataset
            write_finished(samples, [(11 * n + 7 * i + 3 * j + 1) % 500 for j in range(length)], seed=10 * n + i,
                           meta={"host": host})
        want.update({s.key: s for s in reader.iter_samples(samples)})
        assert shipper.main(ship_cmd(samples, tmp_path / host / "state", f"{run}/{host}",
                                     *s3_server.ship_args())) == shipper.EXIT_OK
    assert len(want) == 8
    dest = tmp_path / "here"
    fetch = ["fetch", run, str(dest), *s3_server.ship_args()]
    assert extract_cli.main(fetch) == 0
    assert "hs-fetch: done: 8 samples" in capsys.readouterr().err
    assert sorted(p.name for p in dest.iterdir()) == ["gpu1", "gpu2"]
    assert patch_cli.main(["inspect", str(dest)]) == 0  # the merged view of the parts, every file checked
    rep = reader.check_dir(dest)
    assert rep.clean and sorted(rep.ok) == sorted(want)

    # the trainers' layout from it, read back by SpecForge's own reader where installed
    sf = tmp_path / "sf"
    assert extract_cli.main(["export", "--format", "specforge", str(dest), str(sf)]) == 0
    got = sorted(p.name[: -len(".ckpt")] for p in sf.rglob("*.ckpt"))
    assert got == sorted(want)
    for key in got[:3]:
        raw = torch.load(next(sf.rglob(f"{key}.ckpt")), weights_only=True)
        assert torch.equal(raw["input_ids"], want[key].input_ids)

    # a re-run fetches nothing it holds verified; a file damaged here is fetched again
    victim = next((dest / "gpu2" / "samples").iterdir())
    flip_byte(victim, 64)
    capsys.readouterr()
    assert extract_cli.main(fetch) == 0
    assert reader.check_dir(dest).clean


def test_fetching_what_is_no_run_or_with_wrong_credentials_says_so(tmp_path, s3_server, capsys):
    assert extract_cli.main(["fetch", "s3://hs-runs/nothing-here", str(tmp_path / "d"), *s3_server.ship_args()]) == 1
    assert "not a shipped run" in capsys.readouterr().err
    wrong = s3_server.credentials_file(("hsshipper", "wrong"), name="wrong")
    assert extract_cli.main(["fetch", "s3://hs-runs/x", str(tmp_path / "d"), *s3_server.ship_args(wrong)]) == 1
    assert "does not accept these credentials" in capsys.readouterr().err
