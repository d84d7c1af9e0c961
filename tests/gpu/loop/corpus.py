"""Chats cut from Python sources that exist offline: a user turn asks for a function, the
assistant turn is the function.

Every function or method with a docstring in the given package directories becomes one chat:

    user:      Write `name` (path/to/module.py):
               ```python
               def name(args):
                   \"\"\"docstring\"\"\"
               ```
    assistant: ```python
               <the whole function>
               ```

Files are split into train and held-out by a hash of their path (never the same file in
both), the order is fixed by sorting, so the same sources give the same chats.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import textwrap
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Iterator

PACKAGES = ("torch", "transformers", "numpy", "scipy", "sklearn", "pandas", "jax", "flax", "sympy", "networkx",
            "matplotlib", "setuptools", "pip", "requests", "urllib3", "aiohttp", "pydantic", "datasets",
            "accelerate", "peft", "lightning", "pytorch_lightning", "optax", "statsmodels", "skimage", "timm",
            "torchvision", "numba", "xarray", "seaborn", "sqlalchemy", "werkzeug", "jinja2", "ansible", "fabric",
            "invoke", "paramiko", "rich", "pygments", "docutils", "_pytest", "hypothesis")


def package_roots(site_dirs: list[str], packages: tuple[str, ...] = PACKAGES) -> list[Path]:
    roots = []
    for d in site_dirs:
        for p in packages:
            if (Path(d) / p).is_dir():
                roots.append(Path(d) / p)
    return roots


def _files(roots: list[Path]) -> list[tuple[str, str]]:
    """(path relative to its site dir, absolute path), sorted, deduplicated by relative path."""
    seen: dict[str, str] = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in ("tests", "test", "__pycache__"))
            for f in sorted(filenames):
                if f.endswith(".py"):
                    full = os.path.join(dirpath, f)
                    seen.setdefault(os.path.relpath(full, root.parent), full)
    return sorted(seen.items())


def _chats_of(item: tuple[str, str], max_chars: int) -> list[dict]:
    rel, full = item
    try:
        src = Path(full).read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return []
    lines = src.splitlines()
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not ast.get_docstring(node):
            continue
        body0 = node.body[0]
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        head_end, end = body0.end_lineno, node.end_lineno
        if head_end is None or end is None or end - start > 60 or end <= head_end:
            continue  # no body beyond the docstring, or too long
        whole = textwrap.dedent("\n".join(lines[start:end]))
        header = textwrap.dedent("\n".join(lines[start:head_end]))
        if len(whole) > max_chars or not whole.strip():
            continue
        user = f"Write `{node.name}` ({rel}):\n```python\n{header}\n```"
        answer = f"```python\n{whole}\n```"
        out.append({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})
    return out


def _bucket(rel: str) -> float:
    return int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def build(roots: list[Path], *, heldout_fraction: float = 0.03, max_chars: int = 1600,
          workers: int = 8) -> tuple[list[dict], list[dict]]:
    """(train chats, held-out chats); duplicates (same answer) kept once, in the first file."""
    files = _files(roots)
    with ProcessPoolExecutor(workers) as pool:
        per_file = list(pool.map(_chats_of, files, [max_chars] * len(files), chunksize=64))
    train, held, seen = [], [], set()
    for (rel, _), chats in zip(files, per_file):
        for c in chats:
            h = hashlib.sha256(c["messages"][1]["content"].encode()).digest()
            if h in seen:
                continue
            seen.add(h)
            (held if _bucket(rel) < heldout_fraction else train).append(c)
    return train, held


def write_jsonl(path: Path, rows: Iterator[dict] | list[dict]) -> int:
    tmp = path.with_suffix(path.suffix + ".tmp")
    n = 0
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
            n += 1
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return n


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def dedupe(chats: list[dict]) -> list[dict]:
    """Each chat once (by its messages), first kept: two pipelines given the same chats then hold the same
    samples (our driver keeps one sample per token sequence, SpecForge's script every line)."""
    seen, out = set(), []
    for c in chats:
        key = json.dumps(c["messages"], sort_keys=True, ensure_ascii=False)
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def as_sharegpt(chat: dict, idx: int) -> dict:
    """The same chat in the ShareGPT shape SpecForge's prepare_hidden_states.py reads."""
    return {"id": f"chat-{idx}", "conversations": [dict(m) for m in chat["messages"]]}
