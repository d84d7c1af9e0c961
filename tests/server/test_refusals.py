"""Settings that would lose samples are refused at startup, each naming what to change, from one
rule table (hs_patch.engine.flags) shared by the hook, `hs-patch check-args` (the role) and fab's preflight."""

from __future__ import annotations

import shutil
import types

import pytest

from conftest import SUPPORTED
from hs_patch.engine import flags
from hs_patch.host import patch_cli
from hs_patch.server import checks, config, hook

OK = {"tp_rank": 0, "tp_size": 8, "pp_size": 1, "radix_cache": False, "prefill_graph": "disabled",
      "moe_a2a_backend": "none", "chunked_prefill_size": 8192, "watchdog_timeout": 300.0}


@pytest.mark.parametrize("bad, flag", [
    ({"deterministic": True}, "--enable-deterministic-inference"),
    ({"pdmux": True}, "--enable-pdmux"),
    ({"attn_dp_size": 2}, "--attn-dp-size"),
    ({"dwdp_size": 8}, "--dwdp-size"),
    ({"attn_cp_size": 2}, "--attn-cp-size"),
    ({"dp_attention": True}, "--enable-dp-attention"),
    ({"pp_size": 2}, "--pp-size"),
    ({"moe_a2a_backend": "deepep"}, "--moe-a2a-backend"),
])
def test_each_unsupported_setting_is_refused_naming_its_flag(bad, flag):
    assert checks.refusals(OK) == []
    (msg,) = checks.refusals({**OK, **bad})
    assert msg.startswith(flag)


def test_settings_are_read_as_the_release_resolved_them():
    """0.5.23 keeps --attn-dp-size on the record while the deprecated enable_dp_attention stays
    false; its resolved_dict says attention DP is on. Reading the raw field passed it."""
    class Args023:
        enable_dp_attention = False
        attn_dp_size = 1  # raw record, before resolution

        def resolved_dict(self):
            return {"enable_dp_attention": True, "attn_dp_size": 4, "dwdp_size": 1}

    get = checks._getter(Args023())
    assert get("attn_dp_size") == 4 and get("enable_dp_attention") is True
    get = checks._getter(types.SimpleNamespace(attn_dp_size=2))  # 0.5.9/0.5.16: resolved in place
    assert get("attn_dp_size") == 2 and get("missing", 7) == 7


def cfg(**kw) -> config.CaptureConfig:
    return config.CaptureConfig(enabled=True, **kw)


@pytest.mark.parametrize("capture, settings, words", [
    (cfg(rank=8), {}, "HS_CAPTURE_RANK=8"),
    (cfg(), {"chunked_prefill_size": -1}, "--chunked-prefill-size N"),
    (cfg(), {"chunked_prefill_size": None}, "--chunked-prefill-size N"),
    (cfg(slot_tokens=4096), {}, "HS_CAPTURE_SLOT_TOKENS=4096"),
    (cfg(stall_seconds=300.0), {}, "--watchdog-timeout"),
    (cfg(stall_seconds=100.0), {"watchdog_timeout": 60.0}, "--watchdog-timeout 60"),
])
def test_capture_settings_the_server_cannot_honour_are_refused(capture, settings, words):
    assert checks.capture_refusals(cfg(), OK) == []
    (msg,) = checks.capture_refusals(capture, {**OK, **settings})
    assert words in msg


@pytest.mark.parametrize("env, words", [
    ({"HS_CAPTURE_STALL_SECONDS": "nan"}, "finite"), ({"HS_CAPTURE_STALL_SECONDS": "inf"}, "finite"),
    ({"HS_CAPTURE_SLOT_TOKENS": "0"}, ">= 1"),
])
def test_capture_variables_that_disable_a_guard_are_refused(env, words):
    with pytest.raises(config.ConfigError, match=words):
        config.from_env(env)


