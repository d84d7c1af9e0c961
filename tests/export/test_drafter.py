"""Drafter serving ids: our rules per release equal what each release's real code does."""

from __future__ import annotations

import ast
import json
import types
from pathlib import Path

import pytest

from conftest import SUPPORTED
from hs_patch.engine import serving
from hs_patch.host.extract_cli import main
from lab.sample_files import write_run

TARGET = "sglang/srt/models/deepseek_v2.py"
KIMI = "sglang/srt/models/kimi_k25.py"
GRAPH_RUNNER = "sglang/srt/model_executor/cuda_graph_runner.py"


def real_setter(site: Path):
    """``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture`` compiled from the release's own source."""
    tree = ast.parse((site / TARGET).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DeepseekV2ForCausalLM")
    fn = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "set_eagle3_layers_to_capture")
    fn.decorator_list, fn.returns = [], None
    for a in fn.args.args:
        a.annotation = None
    ns: dict = {}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), "<real>", "exec"), ns)
    return ns["set_eagle3_layers_to_capture"]


def run_real(setter, ids, n: int) -> list[int]:
    me = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace(),
                               config=types.SimpleNamespace(num_hidden_layers=n))
    setter(me, ids)
    return list(me.model.layers_to_capture)


@pytest.mark.slow
@pytest.mark.parametrize("version", SUPPORTED)
def test_rules_equal_the_releases_own_code(release_sources, version):
    setter = real_setter(release_sources[version])
    for ids in (None, [1, 29, 57], [2, 30, 58], [0, 5], [1], [3, 31, 59], [1, 2, 3]):
        assert serving.layers_to_capture(version, ids, 61) == run_real(setter, ids, 61), (version, ids)
    # the ids we hand out make the real code capture exactly our planes
    for planes in ([2, 30, 58], [3, 31, 59], [5, 10]):
        try:
            ids = serving.eagle_ids(version, planes, 61, cuda_graph=False)
        except serving.NotServable:
            assert serving.rule(version).plus_one != "always"
            continue
        assert run_real(setter, ids, 61) == planes
    kimi = ast.parse((release_sources[version] / KIMI).read_text())
    wrapper = next(n for n in kimi.body if isinstance(n, ast.ClassDef) and n.name == serving.KIMI_K25)
    has = any(isinstance(f, ast.FunctionDef) and f.name == "set_eagle3_layers_to_capture" for f in wrapper.body)
    assert has == serving.rule(version).serves_kimi_k25
    # through 0.5.10.post1 the CUDA-graph runner sets the DEFAULT layers before it captures its graphs
    runner = release_sources[version] / GRAPH_RUNNER
    resets = runner.is_file() and ".set_eagle3_layers_to_capture()" in runner.read_text()
    assert resets == serving.rule(version).graphs_use_default


def test_the_default_capture_is_served_on_every_release_with_one_config():
    for release in serving.SERVING_RULES:
        assert serving.eagle_ids(release, [2, 30, 58], 61) == [1, 29, 57]
    with pytest.raises(serving.NotServable, match="Kimi-K2.5"):
        serving.eagle_ids("0.5.9", [2, 30, 58], 61, "KimiK25ForConditionalGeneration")
    assert serving.eagle_ids("0.5.16", [2, 30, 58], 61, "KimiK25ForConditionalGeneration") == [1, 29, 57]
    with pytest.raises(serving.NotServable, match="CUDA-graph"):
        serving.eagle_ids("0.5.9", [3, 31, 59], 61)
    assert serving.eagle_ids("0.5.9", [3, 31, 59], 61, cuda_graph=False) == [2, 30, 58]
    assert serving.eagle_ids("0.5.23", [3, 31, 59], 61) == [3, 31, 59]
    with pytest.raises(serving.NotServable, match="layer.1 cannot lead"):
        serving.eagle_ids("0.5.16", [1, 30, 58], 61)
    with pytest.raises(serving.NotServable, match="not been read"):
        serving.eagle_ids("0.5.8", [2, 30, 58], 61)
    assert serving.eagle_ids("0.5.10", [2, 30, 58], 61, "KimiK25ForConditionalGeneration") == [1, 29, 57]
    assert serving.eagle_ids("0.5.12.post1", [3, 31, 59], 61) == [2, 30, 58]   # always +1
    assert serving.eagle_ids("0.5.13", [3, 31, 59], 61) == [3, 31, 59]        # +1 only for a list led by 1
    with pytest.raises(serving.NotServable, match="CUDA-graph"):
        serving.eagle_ids("0.5.10.post1", [3, 31, 59], 61)
    assert serving.eagle_ids("0.5.11", [3, 31, 59], 61) == [2, 30, 58]


