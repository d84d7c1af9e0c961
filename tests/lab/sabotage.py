"""Capture made wrong on purpose, each way issue #25 lists, to show the production check rejects it.

Never part of the product. :func:`install` wraps the real capture hook's collectors so that a
request whose id is ``sab-<case>-...`` is captured wrong in that one way, as a capture bug would
make it; other requests, even in the same pass, are untouched, and neither what each layer's
attention read nor what the model returns is ever changed (only the copy the hook is handed).
Used by the CPU tests (``tests/server/test_fingerprints.py``, the simulated forward) and by the
GPU proof's ``sabotage`` phase (``tests/gpu/sabotage.py``: the real server, where
``tests/gpu/sabotage_site/sitecustomize.py`` installs it in SGLang's scheduler process).

- ``wrong_layer``: ``layer.1`` holds the input of layer 2 (needs layers 1 and 2 captured);
- ``partial``: ``layer.2`` misses half of layer 1's update: what one of two tensor-parallel
  ranks holds before the all-reduce completes it (needs layers 1 and 2);
- ``zeros``: ``layer.3`` is zeros;
- ``pre_zeros``: ``final.pre_norm`` is zeros while ``final.post_norm`` is right;
- ``other_rows``: a prompt's first part holds another prompt's rows in every plane and in the
  LM head's input: the first request of the last clean pass (send that one just before);
- ``post_is_pre``: ``final.post_norm`` holds the pre-norm state;
- ``staging``: the rows reach the file reversed after they were captured (between the GPU and
  the writer: a staging-buffer copy gone wrong);
- ``shift``: ``final.post_norm`` one row late (caught before #25 too).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

CASES = ("wrong_layer", "partial", "zeros", "pre_zeros", "other_rows", "post_is_pre", "staging", "shift")


def rid(case: str, n: int = 0) -> str:
    """The request id that asks for ``case``."""
    return f"sab-{case}-{n}"


def case_of_rid(name: str) -> Optional[str]:
    """The case a request id asks for (``sab-<case>-...``), or None."""
    return name.split("-")[1] if name.startswith("sab-") else None


def install(case_of: Callable[[str], Optional[str]] = case_of_rid) -> Callable[[], None]:
    """Wrap the hook's collectors and the writer's intake; returns the function that undoes it.
    ``case_of`` says which case a request (by its id) gets, None for none."""
    import torch

    from hs_patch.server import passes, writer

    def _targets(p: Any) -> list[tuple[str, int, int, bool]]:
        """(case, first row, end row, the prompt's first part) of each sabotaged request of the pass."""
        out, offset = [], 0
        for j, n in enumerate(p.seq_lens):
            case = case_of(str((p.rids or [""] * len(p.seq_lens))[j] or ""))
            if case is not None:
                out.append((case, offset, offset + int(n), int(p.prefix_lens[j]) == 0))
            offset += int(n)
        return out

    real_put, real_finish, real_submit = passes.Pass.put, passes.Pass.finish, writer.Writer.submit
    donor: dict[str, torch.Tensor] = {}

    def put(self: Any, idx: int, t: torch.Tensor, owned: bool) -> None:
        name = self.hook.planes[idx]
        targets = _targets(self)
        if not targets:
            donor[name] = t[: int(self.seq_lens[0])].clone()  # the donor of a later other_rows
            return real_put(self, idx, t, owned)
        keep = self.__dict__.setdefault("_sabotage", {})
        keep[name] = t.clone()
        t = t.clone()
        for case, s, e, first in targets:
            if case == "wrong_layer" and name == "layer.1":
                keep["deferred"] = idx  # handed over when layer 2's input arrives
                return None
            if case == "wrong_layer" and name == "layer.2" and "deferred" in keep:
                bad = keep["layer.1"].clone()
                bad[s:e] = t[s:e]
                real_put(self, keep.pop("deferred"), bad, True)
            if case == "partial" and name == "layer.2":
                t[s:e] = ((t[s:e].float() + keep["layer.1"][s:e].float()) / 2).to(t.dtype)
            if case == "zeros" and name == "layer.3" or case == "pre_zeros" and name == "final.pre_norm":
                t[s:e] = 0
            if case == "other_rows" and first and name in donor:
                k = min(e - s, donor[name].shape[0])
                t[s:s + k] = donor[name][:k]
            if case == "post_is_pre" and name == "final.post_norm":
                t[s:e] = keep["final.pre_norm"][s:e]
            if case == "shift" and name == "final.post_norm":
                t[s + 1:e] = t[s:e - 1].clone()
        return real_put(self, idx, t, True)

    def finish(self: Any, post_norm: torch.Tensor) -> None:
        """The LM head's input as the hook sees it (its stream, when final.post_norm is not stored)."""
        targets = _targets(self)
        if targets and self.hook.post_index is None:
            post_norm = post_norm.clone()
            keep = self.__dict__.get("_sabotage", {})
            for case, s, e, first in targets:
                if case == "post_is_pre" and "final.pre_norm" in keep:
                    post_norm[s:e] = keep["final.pre_norm"][s:e]
                if case == "other_rows" and first and "final.post_norm" in donor:
                    k = min(e - s, donor["final.post_norm"].shape[0])
                    post_norm[s:s + k] = donor["final.post_norm"][:k]
        return real_finish(self, post_norm)

    def submit(self: Any, rec: Any) -> None:
        rows, offset = [], 0
        for j, n in enumerate(rec.seq_lens):
            if rec.rids is not None and case_of(str(rec.rids[j])) == "staging":
                rows.append((offset, offset + int(n)))
            offset += int(n)
        if rows:
            wait = rec.wait

            def late_wait() -> None:
                if wait is not None:
                    wait()
                for s, e in rows:  # the copies have landed: now the staging rows go wrong
                    for plane in rec.planes:
                        plane[s:e] = plane[s:e].flip(0).clone()

            rec.wait = late_wait
        return real_submit(self, rec)

    passes.Pass.put, passes.Pass.finish, writer.Writer.submit = put, finish, submit
    print(f"hs_patch sabotage installed in pid {os.getpid()} (a test: never a production server)", flush=True)

    def uninstall() -> None:
        passes.Pass.put, passes.Pass.finish, writer.Writer.submit = real_put, real_finish, real_submit

    return uninstall