def test_attach_derives_the_staging_size_from_the_chunked_prefill_size(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("HS_CAPTURE", "1")
    monkeypatch.setenv("HS_CAPTURE_DIR", str(tmp_path / "dump"))
    monkeypatch.setenv("HS_CAPTURE_LAYERS", "1")
    monkeypatch.setattr(checks, "read_settings", lambda: {**OK, "tp_size": 1, "chunked_prefill_size": 512})
    h = hook.attach(None, tiny_model.config, "0.5.16")
    assert h.cfg.slot_tokens == 512 and h._free.qsize() == h.cfg.slots
    h.close()
    monkeypatch.setattr(checks, "read_settings", lambda: {**OK, "deterministic": True, "tp_size": 1})
    with pytest.raises(RuntimeError, match="--enable-deterministic-inference"):
        hook.attach(None, tiny_model.config, "0.5.16")


def test_one_writing_server_per_capture_dir(tmp_path):
    c = cfg(directory=str(tmp_path), layers=(0,), final="none", slot_tokens=8)
    first = hook.CaptureHook(c, hidden_size=16, metadata={})
    with pytest.raises(RuntimeError, match="give each server its own HS_CAPTURE_DIR"):
        hook.CaptureHook(c, hidden_size=16, metadata={})
    first.close()
    hook.CaptureHook(c, hidden_size=16, metadata={}).close()  # free again once the first let go


def test_a_hook_closes_once_so_the_exit_handler_writes_nothing_after_a_tests_close(tmp_path, caplog):
    c = cfg(directory=str(tmp_path / "dump"), layers=(0,), final="none", slot_tokens=8)
    h = hook.CaptureHook(c, hidden_size=16, metadata={})
    h.close()
    shutil.rmtree(tmp_path / "dump")  # as pytest removes a passing test's tmp_path before the exit handler runs
    with caplog.at_level("WARNING", logger="hs_patch"):
        h.close()
    assert not (tmp_path / "dump").exists() and "cannot write" not in caplog.text


def test_a_command_line_is_checked_against_the_same_rules():
    args = ["--model-path", "/m", "--tp-size", "8", "--disable-radix-cache", "--disable-prefill-cuda-graph"]
    assert flags.args_violations(args, "0.5.16") == []
    assert flags.args_violations(args + ["--attn-dp-size=1"], "0.5.23") == []
    got = flags.args_violations(["--model-path", "/m", "--enable-mixed-chunk", "--pp-size", "2",
                                 "--moe-a2a-backend", "deepep"], "0.5.9")
    assert [g.split(":")[0] for g in got] == ["--pp-size", "--enable-mixed-chunk",
                                              "--moe-a2a-backend", "--disable-radix-cache"]


def test_hs_patch_check_args_exits_2_with_the_reasons(capsys):
    code = patch_cli.main(["check-args", "--release", "0.5.23", "--json", "--", "--enable-pdmux",
                           "--disable-radix-cache", "--disable-prefill-cuda-graph"])
    out = capsys.readouterr().out
    assert code == patch_cli.EXIT_REFUSED and "--enable-pdmux" in out
    assert patch_cli.main(["check-args", "--release", "0.5.9", "--", "--disable-radix-cache"]) == 0


def test_staging_memory_is_on_the_host_even_inside_a_device_context(tmp_path):
    """SGLang builds the model inside `with torch.device("cuda")`: the slots must still be host memory."""
    import torch

    with torch.device("meta"):
        h = hook.CaptureHook(cfg(directory=str(tmp_path), layers=(0,), final="pre", slot_tokens=8),
                             hidden_size=16, metadata={})
    slot = h._free.get()
    assert slot.ids.device.type == "cpu" and all(r.device.type == "cpu" for r in slot._raw)
    h._free.put(slot)
    h.close()


SERVER_ARGS = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/fields/exec_.py")


@pytest.mark.slow
@pytest.mark.parametrize("version", SUPPORTED)
def test_the_flags_each_release_needs_follow_its_own_server_args(version, release_sources):
    """A prefill CUDA graph replays without the hook: where the release turns one on by default,
    its flag to turn it off is required (read from the release's own server arguments)."""
    fields = "".join(p.read_text() for p in (release_sources[version] / a for a in SERVER_ARGS) if p.is_file())
    piecewise_on = "    disable_piecewise_cuda_graph: bool = False\n" in fields      # 0.5.10 .. 0.5.13.post1
    prefill_phase = "    disable_prefill_cuda_graph: A[" in fields                    # cuda_graph_config, 0.5.14 on
    opt_in = "    enable_piecewise_cuda_graph: bool = False\n" in fields             # 0.5.9: off unless asked
    assert piecewise_on + prefill_phase + opt_in == 1
    assert flags.REQUIRED_FLAGS[version] == ["--disable-radix-cache"] + (
        ["--disable-piecewise-cuda-graph"] if piecewise_on else ["--disable-prefill-cuda-graph"] if prefill_phase else [])


def test_every_table_of_releases_names_the_same_releases():
    """The server's flags (flags.py) and EAGLE-3 rules (serving.py) are kept apart from releases.py
    (the server never imports it): they must name exactly the releases the patch knows, in order."""
    from hs_patch.engine import serving
    from hs_patch.engine.releases import RELEASES

    assert list(flags.REQUIRED_FLAGS) == list(RELEASES) == list(serving.SERVING_RULES)


def test_hs_patch_check_args_refuses_a_release_it_has_no_rules_for(capsys, tmp_path):
    """--release 0.5.24 (a later release) or 0.5.1 (a typo) said 'server arguments compatible with
    capture' (exit 0) without even asking for --disable-radix-cache, as did an installed file that
    is no release's: the flags each release needs are known only for the supported ones."""
    for release in ("0.5.24", "0.5.1"):
        code = patch_cli.main(["check-args", "--release", release, "--", "--model-path", "/m"])
        assert code == patch_cli.EXIT_REFUSED and "not a supported release" in capsys.readouterr().err
    models = tmp_path / "sglang" / "srt" / "models"
    models.mkdir(parents=True)
    (models / "deepseek_v2.py").write_text("# not SGLang's\n")
    code = patch_cli.main(["check-args", "--site", str(tmp_path), "--", "--model-path", "/m"])
    assert code == patch_cli.EXIT_REFUSED and "give --release" in capsys.readouterr().err
