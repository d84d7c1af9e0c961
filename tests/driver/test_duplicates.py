"""Duplicate lines are settled by the dataset's order, never by which worker finished tokenizing first."""

from __future__ import annotations

import json
import time
from pathlib import Path

from hs_patch.host.driver import chat
from hs_patch.host.driver.run import EXIT_OK, Driver
from lab.drive_runs import config
from lab.runcheck import final_samples, ledger


class SlowOn:
    """The tokenizer, slow to render the chats that hold ``marker`` (a long conversation, a busy CPU)."""

    def __init__(self, tokenizer, marker: str, seconds: float):
        self._tok, self._marker, self._seconds = tokenizer, marker, seconds

    def apply_chat_template(self, messages, *args, **kw):
        if any(self._marker in m["content"] for m in messages):
            time.sleep(self._seconds)
        return self._tok.apply_chat_template(messages, *args, **kw)

    def __call__(self, *args, **kw):
        return self._tok(*args, **kw)

    def __len__(self) -> int:
        return len(self._tok)

    def __getattr__(self, name):
        return getattr(self._tok, name)


def chat_line(user: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}


def test_the_earliest_of_two_lines_with_the_same_tokens_is_kept(standin, tiny_model_dir, tiny_tokenizer, tmp_path):
    """[chat A, chat X, {"input_ids": tokens(X)}, chat B]: line 2 is kept, line 3 is its duplicate. A pre-tokenized
    line needs no template, so it was keyed while the chat before it was still being rendered: line 3 was kept
    (its all-ones loss mask, its provenance) and line 2 called its duplicate, 5 times in 6 on 784b656."""
    x = chat_line("X: which layer is captured?", "X: the residual stream before each chosen layer.")
    x_ids = chat.encode_chat(tiny_tokenizer, x["messages"]).input_ids
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in (
        chat_line("A: hello", "A: hi there"), x, {"input_ids": x_ids}, chat_line("B: bye", "B: goodbye"))) + "\n")
    cfg = config(standin.url, standin.engine.capture.directory, tiny_model_dir, tmp_path, [data],
                 fidelity_check=False)
    summary = Driver(cfg, tokenizer=SlowOn(tiny_tokenizer, "X:", 0.5)).run()
    assert summary.exit_code == EXIT_OK and summary.status["samples"]["duplicates"] == 1
    dup = [e for e in ledger(tmp_path / "state") if e["event"] == "duplicate"]
    assert [(e["sample_id"], e["duplicate_of"]) for e in dup] == [("mixed.jsonl:3", "mixed.jsonl:2")]
    kept = final_samples(Path(tmp_path / "samples"))
    assert sorted(kept) == ["mixed.jsonl:1", "mixed.jsonl:2", "mixed.jsonl:4"]
    assert kept["mixed.jsonl:2"].metadata["input_format"] == "messages"
    assert kept["mixed.jsonl:2"].tensors["loss_mask"].tolist() == chat.encode_chat(tiny_tokenizer,
                                                                                 x["messages"]).loss_mask


def test_lines_settled_out_of_order_release_the_waiters_in_order():
    import threading

    from hs_patch.host.driver.order import InOrder

    order, stop = InOrder(), threading.Event()
    assert order.ready(0) and not order.ready(2)
    order.settle(1)
    assert not order.ready(2)
    order.settle(0)
    order.settle(0)  # again: nothing changes
    assert order.ready(2) and not order.ready(3)
    stop.set()
    assert order.wait(2, stop) and not order.wait(3, stop, poll=0.01)