def test_cli_writes_the_block_into_a_drafter_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 7168}))
    assert main(["drafter-config", "--serve-release", "0.5.23", "--layers", "2,30,58", "--num-layers", "61",
                 "--into", str(cfg)]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "eagle_config": {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}
    written = json.loads(cfg.read_text())
    assert written["hidden_size"] == 7168 and written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert main(["drafter-config", "--serve-release", "0.5.9", "--layers", "2,30,58", "--num-layers", "61",
                 "--architecture", "KimiK25ForConditionalGeneration"]) == 2
    assert "cannot serve an EAGLE-3 drafter on Kimi-K2.5" in capsys.readouterr().err



def test_cli_refuses_bad_layers_and_configs_with_what_to_give(tmp_path, capsys):
    for layers in ("", "a,b", ","):
        assert main(["drafter-config", "--serve-release", "0.5.23", "--layers", layers, "--num-layers", "61"]) == 1
        assert "comma-separated layer numbers" in capsys.readouterr().err, layers
    for text in ("[1]", '{"eagle_config": "x"}'):
        cfg = tmp_path / "config.json"
        cfg.write_text(text)
        assert main(["drafter-config", "--serve-release", "0.5.23", "--layers", "2,30,58", "--num-layers", "61",
                     "--into", str(cfg)]) == 1
        assert "is not a drafter config.json" in capsys.readouterr().err and cfg.read_text() == text


def test_cli_reads_the_layers_of_an_export_and_of_samples(tmp_path, capsys):
    from hs_patch.host.export.run import export
    from hs_patch.host.export.spec import ExportSpec

    kimi = tmp_path / "kimi"   # what export and drafter-config read of a model dir: its config.json
    kimi.mkdir()
    (kimi / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"], "text_config": {
        "num_hidden_layers": 61, "hidden_size": 32, "vocab_size": 512}}))
    src = tmp_path / "run"
    write_run(src, 2, shipped=True)                       # layers 2, 30, 58
    s = export(src, tmp_path / "sf", ExportSpec("specforge", model=str(kimi)))
    table = s.info["serving"]["releases"]                 # recorded in export.json
    assert "cannot serve an EAGLE-3 drafter on Kimi-K2.5" in table["0.5.9"]["refused"]
    assert all(table[r] == {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]} for r in ("0.5.14", "0.5.16", "0.5.23"))
    assert json.loads((tmp_path / "sf" / "export.json").read_text())["serving"]["releases"] == table
    assert main(["drafter-config", "--serve-release", "0.5.23", "--export", str(tmp_path / "sf")]) == 0
    assert json.loads(capsys.readouterr().out)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]
    assert main(["drafter-config", "--serve-release", "0.5.9", "--export", str(tmp_path / "sf")]) == 2
    assert main(["drafter-config", "--serve-release", "0.5.16", "--samples", str(src), "--num-layers", "61"]) == 0
    assert json.loads(capsys.readouterr().out)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]


def test_readme_step_6_runs_as_written(tmp_path, capsys):
    """README's export and drafter-config commands with its placeholders filled in: drafter-config was shown
    as `hs-extract drafter-config --into DRAFTER/config.json`, which exits 2 (--serve-release and the
    layers' source missing)."""
    import re
    import shlex

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    step = readme[readme.index("6. **Train and measure.**"):readme.index("## Supported SGLang releases")]
    commands = [" ".join(c.split()) for c in re.findall(r"`(hs-extract (?:export|drafter-config) [^`]+)`", step)]
    assert [c.split()[1] for c in commands] == ["export", "drafter-config"], commands
    write_run(tmp_path / "run", 2, shipped=True)
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    (tmp_path / "kimi").mkdir()
    (tmp_path / "kimi" / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {"num_hidden_layers": 61, "hidden_size": 32, "vocab_size": 512}}))
    fill = {"RUN": "run", "DST": "dst", "DRAFTER": "drafter", "MODEL": "kimi"}
    for command in commands:
        argv = [re.sub(r"\b(RUN|DST|DRAFTER|MODEL)\b", lambda m: str(tmp_path / fill[m.group(1)]), a)
                for a in shlex.split(command)]
        assert main(argv[1:]) == 0, (command, capsys.readouterr().err)
    eagle = json.loads((tmp_path / "drafter" / "config.json").read_text())["eagle_config"]
    assert eagle == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 29, 57]}  # layers 2, 30, 58


def test_cli_reads_the_layers_of_samples_whose_first_is_damaged(tmp_path, capsys):
    """The lowest key's file missing: the layers come from the next sample (hs-patch inspect reports the damage)."""
    from hs_patch.samples import store

    src = tmp_path / "run"
    write_run(src, 3, shipped=True)                       # layers 2, 30, 58
    entries = store.read_manifest(src)
    (src / entries[min(entries)]["file"]).unlink()
    assert main(["drafter-config", "--serve-release", "0.5.16", "--samples", str(src), "--num-layers", "61"]) == 0
    assert json.loads(capsys.readouterr().out)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 29, 57]


def test_hs_patch_status_prints_the_serving_ids(release_sources, capsys, monkeypatch):
    from hs_patch.host.patch_cli import main as patch_main

    monkeypatch.setenv("HS_CAPTURE_LAYERS", "2,30,58")
    assert patch_main(["status", "--site", str(release_sources["0.5.16"])]) == 0
    assert "eagle_aux_hidden_state_layer_ids [1, 29, 57] feed layers [2, 30, 58]" in capsys.readouterr().out
    assert patch_main(["status", "--site", str(release_sources["0.5.16"]), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["serving"] == {"release": "0.5.16", "eagle_aux_hidden_state_layer_ids": [1, 29, 57],
                             "checked_with_model": False}
