"""The served model's tokenizer, loaded as ``AutoTokenizer`` would load it, and without its import where that is sure.

``transformers``' auto classes import its generation utilities, and with them ``torch._dynamo``
and scikit-learn (transformers 5.12.1, SGLang 0.5.16's pin: about 6 s on the H100 host, most of
``hs-extract drive``'s start-up; issue #36). A model whose tokenizer is its own code
(``auto_map.AutoTokenizer`` in ``tokenizer_config.json``: Kimi-K2/K2.5's tiktoken tokenizer) run with
``--trust-remote-code`` needs none of that: for such a directory ``AutoTokenizer.from_pretrained`` (every
release from 4.46 to 5.25 read the same) loads the class the entry names, the fast one when both are
named, with ``get_class_from_dynamic_module``, registers it for the auto class and returns
``cls.from_pretrained(dir, trust_remote_code=True)``. :func:`load` does exactly those steps itself
when ``tokenizer_class`` names that class (or nothing); a config naming another class (5.x registers
that class's aliases first), another repository's code, or code that fails to import go through
``AutoTokenizer``.

Every other directory goes through ``AutoTokenizer``: which class it picks there depends on the
release (the config's model type, a table of hub classes it overrides, aliases of the ``Fast``
names), so no shorter path is the same for sure. ``tests/driver/test_tokenizer_load.py`` checks both
ways against ``AutoTokenizer``: the same class, vocabulary, special tokens, chat template, rendering
and token ids.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional


def remote_class_ref(model_dir: str | Path) -> Optional[str]:
    """The tokenizer class ``AutoTokenizer`` takes from the directory's own code (``module.Class``), or None."""
    try:
        cfg = json.loads((Path(model_dir) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    auto_map = cfg.get("auto_map") if isinstance(cfg, dict) else None
    if isinstance(auto_map, dict):
        auto_map = auto_map.get("AutoTokenizer")
    if not isinstance(auto_map, (list, tuple)) or len(auto_map) != 2:
        return None
    slow, fast = auto_map
    ref = fast if fast is not None else slow  # AutoTokenizer's choice with use_fast (its default; always in 5.x)
    if not isinstance(ref, str) or "--" in ref:  # another repository's code: AutoTokenizer's way
        return None
    named = cfg.get("tokenizer_class")
    # a tokenizer_class naming something else (a transformers class the remote code builds on) makes 5.x register
    # that class's aliases before it loads the code: AutoTokenizer's way
    return ref if named in (None, ref.rsplit(".", 1)[-1], ref.rsplit(".", 1)[-1].removesuffix("Fast")) else None


def load(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained(model_dir, trust_remote_code=...)``, by the short way where it is the same."""
    ref = remote_class_ref(model_dir) if trust_remote_code else None
    if ref is not None:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        try:
            cls = get_class_from_dynamic_module(ref, str(model_dir))
        except ImportError:
            cls = None  # code that needs what AutoTokenizer registers first: its own way, below
        if cls is not None:
            # what cls.register_for_auto_class() sets (it only checks the name against transformers.models.auto,
            # whose import is the cost this module avoids; the attribute is used by save_pretrained alone)
            cls._auto_class = "AutoTokenizer"
            return cls.from_pretrained(str(model_dir), trust_remote_code=True, _from_auto=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
