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

Every other directory goes through ``AutoTokenizer`` once: which class it picks there depends on the
release (the config's model type, a table of hub classes it overrides, aliases of the ``Fast``
names, which files the directory holds), so no rule of ours is the same for sure. What it picked is
remembered instead (:func:`cache_path`, one small JSON file per user), keyed by what that choice
reads: the transformers release and the backends installed beside it (:func:`packages`), the path as
given, the trust flag, the directory's file names and the bytes of ``config.json``,
``tokenizer_config.json``, ``tokenizer.json`` and its ``.py`` files. The next load of the same
directory calls that class's ``from_pretrained`` as ``AutoTokenizer`` ends (every release from 4.46
to 5.25 ends with ``cls.from_pretrained(dir, _from_auto=True)`` for a local directory), without the
auto classes' import. Only transformers' own tokenizer classes are remembered; a cache that cannot
be read is ignored and one that cannot be written is said on stderr (the load is done either way).
``tests/driver/test_tokenizer_load.py`` checks every way against ``AutoTokenizer``: the same class,
vocabulary, special tokens, chat template, rendering and token ids.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import os
import sys
import weakref
from pathlib import Path
from typing import Any, Optional

CACHE_ENV = "HS_PATCH_CACHE_DIR"  # :func:`cache_path`'s directory; else $XDG_CACHE_HOME/hs-patch, ~/.cache/hs-patch
CACHE_FORMAT = 1
CACHE_ENTRIES = 64  # the newest kept; one per model directory and release
CHOICE_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")  # what AutoTokenizer's choice reads
CHOICE_PACKAGES = ("tokenizers", "sentencepiece", "tiktoken", "protobuf", "mistral_common", "pillow")
_WAYS: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()  # how load() loaded each tokenizer


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


def cache_path() -> Path:
    """The file remembering which class ``AutoTokenizer`` picked for a directory (``$HS_PATCH_CACHE_DIR``, else the
    user's cache directory)."""
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hs-patch")
    return Path(base) / "tokenizer-classes.json"


def packages() -> dict[str, Optional[str]]:
    """The installed releases AutoTokenizer's choice depends on besides transformers' own: which backends exist
    (mistral-common with Pillow makes Mistral's directories MistralCommonBackend's; 4.x without sentencepiece or
    tokenizers picks other classes)."""
    from importlib import metadata

    found: dict[str, Optional[str]] = {}
    for name in CHOICE_PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def choice_key(model_dir: str | Path, trust_remote_code: bool, release: str) -> str:
    """A digest of what ``AutoTokenizer``'s choice of class reads for a local directory: the releases, the path
    as given, the flag, the directory's file names, the bytes of its config and tokenizer files and of its own code
    (a remote config class sets the model type)."""
    d = Path(model_dir)
    names = sorted(os.listdir(d))
    h = hashlib.sha256(json.dumps([CACHE_FORMAT, release, packages(), str(model_dir), bool(trust_remote_code),
                                   names]).encode())
    for name in (*CHOICE_FILES, *(n for n in names if n.endswith(".py"))):
        try:
            h.update(name.encode() + hashlib.sha256((d / name).read_bytes()).digest())
        except (FileNotFoundError, IsADirectoryError):
            h.update(name.encode() + b"-")
    return h.hexdigest()


def _read_cache() -> dict[str, str]:
    try:
        cached = json.loads(cache_path().read_text())
    except Exception:  # noqa: BLE001 - unreadable, not JSON, nested past the parser's depth: a cache, ignored
        return {}
    return {k: v for k, v in cached.items() if isinstance(v, str)} if isinstance(cached, dict) else {}


def _cached_class(key: str) -> Any:
    """The remembered class, if it is still one of transformers' tokenizer classes."""
    module, _, name = _read_cache().get(key, "").partition(":")
    if not module.startswith("transformers.") or not name:
        return None
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        cls = getattr(importlib.import_module(module), name)
        return cls if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase) else None
    except Exception:  # noqa: BLE001 - gone or broken in this release: AutoTokenizer's way
        return None


def _remember(key: str, cls: type) -> None:
    """Add ``key`` -> ``cls`` to the cache (the newest :data:`CACHE_ENTRIES` kept), under a lock so that drivers
    starting side by side keep each other's entries; written whole or not at all."""
    if not cls.__module__.startswith("transformers."):  # the model's own code: not ours to name
        return
    from hs_patch.samples.files import write_text_atomic

    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(path.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            cached = _read_cache()
            cached.pop(key, None)
            cached[key] = f"{cls.__module__}:{cls.__qualname__}"
            write_text_atomic(path, json.dumps(dict(list(cached.items())[-CACHE_ENTRIES:]), indent=0), fsync=True)
    except OSError as e:
        print(f"hs-extract: could not remember the tokenizer's class in {path} ({e}): the next start loads it "
              f"through AutoTokenizer again (set {CACHE_ENV} to a writable directory)", file=sys.stderr)


def way(tok: Any) -> Optional[str]:
    """How :func:`load` loaded ``tok``: ``own code``, ``remembered`` (the class AutoTokenizer picked before) or
    ``AutoTokenizer``; None for a tokenizer it did not load."""
    try:
        return _WAYS.get(tok)
    except TypeError:
        return None


def _loaded(tok: Any, how: str) -> Any:
    try:
        _WAYS[tok] = how
    except TypeError:  # an object without weak references: its way is not told
        pass
    return tok


def load(model_dir: str | Path, trust_remote_code: bool = False) -> Any:
    """``AutoTokenizer.from_pretrained(model_dir, trust_remote_code=...)``, by a short way where it is the same
    (:func:`way` says which)."""
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
            return _loaded(cls.from_pretrained(str(model_dir), trust_remote_code=True, _from_auto=True), "own code")
    import transformers

    key = choice_key(model_dir, trust_remote_code, transformers.__version__)
    cls = _cached_class(key)
    if cls is not None:
        try:
            return _loaded(cls.from_pretrained(str(model_dir), _from_auto=True), "remembered")
        except Exception:  # noqa: BLE001 - whatever it was, AutoTokenizer's own way says it or loads it
            pass
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    _remember(key, type(tok))
    return _loaded(tok, "AutoTokenizer")
