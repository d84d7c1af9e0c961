"""Assertions shared by the driver tests: a run's output is complete, exact and clean."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from hs_patch.samples import reader, store


def final_samples(samples_dir: Path) -> dict[str, reader.Sample]:
    """sample_id -> final sample, checking that no sample id is stored twice."""
    out: dict[str, reader.Sample] = {}
    for s in reader.iter_samples(samples_dir):
        sid = s.metadata["sample_id"]
        assert sid not in out, f"{sid} stored twice ({out[sid].path.name}, {s.path.name})"
        out[sid] = s
    return out


def assert_complete(samples_dir: Path, capture_dir: Path, expected: Iterable[str]) -> dict[str, reader.Sample]:
    """0 lost, 0 duplicated, 0 truncated: exactly the expected sample ids, each verified
    (size + sha256 + tensors), with a loss mask; no file outside the manifest; nothing of
    the run left in the capture dir."""
    rep = reader.check_dir(samples_dir, deep=True)
    assert rep.clean, f"bad={rep.bad} missing={rep.missing} unlisted={rep.unlisted}"
    got = final_samples(samples_dir)
    expected = set(expected)
    assert set(got) == expected, f"lost {sorted(expected - set(got))[:5]}, unexpected {sorted(set(got) - expected)[:5]}"
    for sid, s in got.items():
        n = int(s.metadata["num_tokens"])
        assert s.tensors["loss_mask"].shape == (n,) and int(s.tensors["loss_mask"].sum()) > 0, sid
        assert s.metadata["source"] + ":" + s.metadata["line"] == sid
    assert not list(samples_dir.glob(f"{store.TMPDIR}/*")), "temporary files left in the samples dir"
    assert store.read_manifest(capture_dir) == {}, "raw samples left in the capture dir"
    return got


def ledger(state_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (state_dir / "ledger.jsonl").read_text().splitlines() if x.strip()]


def write_chats(path: Path, n: int, *, words: int = 30) -> list[str]:
    """A dataset of n distinct two-turn chats; returns their sample ids."""
    vocab = "the quick brown fox jumps over lazy dog hidden states drafter target model tokens".split()
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            text = " ".join(vocab[(i * 7 + k * 3) % len(vocab)] for k in range(words))
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Question {i}: {text}?"},
                                             {"role": "assistant", "content": f"Answer {i}: {text[::-1]}"}]}) + "\n")
    return [f"{path.name}:{i + 1}" for i in range(n)]
