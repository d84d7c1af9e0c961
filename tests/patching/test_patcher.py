"""hs-patch apply/verify/revert/status against the real sources of every supported release."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPRESENTATIVES, SUPPORTED, UNSUPPORTED, extract_site
from hs_patch.engine.flags import REQUIRED_FLAGS
from hs_patch.engine.releases import RELEASES, TARGET, anchor_lines, apply_edits
from hs_patch.host import patch_cli as cli
from hs_patch.host.patching import hook_check, patcher
from hs_patch.host.patching.earlier import earlier_edits
from hs_patch.host.patching.nearest import region_digests

ROOT = Path(__file__).resolve().parents[2]


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_cli(*args: str, capsys) -> tuple[int, dict]:
    code = cli.main([*args, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1])


@pytest.mark.parametrize("version", SUPPORTED)
def test_each_release_record_is_its_real_file(version, release_sources):
    """The sha256, the line each anchor starts at and the digests of the regions the patch
    depends on, as releases.py records them, are those of the release's own deepseek_v2.py."""
    text = (release_sources[version] / TARGET).read_text()
    r = RELEASES[version]
    assert hashlib.sha256(text.encode()).hexdigest() == r.pristine_sha256
    assert anchor_lines(r, text) == r.anchor_lines and region_digests(text) == r.regions
    assert hashlib.sha256(apply_edits(r, text).encode()).hexdigest() == r.patched_sha256
    assert f'_hs_attach(self, config, "{version}")' in apply_edits(r, text), "the patched file names its release"


@pytest.mark.parametrize("site", SUPPORTED, indirect=True)
def test_apply_verify_idempotent_revert(site: Path, capsys, request):
    target = site / TARGET
    pristine = target.read_bytes()
    release = RELEASES[request.node.callspec.params["site"]]  # a file two releases share: the installed one
    pycache = target.parent / "__pycache__" / "deepseek_v2.cpython-311.pyc"
    pycache.parent.mkdir()
    pycache.write_bytes(b"stale")
    os.chmod(target, 0o640)

    assert run_cli("verify", "--site", str(site), capsys=capsys)[0] == cli.EXIT_VERIFY  # not yet patched
    code, res = run_cli("apply", "--site", str(site), capsys=capsys)
    assert code == 0 and res["changed"] is True and res["release"] == release.version
    assert res["files"][0]["sha256"] == release.patched_sha256 == sha(target)
    assert not pycache.exists(), "a stale .pyc of the patched module must not survive"
    assert os.stat(target).st_mode & 0o777 == 0o640
    compile(target.read_text(), str(target), "exec")
    assert run_cli("verify", "--site", str(site), capsys=capsys)[0] == 0

    before = (target.read_bytes(), os.stat(target).st_mtime_ns)
    code, res = run_cli("apply", "--site", str(site), capsys=capsys)
    assert code == 0 and res["changed"] is False and "already applied" in res["message"]
    assert (target.read_bytes(), os.stat(target).st_mtime_ns) == before

    code, res = run_cli("status", "--site", str(site), capsys=capsys)
    assert res["state"] == "patched" and res["release"] == release.version
    assert res["required_server_flags"] == REQUIRED_FLAGS[release.version]
    assert "--disable-radix-cache" in res["required_server_flags"]

    code, res = run_cli("revert", "--site", str(site), capsys=capsys)
    assert code == 0 and res["changed"] is True
    assert target.read_bytes() == pristine, "revert must restore the byte-identical original"
    assert os.stat(target).st_mode & 0o777 == 0o640
    assert not list(target.parent.glob("*.hs_patch.*")), "no backup or temp file may be left"
    code, res = run_cli("revert", "--site", str(site), capsys=capsys)
    assert code == 0 and res["changed"] is False


@pytest.mark.parametrize("site", REPRESENTATIVES, indirect=True)
def test_hand_edited_file_is_refused_untouched(site: Path, capsys):
    target = site / TARGET
    target.write_bytes(target.read_bytes().replace(b"self.layers_to_capture = []", b"self.layers_to_capture = [1]"))
    edited = target.read_bytes()
    code, res = run_cli("apply", "--site", str(site), capsys=capsys)
    assert code == cli.EXIT_REFUSED and res["changed"] is False
    assert str(target) in res["error"] and sha(target) in res["error"]
    assert "every release from 0.5.9 to 0.5.23" in res["error"] and "hs-patch status shows the nearest" in res["error"]
    assert "Nothing was written" in res["error"]
    assert target.read_bytes() == edited
    assert sorted(p.name for p in target.parent.iterdir()) == ["deepseek_v2.py", "kimi_k25.py"]
    assert run_cli("revert", "--site", str(site), capsys=capsys)[0] == cli.EXIT_REFUSED
    assert run_cli("verify", "--site", str(site), capsys=capsys)[0] == cli.EXIT_VERIFY


