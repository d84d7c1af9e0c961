"""The test lab's own promises that other tests lean on (tests/lab/)."""

from __future__ import annotations

import time

import pytest

from lab.standin_engine import Engine
from lab.standin_requests import Request


def test_a_standin_whose_scheduler_dies_fails_its_requests_at_once(tiny_model_dir, tmp_path, monkeypatch):
    """A bug in the stand-in's scheduler loop must not leave every request waiting out submit's
    timeout (600 s each, a test hung for minutes): SGLang's server dies with its scheduler."""
    def broken_pass(self, parts, finished):
        raise ValueError("a bug in the pass")

    monkeypatch.setattr(Engine, "_pass", broken_pass)
    engine = Engine(str(tiny_model_dir), str(tmp_path / "capture"))
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="a bug in the pass"):
            engine.submit(Request("r1", list(range(1, 9)), max_new_tokens=1), timeout=60)
        assert time.monotonic() - t0 < 30
        with pytest.raises(RuntimeError, match="the scheduler ended: ValueError: a bug in the pass"):
            engine.submit(Request("r2", list(range(1, 9)), max_new_tokens=1), timeout=60)
    finally:
        engine.close()
