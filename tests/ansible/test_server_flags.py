"""The server flags the sglang_service role renders per release exist in that release's own sources.

A flag a release does not know stops the server at start (argparse exits 2), on the real host only:
the molecule scenarios render the unit for a few releases, this test renders the role's per-release
expressions for every supported one and looks the flag up in the release's server arguments.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import SUPPORTED

ROOT = Path(__file__).resolve().parents[2]
VARS = ROOT / "roles/sglang_service/vars/main.yml"
# 0.5.20 split the arguments into dataclass fields; their flags are "--" + the field name with - for _.
SERVER_ARGS = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/fields/exec_.py")


def _render(var: str, version: str) -> str:
    """The role's variable as Ansible renders it for sglang_service_sglang_version=version."""
    from ansible.parsing.dataloader import DataLoader
    from ansible.template import Templar, trust_as_template

    expr = yaml.safe_load(VARS.read_text())[var]
    return Templar(loader=DataLoader(), variables={"sglang_service_sglang_version": version}).template(
        trust_as_template(expr))


def _own_flags(site: Path) -> str:
    return "".join(p.read_text() for p in (site / a for a in SERVER_ARGS) if p.is_file())


@pytest.mark.slow
@pytest.mark.parametrize("version", SUPPORTED)
def test_the_decode_graph_limit_flag_is_the_releases_own_and_not_a_deprecated_alias(version, release_sources):
    flag = _render("sglang_service_cuda_graph_max_bs_flag", version)
    src = _own_flags(release_sources[version])
    field = flag.removeprefix("--").replace("-", "_")
    declared = f'"{flag}",' in src or f"    {field}: " in src
    assert declared, f"SGLang {version} has no {flag}: the unit would not start"
    # the newer name where the release has it (0.5.14 on): the old one is a deprecated alias, then gone
    has_decode = '"--cuda-graph-max-bs-decode",' in src or "    cuda_graph_max_bs_decode: " in src
    assert (flag == "--cuda-graph-max-bs-decode") == has_decode, (version, flag)



# How each release logs its arguments at start (SGLang's engine.py), and that line as it prints it with a key
LOGGED = {'logger.info(f"{server_args=}")': "server_args=ServerArgs(model_path='/models/K', api_key='k3y', port=1)",
          'logger.info(f"server_args={server_args.resolved_dict()}")':
              "server_args={'model_path': '/models/K', 'api_key': 'k3y', 'port': 1}",
          'logger.info(f"server_args={_server_args_for_logging(server_args)}")':
              "server_args={'model_path': '/models/K', 'api_key': 'k3y', 'port': 1}"}


@pytest.mark.slow
@pytest.mark.parametrize("version", SUPPORTED)
def test_every_release_logs_its_api_key_at_start_and_the_unit_filters_that_line(version, release_sources):
    """Why the unit has LogFilterPatterns=: each release's engine logs every server argument at start, the API key
    among them (a dataclass repr to 0.5.18, a dict from 0.5.19: neither redacts it), and the pattern drops both
    forms of that line. A release that logs them another way fails here (docs/security.md)."""
    import re

    site = release_sources[version]
    engine = (site / "sglang/srt/entrypoints/engine.py").read_text()
    forms = [line for code, line in LOGGED.items() if code in engine]
    assert forms, f"SGLang {version} logs its server arguments in a form this test does not know"
    serving = site / "sglang/srt/arg_groups/fields/serving.py"  # 0.5.20 on: the field's definition
    assert "    api_key: " in _own_flags(site) + (serving.read_text() if serving.is_file() else "")
    if "_server_args_for_logging" in engine:  # 0.5.22 on: it redacts the watermark's secrets, not the API key
        body = engine.split("def _server_args_for_logging", 1)[1].split("\ndef ", 1)[0]
        assert "api_key" not in body, body
    unit = (ROOT / "roles/sglang_service/templates/sglang.service.j2").read_text()
    pattern = re.search(r"^LogFilterPatterns=~(.+)$", unit, re.M).group(1)
    for line in forms:
        assert re.search(pattern, line), (pattern, line)
    for kept in ("api_key_file=/var/lib/sglang/api-key", "the server's API key is set"):
        assert not re.search(pattern, kept), kept