@pytest.mark.parametrize("site", [UNSUPPORTED], indirect=True)
def test_unknown_release_is_refused(site: Path, capsys):
    target = site / TARGET
    before = target.read_bytes()
    code, res = run_cli("apply", "--site", str(site), capsys=capsys)
    assert code == cli.EXIT_REFUSED
    assert f"SGLang {UNSUPPORTED} is installed; install a supported one (every release from 0.5.9 to 0.5.23)" \
        in res["error"]
    assert target.read_bytes() == before
    assert not list(target.parent.glob("*hs_patch*"))
    # status says which known release's file is nearest: 0.5.8's has every anchor of 0.5.9's edits
    code, res = run_cli("status", "--site", str(site), capsys=capsys)
    assert code == 0 and res["state"] == "unknown"
    assert res["nearest"]["release"] == "0.5.9" and res["nearest"]["anchors_found"] == res["nearest"]["anchors"] == 8
    assert res["nearest"]["regions"]["DeepseekV2Model.__init__"] == "differs" and not res["nearest"]["anchor_diffs"]


@pytest.mark.parametrize("site", ["0.5.23"], indirect=True)
def test_a_release_published_later_is_refused_and_status_shows_what_differs(site: Path, capsys):
    """A release after 0.5.23 (its file: 0.5.23's with the aux collector built another way,
    its dist-info saying 0.5.24) is refused unchanged; status names 0.5.23 as nearest and shows
    the changed line against the anchor it replaced, so adding it is a reviewed step."""
    target = site / TARGET
    old = "        aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))\n"
    new = "        aux_hidden_states = AuxHiddenStatePacker.for_batch(forward_batch, len(self.layers_to_capture))\n"
    target.write_text(target.read_text().replace(old, new))
    for meta in site.glob("sglang-*.dist-info/METADATA"):
        meta.write_text(meta.read_text().replace("Version: 0.5.23", "Version: 0.5.24"))
    before = target.read_bytes()
    code, res = run_cli("apply", "--site", str(site), capsys=capsys)
    assert code == cli.EXIT_REFUSED and "SGLang 0.5.24 is installed" in res["error"] and target.read_bytes() == before
    code, res = run_cli("status", "--site", str(site), capsys=capsys)
    near = res["nearest"]
    assert (near["release"], near["anchors_found"], near["anchors"]) == ("0.5.23", 6, 7)
    assert near["regions"]["DeepseekV2Model.forward"] == "differs"
    assert near["regions"]["DeepseekV2DecoderLayer.forward"] == "same"
    (diff,) = near["anchor_diffs"]
    assert diff["edit"] == 4 and f"-{old.rstrip()}" in diff["diff"] and f"+{new.rstrip()}" in diff["diff"]
    assert cli.main(["status", "--site", str(site)]) == 0
    out = capsys.readouterr().out
    assert "nearest known release: SGLang 0.5.23 (layer-boundary family): 6 of 7 patch anchors found once" in out
    assert "a reviewed step" in out


@pytest.mark.parametrize("site", ["0.5.9"], indirect=True)
def test_damaged_patch_fails_verify_and_revert_needs_no_backup(site: Path, capsys):
    target = site / TARGET
    pristine = target.read_bytes()
    assert run_cli("apply", "--site", str(site), capsys=capsys)[0] == 0
    backup = target.with_name(target.name + patcher.BACKUP_SUFFIX)
    backup.unlink()  # lost keepsake: revert rebuilds the original from the patched text
    assert run_cli("revert", "--site", str(site), capsys=capsys)[0] == 0
    assert target.read_bytes() == pristine
    assert run_cli("apply", "--site", str(site), capsys=capsys)[0] == 0
    target.write_text(target.read_text().replace("_hs.finish(hidden_states)", "pass"))
    code, res = run_cli("verify", "--site", str(site), capsys=capsys)
    assert code == cli.EXIT_VERIFY and "patched and then changed" in res["error"]


