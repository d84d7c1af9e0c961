"""hs-patch inspect on what operators point it at: a shipped run at the destination, a samples dir,
broken manifests, empty or missing paths; each outcome has its own exit code."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hs_patch.host import patch_cli
from hs_patch.host.shipping import link as ship_link, shipper
from hs_patch.samples import reader, store
from lab.ship_runs import make_samples
from lab.sample_files import flip_byte

ROOT = Path(__file__).resolve().parents[2]


def inspect(capsys, *args: str) -> tuple[int, dict]:
    code = patch_cli.main(["inspect", "--json", *args])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1]) if out else {}


@pytest.fixture
def shipped(tmp_path) -> Path:
    """A run shipped to a (local) destination: DEST/samples/*.safetensors + DEST/manifest.jsonl."""
    samples, state, dest = tmp_path / "samples", tmp_path / "state", tmp_path / "dest"
    make_samples(samples, 6, tokens=64, hidden=256)
    assert shipper.ship(shipper.ShipConfig(samples, state, ship_link.parse_dest(str(dest)))) == shipper.EXIT_OK
    return dest


def flip_a_tensor_byte(path: Path) -> None:
    flip_byte(path, -5, 0x01)  # inside the last plane's data: the size and the header stay right


def test_a_shipped_run_is_verified_deeply_in_parallel(shipped, capsys):
    code, res = inspect(capsys, "--deep", "--workers", "4", str(shipped))
    assert code == patch_cli.EXIT_OK and res["ok"] == 6 and res["clean"] and res["mode"] == "deep"
    victim = sorted((shipped / "samples").iterdir())[2]
    flip_a_tensor_byte(victim)
    code, res = inspect(capsys, "--workers", "4", str(shipped))
    assert code == patch_cli.EXIT_VERIFY and list(res["bad"]) == [victim.stem] and "sha256" in res["bad"][victim.stem]
    # --quick says what it checks, and does not claim to find this
    code, res = inspect(capsys, "--quick", str(shipped))
    assert code == patch_cli.EXIT_OK and "sizes + headers only" in res["message"]
    help_text = subprocess.run([sys.executable, "-m", "hs_patch.host.patch_cli", "inspect", "--help"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout
    assert "a flipped byte inside the tensor data is NOT found" in " ".join(help_text.split())


def test_quick_finds_what_it_claims_to(shipped, capsys):
    files = sorted((shipped / "samples").iterdir())
    with open(files[0], "r+b") as f:  # truncated
        f.truncate(files[0].stat().st_size - 10)
    data = bytearray(files[1].read_bytes())
    at = data.index(b'"key":"') + 8
    data[at] = ord("0") if data[at] != ord("0") else ord("1")  # a flipped byte in the header (the key)
    files[1].write_bytes(bytes(data))
    code, res = inspect(capsys, "--quick", str(shipped))
    assert code == patch_cli.EXIT_VERIFY and set(res["bad"]) == {files[0].stem, files[1].stem}


def test_a_manifest_line_without_key_is_reported_with_file_and_line(shipped, capsys):
    with open(shipped / store.MANIFEST, "a") as f:
        f.write(json.dumps({"op": "add", "file": "samples/x.safetensors", "bytes": 1, "sha256": "0"}) + "\n")
        f.write(json.dumps({"op": "remove"}) + "\n")
        f.write(json.dumps({"op": "add", "key": "k", "file": "samples/k.safetensors", "bytes": "1",
                            "sha256": "0"}) + "\n")
    code, res = inspect(capsys, str(shipped))
    assert code == patch_cli.EXIT_VERIFY and res["ok"] == 6
    assert res["manifest_problems"] == ["manifest.jsonl:7: an add line without a valid 'key'",
                                        "manifest.jsonl:8: a remove line without a valid 'key'",
                                        "manifest.jsonl:9: an add line without a valid 'bytes'"]


def test_empty_unlisted_and_missing_paths_have_their_own_exit_codes(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    code = patch_cli.main(["inspect", str(tmp_path / "empty")])
    assert code == patch_cli.EXIT_NOTHING and "has no manifest.jsonl" in capsys.readouterr().err
    (tmp_path / "stray").mkdir()
    (tmp_path / "stray" / "a.safetensors").write_bytes(b"x")
    assert patch_cli.main(["inspect", str(tmp_path / "stray")]) == patch_cli.EXIT_NOTHING
    for missing in (tmp_path / "nope", tmp_path / "nope.safetensors"):
        code = patch_cli.main(["inspect", str(missing)])
        assert code == patch_cli.EXIT_NOT_FOUND and "does not exist" in capsys.readouterr().err
    rep = reader.check_dir(tmp_path / "empty")
    assert rep.no_manifest and not rep.clean


def test_a_local_samples_dir_whose_samples_all_shipped_is_clean(tmp_path, capsys):
    samples, state, dest = tmp_path / "samples", tmp_path / "state", tmp_path / "dest"
    make_samples(samples, 2)
    assert shipper.ship(shipper.ShipConfig(samples, state, ship_link.parse_dest(str(dest)))) == shipper.EXIT_OK
    code, res = inspect(capsys, str(samples))
    assert code == patch_cli.EXIT_OK and res["ok"] == 0 and res["clean"]


def test_progress_goes_to_stderr_and_workers_must_be_positive(shipped, capsys):
    assert patch_cli.main(["inspect", "--progress", "--workers", "2", str(shipped)]) == patch_cli.EXIT_OK
    assert "6 ok" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        patch_cli.main(["inspect", "--workers", "0", str(shipped)])


def test_deep_finds_an_entry_that_points_at_another_samples_file(shipped, capsys):
    """A manifest line whose key names one sample and whose file, size and sha256 are another's (a
    hand-merged or hand-edited manifest): a reader by key gets the wrong tokens. --quick reported it
    (the header's key) but --deep, the default and the stronger check, called the run clean."""
    lines = (shipped / store.MANIFEST).read_text().splitlines()
    first, second = json.loads(lines[0]), json.loads(lines[1])
    lines[0] = json.dumps(dict(second, key=first["key"]))
    (shipped / store.MANIFEST).write_text("\n".join(lines) + "\n")
    for mode in ("--deep", "--quick"):
        code, res = inspect(capsys, mode, str(shipped))
        assert code == patch_cli.EXIT_VERIFY and list(res["bad"]) == [first["key"]], (mode, res)
        assert second["key"] in res["bad"][first["key"]]


def test_one_file_is_checked_against_the_manifest_that_lists_it(shipped, tmp_path, capsys):
    """``inspect FILE`` finds the entry of a shipped sample (the manifest sits above samples/), and a
    manifest line without a key beside the file is passed over (inspecting the directory reports it)
    instead of ending the command with 'KeyError: key' (exit 1)."""
    victim = sorted((shipped / "samples").iterdir())[0]
    code, res = inspect(capsys, str(victim))
    assert code == patch_cli.EXIT_OK and res["manifest_checked"] is True
    flip_a_tensor_byte(victim)
    code, res = inspect(capsys, str(victim))
    assert code == patch_cli.EXIT_VERIFY and "differs from the manifest" in res["error"]
    (shipped / store.MANIFEST).unlink()
    code, res = inspect(capsys, str(victim))  # nothing to check the bytes against: it says so
    assert code == patch_cli.EXIT_OK and res["manifest_checked"] is False and "were not checked" in res["message"]

    local = tmp_path / "local"
    make_samples(local, 2)
    with open(local / store.MANIFEST, "a") as f:
        f.write(json.dumps({"op": "add", "file": "x.safetensors", "bytes": 1, "sha256": "0"}) + "\n")
    code, res = inspect(capsys, str(sorted(local.glob("*.safetensors"))[0]))
    assert code == patch_cli.EXIT_OK and res["manifest_checked"] is True


def test_an_entry_whose_file_is_outside_the_run_is_reported(shipped, tmp_path, capsys):
    """An add line naming a file by absolute path or with '..' (a hand-merged manifest) read a file
    outside the run and called the run clean: moved or shipped, that sample is gone."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lines = (shipped / store.MANIFEST).read_text().splitlines()
    first, second = json.loads(lines[0]), json.loads(lines[1])
    for f, entry in ((elsewhere / "a.safetensors", first), (tmp_path / "b.safetensors", second)):
        (shipped / entry["file"]).rename(f)
    lines[0] = json.dumps(dict(first, file=str(elsewhere / "a.safetensors")))
    lines[1] = json.dumps(dict(second, file="../b.safetensors"))
    (shipped / store.MANIFEST).write_text("\n".join(lines) + "\n")
    code, res = inspect(capsys, str(shipped))
    assert code == patch_cli.EXIT_VERIFY and res["ok"] == 4
    assert [p.split(": ")[0] for p in res["manifest_problems"]] == ["manifest.jsonl:1", "manifest.jsonl:2"]
    assert all("without a valid 'file'" in p for p in res["manifest_problems"])


@pytest.mark.parametrize("header", [{"__metadata__": ["x"]}, ["x"], {"__metadata__": "x"}])
def test_quick_reports_a_header_that_is_not_an_object_and_goes_on(shipped, capsys, header):
    """A listed file whose safetensors header is valid JSON of the wrong shape ended --quick with
    'AttributeError: ... has no attribute get' (exit 1) and no word of the other files."""
    lines = (shipped / store.MANIFEST).read_text().splitlines()
    first = json.loads(lines[0])
    raw = json.dumps(header).encode()
    data = len(raw).to_bytes(8, "little") + raw
    (shipped / first["file"]).write_bytes(data)
    lines[0] = json.dumps(dict(first, bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))
    (shipped / store.MANIFEST).write_text("\n".join(lines) + "\n")
    for mode in ("--quick", "--deep"):
        code, res = inspect(capsys, mode, str(shipped))
        assert code == patch_cli.EXIT_VERIFY and list(res["bad"]) == [first["key"]] and res["ok"] == 5, (mode, res)


@pytest.mark.parametrize("damage", [{"hidden_size": None}, {"planes": None}, {"num_tokens": "five"}])
def test_one_file_with_damaged_metadata_is_a_bad_sample(tmp_path, capsys, damage):
    """A sample whose metadata lacks hidden_size or planes, or garbles num_tokens: 'inspect FILE' ended
    with a bare KeyError/ValueError (exit 1) and read_sample broke its promise of a SampleError."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    make_samples(tmp_path / "s", 1)
    (src,) = (tmp_path / "s").glob("*.safetensors")
    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata())
    for k, v in damage.items():
        meta.pop(k) if v is None else meta.update({k: v})
    bad = tmp_path / "bad.safetensors"
    save_file(load_file(str(src)), str(bad), metadata=meta)
    code, res = inspect(capsys, str(bad))
    assert code == patch_cli.EXIT_VERIFY and "metadata lacks or garbles" in res["error"], res
    with pytest.raises(store.SampleError):
        reader.read_sample(bad)


def test_a_bad_last_manifest_line_that_ends_in_a_newline_is_reported(shipped, capsys):
    """Only a line without its newline is torn (a writer killed mid-line; the next append cuts it). A
    last line that is not JSON but ends in a newline was written whole (a hand edit, a damaged block)
    and was passed over as torn: inspect said clean, exit 0."""
    with open(shipped / store.MANIFEST, "a") as f:
        f.write("garbage\n")
    code, res = inspect(capsys, str(shipped))
    assert code == patch_cli.EXIT_VERIFY and res["manifest_problems"] == ["manifest.jsonl:7: not JSON"]
    with open(shipped / store.MANIFEST, "a") as f:
        f.write('{"op": "add", "key": "x')  # torn: no newline after it
    code, res = inspect(capsys, str(shipped))
    assert res["manifest_problems"] == ["manifest.jsonl:7: not JSON"]
