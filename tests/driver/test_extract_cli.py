"""The hs-extract command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hs_patch.host import extract_cli
from hs_patch.host.driver import cli as drive_cli

ROOT = Path(__file__).resolve().parents[2]


def test_drive_help_answers_the_questions():
    out = subprocess.run([sys.executable, "-m", "hs_patch.host.extract_cli", "drive", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    for needle in ("resume: run the same command again", "rejects.jsonl", "ledger.jsonl", "status.json",
                   "/var/lib/hs-patch/runs/NAME", "/dev/shm/hs-runs/NAME/samples", "HS_CAPTURE_DIR",
                   "(default: http://127.0.0.1:30000)", "--high-water PCT", "(default: 80.0)", "exit codes:"):
        assert needle in out, needle


def test_drive_options_map_to_the_config(tmp_path):
    a = extract_cli.build_parser().parse_args(
        ["drive", "--run", "r", "--data", "a.jsonl", "b.jsonl", "--tokenizer", "/m", "--regenerate",
         "--chat-template-kwargs", '{"thinking": false}', "--on-too-long", "truncate", "--concurrency", "3"])
    cfg = drive_cli.drive_config(a)
    assert (cfg.model, cfg.data, cfg.regenerate, cfg.on_too_long, cfg.concurrency) == (
        "/m", ["a.jsonl", "b.jsonl"], True, "truncate", 3)
    assert cfg.chat_template_kwargs == {"thinking": False}
    assert (cfg.state_dir, cfg.samples_dir) == ("/var/lib/hs-patch/runs/r", "/dev/shm/hs-runs/r/samples")
    a.chat_template_kwargs = "{nope"
    with pytest.raises(SystemExit, match="not JSON"):
        drive_cli.drive_config(a)
    a.chat_template_kwargs, a.limit = "{}", -5  # itertools.islice refused it once the run had started
    with pytest.raises(SystemExit, match="--limit must be >= 0"):
        drive_cli.drive_config(a)


def test_refused_run_exits_1_with_the_reason(tmp_path, tiny_model_dir, capsys):
    rc = extract_cli.main(["drive", "--run", "r", "--data", str(tmp_path / "missing.jsonl"), "--model",
                           str(tiny_model_dir), "--state-dir", str(tmp_path / "s"), "--samples-dir",
                           str(tmp_path / "d"), "--capture-dir", str(tmp_path / "c")])
    assert rc == 1 and "missing.jsonl does not exist" in capsys.readouterr().err


def test_a_refused_input_creates_no_directory(tmp_path, tiny_model_dir, capsys):
    dirs = {"--state-dir": tmp_path / "s", "--samples-dir": tmp_path / "d", "--capture-dir": tmp_path / "c"}
    where = [x for opt, d in dirs.items() for x in (opt, str(d))]
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    for refused, why in (
            (["--data", str(tmp_path / "missing.jsonl"), "--model", str(tiny_model_dir)], "does not exist"),
            (["--data", str(data), "--model", str(tmp_path / "no-model")], "no-model")):
        assert extract_cli.main(["drive", "--run", "r", *refused, *where]) == 1
        assert why in capsys.readouterr().err
        assert not [d for d in dirs.values() if d.exists()], "nothing is created for a run refused at the start"


def test_snapshot_reads_the_server_unit_it_is_given_never_a_guess(tmp_path):
    """--service defaulted to "sglang", a second copy of the role's sglang_service_name: on a host whose
    unit is named otherwise a snapshot without it read a unit that does not exist, and said nothing."""
    argv = [sys.executable, "-m", "hs_patch.host.extract_cli", "snapshot", "--run", "r1", "--state-dir",
            str(tmp_path / "state"), "--samples-dir", str(tmp_path / "s"), "--capture-dir", str(tmp_path / "cap")]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "the following arguments are required: --service" in r.stderr, r.stderr
    out = subprocess.run([*argv[:4], "--help"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "sglang_service_name (fab passes it)" in " ".join(out.split()), out
    r = subprocess.run([*argv, "--service", "sglang-kimi"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    snap = json.loads(r.stdout)
    assert r.returncode == 0 and snap["run"] == "r1" and snap["driver"] is None