@pytest.mark.parametrize("version", REPRESENTATIVES)
def test_ast_check_rejects_a_misplaced_hook(version, release_sources):
    """verify's syntax-tree checks catch a hook in the wrong place even if it compiles."""
    release = RELEASES[version]
    text = apply_edits(release, (release_sources[version] / TARGET).read_text())
    hook_check.check_patched(text, release)
    mutations = {
        "finish after the return": text.replace(
            "        if _hs is not None:  # hs_patch: hand the pass to the writer\n"
            "            _hs.finish(hidden_states)\n", "").replace(
            "    def get_input_embeddings(self) -> nn.Embedding:",
            "    def _x(self, _hs, hidden_states):\n        _hs.finish(hidden_states)\n\n"
            "    def get_input_embeddings(self) -> nn.Embedding:", 1),
        "unguarded import": text.replace('        if _hs_os.environ.get("HS_CAPTURE", "") not in ("", "0"):\n'
                                         '            from hs_patch.server.hook import attach as _hs_attach\n',
                                         '        from hs_patch.server.hook import attach as _hs_attach\n'
                                         '        if _hs_os.environ.get("HS_CAPTURE", "") not in ("", "0"):\n'),
        "collector on another argument": text.replace("_hs.collector(i, None)", "_hs.collector(0, None)").replace(
            "else _hs.collector(  # hs_patch\n                        i,",
            "else _hs.collector(  # hs_patch\n                        0,"),
        "something else changed": text.replace("self.capture_aux_hidden_states = False",
                                               "self.capture_aux_hidden_states = True"),
        "the attention's input not handed over": text.replace(
            "captured_last_layer_outputs.hs_attn_input(hidden_states)", "pass"),
        "another tensor handed as the attention's input": text.replace(
            "captured_last_layer_outputs.hs_attn_input(hidden_states)",
            "captured_last_layer_outputs.hs_attn_input(residual)"),
    }
    for what, bad in mutations.items():
        assert bad != text, what
        with pytest.raises(hook_check.VerifyFailed):
            hook_check.check_patched(bad, release)


