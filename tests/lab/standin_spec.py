"""EAGLE-3 speculative decoding as the stand-in server reports it (no draft model runs on CPU).

SGLang's EAGLE-3 with topk 1 drafts a chain of ``num_draft_tokens - 1`` tokens per verification
pass and keeps the longest prefix the target agrees with, plus one token of its own (the bonus),
so greedy output is unchanged and each pass emits 1..num_draft_tokens tokens. The stand-in
decodes greedily as before and replays that chain over the greedy output with a drafter that
proposes the right token with probability ``standin_draft_accuracy`` (from the draft directory's
``config.json``, default 0.7; seeded by the prompt, so a run is repeatable). What it reports is
SGLang 0.5.16's shape (tokenizer_manager._calculate_spec_decoding_metrics): ``spec_verify_ct``,
``spec_accept_length`` = completion_tokens / spec_verify_ct, ``spec_num_correct_drafts``,
``spec_num_proposed_drafts``, ``spec_accept_rate`` and the per-request histogram of correct drafts per
verification pass, ``spec_correct_drafts_histogram`` with its alias ``spec_accept_histogram`` (index k: the
passes that accepted k drafts; the bonus token not counted); /server_info (and /get_server_info) carries
the ``speculative_*`` settings.

``standin_flip_at`` (draft config) makes the speculative server emit the second most likely token
at that output position, a stand-in for a near-tie that batch-dependent rounding flipped (a real
difference from the plain server's greedy output, for the greedy check to find).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class Speculative:
    draft_path: str
    num_steps: int = 3
    eagle_topk: int = 1
    num_draft_tokens: int = 4
    accuracy: float = 0.7
    flip_at: Optional[int] = None

    @classmethod
    def from_args(cls, algorithm: Optional[str], draft_path: Optional[str], num_steps: Optional[int],
                  topk: Optional[int], draft_tokens: Optional[int]) -> Optional["Speculative"]:
        if not algorithm:
            return None
        if algorithm.upper() not in ("EAGLE3", "EAGLE"):
            raise SystemExit(f"stand-in: --speculative-algorithm {algorithm}: only EAGLE3 is emulated")
        if not draft_path or not (Path(draft_path) / "config.json").is_file():
            raise SystemExit(f"stand-in: --speculative-draft-model-path {draft_path!r} has no config.json")
        cfg = json.loads((Path(draft_path) / "config.json").read_text())
        steps = num_steps or 3
        return cls(str(draft_path), steps, topk or 1, draft_tokens or steps + 1,
                   float(cfg.get("standin_draft_accuracy", 0.7)), cfg.get("standin_flip_at"))

    def info(self) -> dict[str, Any]:
        return {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": self.draft_path,
                "speculative_num_steps": self.num_steps, "speculative_eagle_topk": self.eagle_topk,
                "speculative_num_draft_tokens": self.num_draft_tokens}

    def meta(self, prompt: list[int], out_ids: list[int]) -> dict[str, Any]:
        """The verification passes over ``out_ids`` (the first token came from the prefill pass)."""
        rng = random.Random(hash(tuple(prompt)) & 0xFFFFFFFF)
        chain = self.num_draft_tokens - 1
        verify = correct = 0
        hist: list[int] = []
        i = 1
        while i < len(out_ids):
            verify += 1
            accepted = 0
            while accepted < chain and i + accepted < len(out_ids) - 1 and rng.random() < self.accuracy:
                accepted += 1
            correct += accepted
            hist += [0] * (accepted + 1 - len(hist))
            hist[accepted] += 1
            i += accepted + 1
        if not verify:
            return {}
        proposed = verify * chain
        return {"spec_verify_ct": verify, "spec_accept_length": len(out_ids) / verify,
                "spec_num_correct_drafts": correct, "spec_num_proposed_drafts": proposed,
                "spec_accept_rate": correct / proposed if proposed else 0.0,
                "spec_correct_drafts_histogram": hist, "spec_accept_histogram": hist}
