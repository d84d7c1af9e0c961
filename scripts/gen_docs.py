#!/usr/bin/env python3
"""Write the settings tables in docs/ from where each setting is defined, so they cannot drift.

Each setting is described once, where it is defined:

- inventory knobs (``hs_*``): the comment above each one in ``inventory/group_vars/gpu_hosts.yml``
- role variables: ``description`` and ``default`` in ``roles/<role>/meta/argument_specs.yml``
  (what ``ansible-doc`` and the role's argument validation show); ``roles/<role>/defaults/main.yml``
  is written from them too (each default under its description)
- capture environment variables: ``ENV_DOCS`` in ``hs_patch/server/config.py``
- supported SGLang releases: ``hs_patch/engine/releases.py`` (family, stack, anchors; the families' edits in
  ``hs_patch/engine/families.py``), ``hs_patch/engine/flags.py`` (server flags) and ``hs_patch/engine/serving.py``
  (EAGLE-3 ids)

A docs file marks each generated table with ``<!-- generated: NAME -->`` ...
``<!-- end generated -->``; NAME is ``knobs``, ``role:<role>``, ``capture-env``, ``releases`` (README.md)
or ``release-details`` (docs/capture.md).

    python3 scripts/gen_docs.py          # rewrite the tables
    python3 scripts/gen_docs.py --check  # exit 1 if a table differs from the code (the tests run this)
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w:-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)


def _fmt_default(value: Any) -> str:
    if value == "":
        return '""'
    if isinstance(value, dict) and len(json.dumps(value)) > 200:  # a table of its own: the row would drown
        return f"{{{len(value)} entries: {', '.join(list(value)[:2])}, ..., {list(value)[-1]}}}"
    return (value if isinstance(value, str) else json.dumps(value)).replace("|", "\\|")


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def knobs() -> list[tuple[str, Any, str]]:
    """(name, default, description) of every knob, the description being the comment above it."""
    path = ROOT / "inventory/group_vars/gpu_hosts.yml"
    values = yaml.safe_load(path.read_text())
    out, comment = [], []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            text = line[1:].strip()
            comment = [] if text.startswith("---") else comment + [text]
        elif m := re.match(r"^(hs_\w+):", line):
            out.append((m.group(1), values[m.group(1)], " ".join(comment)))
            comment = []
        elif not line.strip():
            comment = [] if not comment or comment[-1] else comment
    return out


def _specs(role: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "roles" / role / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]


def role_variables(role: str) -> list[tuple[str, Any, str]]:
    out = []
    for name, spec in _specs(role)["options"].items():
        desc = spec.get("description", "")
        out.append((name, spec.get("default"), " ".join(desc) if isinstance(desc, list) else desc))
    return out


def role_defaults(role: str) -> str:
    """``defaults/main.yml`` of ``role``: every option's default under its description."""
    import textwrap

    lines = ["---", f"# {role}: {_specs(role)['short_description']}",
             "# Written by scripts/gen_docs.py from meta/argument_specs.yml (edit the descriptions and",
             "# defaults there); docs/deployment.md shows the same table.", ""]
    for name, default, desc in role_variables(role):
        lines += ["# " + line for line in textwrap.wrap(" ".join(desc.split()), 100)]
        flow = f"{name}: {json.dumps(default)}"
        if len(flow) > 120 and isinstance(default, list):  # a block list keeps yamllint's line length
            lines += [f"{name}:", *(f"  - {json.dumps(item)}" for item in default), ""]
        else:
            lines += [flow, ""]
    return "\n".join(lines[:-1]) + "\n"


def roles() -> list[str]:
    return sorted(p.parent.parent.name for p in (ROOT / "roles").glob("*/meta/argument_specs.yml"))


def capture_env() -> list[tuple[str, Any, str]]:
    sys.path.insert(0, str(ROOT))
    from hs_patch.server.config import ENV_DOCS

    return list(ENV_DOCS)


def releases(details: bool) -> str:
    """One row per supported SGLang release, from the code that patches, checks and serves it."""
    sys.path.insert(0, str(ROOT))
    from hs_patch.engine import flags, serving
    from hs_patch.engine.releases import DEFAULT_RELEASE, RELEASES

    first = {}
    for v, r in RELEASES.items():
        first.setdefault(r.pristine_sha256, v)
    if details:
        lines = ["| release | family | deepseek_v2.py sha256 | anchor lines | EAGLE-3 ids (set_eagle3_layers_to_capture) |"
                 " request ids | flags capture needs |", "|---|---|---|---|---|---|---|"]
    else:
        lines = ["| release | torch / CUDA | where the capture sits | notes |", "|---|---|---|---|"]
    for v, r in RELEASES.items():
        s = serving.SERVING_RULES[v]
        if details:
            ids = ("+1 always" if s.plus_one == "always" else "+1 when the list starts with 1") + (
                "; CUDA graphs feed the default layers" if s.graphs_use_default else "") + (
                "" if s.serves_kimi_k25 else "; none on Kimi-K2.5")
            lines.append(f"| {v} | {r.family.name} | `{r.pristine_sha256[:16]}` | {', '.join(map(str, r.anchor_lines))} "
                         f"| {ids} | {'no' if v == '0.5.9' else 'yes'} | {' '.join(flags.REQUIRED_FLAGS[v])} |")
            continue
        notes = (["default pin"] if v == DEFAULT_RELEASE else []) + (
            [f"same file as {first[r.pristine_sha256]}"] if first[r.pristine_sha256] != v else []) + (
            [f"{o} over torch's pin" for o in r.pip_overrides]) + ([f"{x} for SGLang's pin" for x in r.replaces]) + (
            [] if s.serves_kimi_k25 else ["no EAGLE-3 serving on Kimi-K2.5"])
        lines.append(f"| {v} | {r.torch} / {r.cuda} | {r.family.name} | {'; '.join(notes)} |")
    return "\n".join(lines) + "\n"


def table(name: str) -> str:
    if name in ("releases", "release-details"):
        return releases(name == "release-details")
    if name == "knobs":
        rows, head = knobs(), "| Knob | Default | Meaning |"
    elif name.startswith("role:"):
        rows, head = role_variables(name[5:]), "| Variable | Default | Meaning |"
    elif name == "capture-env":
        rows, head = capture_env(), "| Variable | Default | Meaning |"
    else:
        raise SystemExit(f"gen_docs: unknown generated table {name!r}")
    lines = [head, "|---|---|---|"]
    lines += [f"| `{n}` | `{_fmt_default(d)}` | {_cell(desc)} |" for n, d, desc in rows]
    return "\n".join(lines) + "\n"


def render(text: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + table(m.group("name")) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only report tables that differ from the code")
    a = ap.parse_args(argv)
    stale = []
    outputs = [(p, render) for p in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]]
    outputs += [(ROOT / "roles" / r / "defaults/main.yml", lambda _t, r=r: role_defaults(r)) for r in roles()]
    for path, make in outputs:
        text = path.read_text()
        new = make(text)
        if new != text:
            stale.append(str(path.relative_to(ROOT)))
            if not a.check:
                path.write_text(new)
    if a.check and stale:
        print(f"gen_docs: out of date: {', '.join(stale)}; run python3 scripts/gen_docs.py", file=sys.stderr)
        return 1
    print(f"gen_docs: {'updated ' + ', '.join(stale) if stale and not a.check else 'all tables current'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