@pytest.mark.parametrize("site", ["0.5.16"], indirect=True)
def test_default_site_found_without_importing_sglang(site: Path):
    """Without --site, hs-patch finds sglang/ on the interpreter's path and never imports it."""
    (site / "sglang" / "__init__.py").write_text("raise ImportError('importing sglang needs a GPU')\n")
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}"}
    out = subprocess.run([sys.executable, "-m", "hs_patch.host.patch_cli", "apply", "--json"], env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["changed"] and res["site"] == str(site)
    help_text = subprocess.run([sys.executable, "-m", "hs_patch.host.patch_cli", "--help"], env=env,
                               capture_output=True, text=True).stdout
    assert "HS_CAPTURE_LAYERS" in help_text and "0.5.23" in help_text


def test_mixed_install_is_refused(release_sources, tmp_path, capsys):
    """A 0.5.16 deepseek_v2.py inside a site whose dist-info says 0.5.9."""
    site = extract_site("0.5.9", tmp_path / "site")
    (site / TARGET).write_bytes((release_sources["0.5.16"] / TARGET).read_bytes())
    code, res = run_cli("apply", "--site", str(site), capsys=capsys)
    assert code == cli.EXIT_REFUSED and "mixed install" in res["error"]
    # where the version was read (the dist-info; SGLang's version.py holds no version) and what to run
    assert "dist-info" in res["error"] and "sglang/version.py" not in res["error"]
    assert "pip install --force-reinstall --no-deps sglang==0.5.9" in res["error"]
    (site / TARGET).write_text(apply_edits(RELEASES["0.5.16"], (site / TARGET).read_text()))
    code, res = run_cli("verify", "--site", str(site), capsys=capsys)  # a patched 0.5.16 file in it
    assert code == cli.EXIT_VERIFY and "mixed install" in res["error"] and "Nothing was written" not in res["error"]


def test_missing_target_explains_site(tmp_path, capsys):
    code, res = run_cli("apply", "--site", str(tmp_path), capsys=capsys)
    assert code == cli.EXIT_REFUSED and "directory that contains sglang/" in res["error"]


def _patched_earlier(how: str, release, pristine: str) -> str:
    """The file as an earlier hs-patch patched it: 0.1.0 imported the hook from hs_patch.hook;
    before issue #25 the decoder layers did not hand the hook their attention's input."""
    if how == "hs_patch.hook":
        return apply_edits(release, pristine).replace("from hs_patch.server.hook import attach",
                                                      "from hs_patch.hook import attach").replace(
            "(see hs_patch.server.hook)", "(see hs_patch.hook)")
    for edit in earlier_edits(release):
        pristine = pristine.replace(edit.anchor, edit.replacement)
    assert "hs_attn_input" not in pristine and "hs_patch" in pristine
    return pristine


# the releases an earlier hs-patch knew: the only files it can have patched
@pytest.mark.parametrize("how", ["hs_patch.hook", "no attention input"])
@pytest.mark.parametrize("site", ["0.5.9", "0.5.16", "0.5.23"], indirect=True)
def test_a_file_patched_by_an_earlier_hs_patch_is_upgraded_by_apply(site: Path, how: str, capsys, request):
    """verify fails on such a file (its hook calls do not match the hook any more: the module is gone,
    or the hook refuses passes without the attention input), apply upgrades it to today's patch,
    revert gives the pristine file back from it too."""
    target = site / TARGET
    pristine = target.read_bytes()
    release = RELEASES[request.node.callspec.params["site"]]
    earlier = _patched_earlier(how, release, pristine.decode())
    target.write_text(earlier)
    code, res = run_cli("status", "--site", str(site), capsys=capsys)
    assert res["state"] == "outdated" and res["release"] == release.version
    assert "run hs-patch apply to upgrade" in res["message"]  # what to do, where the operator looks first
    code, res = run_cli("verify", "--site", str(site), capsys=capsys)
    assert code == cli.EXIT_VERIFY and "hs-patch apply" in res["error"]
    code, res = run_cli("apply", "--site", str(site), capsys=capsys)
    assert code == 0 and res["changed"] and sha(target) == release.patched_sha256
    assert run_cli("verify", "--site", str(site), capsys=capsys)[0] == 0
    target.write_text(earlier)
    code, res = run_cli("revert", "--site", str(site), capsys=capsys)
    assert code == 0 and target.read_bytes() == pristine


@pytest.mark.parametrize("damage", ["truncated", "not UTF-8"])
@pytest.mark.parametrize("site", ["0.5.9"], indirect=True)
def test_a_damaged_file_is_reported_by_status_and_refused_by_the_rest(site: Path, damage: str, capsys):
    """A patched file cut short (a full disk, a copy killed midway) or with bytes that are not UTF-8
    (a hand edit in another encoding) is no release's: status still reports it (the Ansible role runs
    status first) and says it is not Python; apply and revert refuse it untouched, verify fails."""
    target = site / TARGET
    assert run_cli("apply", "--site", str(site), capsys=capsys)[0] == 0
    data = target.read_bytes()
    damaged = data[: len(data) // 2] if damage == "truncated" else data + b"# caf\xe9\n"
    target.write_bytes(damaged)
    code, res = run_cli("status", "--site", str(site), capsys=capsys)
    assert code == 0 and res["state"] == "unknown" and res["nearest"]["parse_error"]
    assert cli.main(["status", "--site", str(site)]) == 0
    assert "this file is not valid Python" in capsys.readouterr().out
    for command, want in (("apply", cli.EXIT_REFUSED), ("verify", cli.EXIT_VERIFY), ("revert", cli.EXIT_REFUSED)):
        code, res = run_cli(command, "--site", str(site), capsys=capsys)
        assert code == want and "neither the pristine nor the patched" in res["error"], (command, res)
    assert target.read_bytes() == damaged


@pytest.mark.parametrize("site", ["0.5.23"], indirect=True)
def test_two_applies_at_once_both_succeed(site: Path, capsys, monkeypatch):
    """A second hs-patch apply started while one is writing (two Ansible runs, an operator beside one)
    waits for it and finds the patch applied; it used to share the temp file and fail with
    FileNotFoundError (exit 1)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    second: list[subprocess.Popen] = []
    write_all = patcher.write_all

    def slow_write(fd: int, data: bytes) -> None:
        if not second:  # the first write of the first apply: start the other one now
            second.append(subprocess.Popen([sys.executable, "-m", "hs_patch.host.patch_cli", "apply", "--json",
                                            "--site", str(site)], env=env, stdout=subprocess.PIPE, text=True))
            with pytest.raises(subprocess.TimeoutExpired):
                second[0].wait(timeout=3)  # it must wait for this one
        write_all(fd, data)

    monkeypatch.setattr(patcher, "write_all", slow_write)
    code, res = run_cli("apply", "--site", str(site), capsys=capsys)
    assert code == 0 and res["changed"]
    out, _ = second[0].communicate(timeout=60)
    assert second[0].returncode == 0 and json.loads(out)["changed"] is False
    assert sha(site / TARGET) == RELEASES["0.5.23"].patched_sha256
    assert sorted(p.name for p in (site / TARGET).parent.iterdir()) == [
        "deepseek_v2.py", "deepseek_v2.py.hs_patch.orig", "kimi_k25.py"]


@pytest.mark.parametrize("site", ["0.5.9"], indirect=True)
def test_status_says_a_patched_file_was_changed_and_how(site: Path, capsys):
    """A patched file then converted to CRLF (a copy through Windows): verify said it was patched and then
    changed, status only named the nearest release (0.5.23, 0 of 6 anchors, every region differing),
    which sends the operator to add a release. Status now says what verify says, and names the CRLF."""
    target = site / TARGET
    assert run_cli("apply", "--site", str(site), capsys=capsys)[0] == 0
    target.write_bytes(target.read_bytes().replace(b"\n", b"\r\n"))
    code, res = run_cli("status", "--site", str(site), capsys=capsys)
    assert code == 0 and res["state"] == "unknown" and len(res["hints"]) == 2
    assert "patched and then changed" in res["hints"][0] and "CRLF" in res["hints"][1]
    assert cli.main(["status", "--site", str(site)]) == 0
    assert "it was patched and then changed" in capsys.readouterr().out


@pytest.mark.parametrize("site", ["0.5.9"], indirect=True)
def test_a_directory_it_may_not_write_is_named_with_what_to_do(site: Path, capsys, monkeypatch):
    """A venv owned by another user, or on a read-only mount: the error named only a temp file
    (the backup's, ending in .tmp) and said nothing of what to do; it now names the
    directory and who may write it (or the mount), and the file is left whole."""
    target = site / TARGET
    pristine = target.read_bytes()
    for err, want in ((errno.EACCES, "run hs-patch as "), (errno.EROFS, "read-only mount")):
        def refuse(path, *a, _err=err, _open=os.open, **kw):
            if str(path).endswith(".tmp"):
                raise OSError(_err, os.strerror(_err), str(path))
            return _open(path, *a, **kw)

        monkeypatch.setattr(patcher.os, "open", refuse)
        for command in ("apply", "revert"):
            if command == "revert":  # a patched file to revert
                monkeypatch.undo()
                assert run_cli("apply", "--site", str(site), capsys=capsys)[0] == 0
                monkeypatch.setattr(patcher.os, "open", refuse)
            code, res = run_cli(command, "--site", str(site), capsys=capsys)
            assert code == cli.EXIT_ERROR and f"cannot write in {target.parent}" in res["error"], res
            assert want in res["error"] and ".tmp" not in res["error"]
        monkeypatch.undo()
        assert run_cli("revert", "--site", str(site), capsys=capsys)[0] == 0 and target.read_bytes() == pristine


def test_status_names_a_mixed_install(release_sources, tmp_path, capsys):
    """A patched 0.5.16 file in a site whose dist-info says 0.5.9: status said 'SGLang 0.5.16: patched'
    (exit 0, the 0.5.16 server flags) while apply and verify refuse it; it now says it is mixed."""
    site = extract_site("0.5.9", tmp_path / "site")
    (site / TARGET).write_text(apply_edits(RELEASES["0.5.16"], (release_sources["0.5.16"] / TARGET).read_text()))
    code, res = run_cli("status", "--site", str(site), capsys=capsys)
    assert code == 0 and res["state"] == "patched" and res["mixed_install"] is True
    assert "mixed install" in res["message"] and "0.5.9" in res["message"]
    site = extract_site("0.5.16", tmp_path / "clean")
    code, res = run_cli("status", "--site", str(site), capsys=capsys)
    assert "mixed_install" not in res and res["message"] == "SGLang 0.5.16: pristine"


def test_two_sglang_dist_infos_are_refused(tmp_path, capsys):
    """A site with the dist-info of 0.5.12 and of 0.5.12.post1 (an interrupted pip, a copy over a copy)
    was patched as whichever the directory listing gave first, silently; which release it is, is a guess."""
    site = extract_site("0.5.12", tmp_path / "site")
    extract_site("0.5.12.post1", site)
    before = (site / TARGET).read_bytes()
    for command in ("apply", "status", "verify"):
        code, res = run_cli(command, "--site", str(site), capsys=capsys)
        assert code == cli.EXIT_REFUSED and "0.5.12, 0.5.12.post1" in res["error"], (command, res)
    assert (site / TARGET).read_bytes() == before
