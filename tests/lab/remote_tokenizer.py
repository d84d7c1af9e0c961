"""A model directory whose tokenizer is its own code (``--trust-remote-code``), like Kimi-K2/K2.5's.

``make_remote_tokenizer_dir(model_dir, out)`` copies the tiny model's directory (tests/lab/tiny_model.py)
and replaces its tokenizer with ``tokenization_standin.py``: a slow (Python) tokenizer over the same
byte-level BPE, shaped like Kimi's ``TikTokenTokenizer`` (a ``PreTrainedTokenizer`` subclass, its special
tokens as added tokens, ``auto_map.AutoTokenizer`` naming it, no ``tokenizer.json`` for transformers to load
instead). The same ids as the fast tokenizer on every text (tests/driver/test_tokenizer_load.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CODE = '''"""The test lab's remote-code tokenizer (a stand-in for Kimi's TikTokenTokenizer)."""
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizer


class StandinTikTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "bpe.json"}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file, **kwargs):
        self._bpe = Tokenizer.from_file(vocab_file)
        self._vocab = self._bpe.get_vocab(with_added_tokens=True)
        self._ids = {i: t for t, i in self._vocab.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return len(self._vocab)

    def get_vocab(self):
        return dict(self._vocab)

    def _tokenize(self, text, **kwargs):
        return self._bpe.encode(text, add_special_tokens=False).tokens

    def _convert_token_to_id(self, token):
        return self._vocab.get(token, self._vocab["<unk>"])

    def _convert_id_to_token(self, index):
        return self._ids.get(index, "<unk>")

    def convert_tokens_to_string(self, tokens):
        return self._bpe.decoder.decode(tokens)
'''


def make_remote_tokenizer_dir(model_dir: str | Path, out: str | Path) -> Path:
    """A copy of ``model_dir`` whose tokenizer is ``tokenization_standin.StandinTikTokenizer``."""
    src, out = Path(model_dir), Path(out)
    shutil.copytree(src, out, dirs_exist_ok=True)
    (out / "tokenizer.json").rename(out / "bpe.json")
    (out / "tokenization_standin.py").write_text(CODE)
    bpe = json.loads((out / "bpe.json").read_text())
    fast = json.loads((src / "tokenizer_config.json").read_text())
    specials = {str(t["id"]): {"content": t["content"], "lstrip": False, "normalized": False, "rstrip": False,
                               "single_word": False, "special": True} for t in bpe["added_tokens"]}
    cfg = {"tokenizer_class": "StandinTikTokenizer",
           "auto_map": {"AutoTokenizer": ["tokenization_standin.StandinTikTokenizer", None]},
           "added_tokens_decoder": specials, "model_max_length": 1 << 20,
           **{k: fast[k] for k in ("bos_token", "eos_token", "unk_token", "chat_template") if k in fast}}
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    return out
