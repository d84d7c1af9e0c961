"""Capture made wrong on purpose, each way issues #25 and #33 list, to show the production check rejects it.

Never part of the product. :func:`install` wraps the real capture hook's entry points so that a
request whose id is ``sab-<case>-...`` is captured wrong in that one way, as a capture bug would
make it; other requests, even in the same pass, are untouched, and neither what each layer
computes nor what the model returns is ever changed (only the copies the hook is handed, or its
staging rows after they landed). Used by the CPU tests (``tests/server/test_fingerprints.py``,
the simulated forward; ``tests/fidelity/test_identity.py``, the stand-in server) and by the GPU
proof's ``sabotage`` phase (``tests/gpu/sabotage.py``: the real server, where
``tests/gpu/sabotage_site/sitecustomize.py`` installs it in SGLang's scheduler process).

Issue #25's cases, each in the stored plane only (what the hook is handed for it):

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

Issue #33's cases:

- ``row``: one interior row of ``layer.2`` negated in the staging buffer after it landed;
- ``nan_post`` / ``garbage_post``: a NaN in one element of an interior row of ``final.post_norm``,
  or random bytes over three interior rows of it, in the staging buffer after they landed;
- ``scaled``: ``layer.2`` as handed to the hook times 1.5; ``pre_scaled``: ``final.pre_norm``
  times 1.5 (the final norm's inputs, handed separately, stay right);
- ``chunk_partial``: ``partial`` in the prompt's parts after its first only (a chunk-local
  difference, as 0.5.9's all-reduce fusion makes for passes of up to 2,048 tokens);
- ``other_request``: the whole prompt holds another prompt's states (the first request of the
  last clean pass, of the same length) in EVERY stream the hook is handed after the embedding:
  every plane, every fingerprinted tensor, the LM head's input; consistent everywhere, so only
  what ties states to the request can see it;
- ``shift_all``: every stream after the embedding one row late, consistently.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

CASES = ("wrong_layer", "partial", "zeros", "pre_zeros", "other_rows", "post_is_pre", "staging", "shift",
         "row", "nan_post", "garbage_post", "scaled", "pre_scaled", "chunk_partial", "other_request", "shift_all")
STAGING = ("staging", "row", "nan_post", "garbage_post")  # after the copies landed
# the sizes of the wrong states, for tests that look for the smallest one the check rejects
SCALE = 1.5            # scaled, pre_scaled: the factor
MISSING = 0.5          # partial, chunk_partial: the share of layer 1's update that layer 2's plane lacks
AT_PREFIX = None       # chunk_partial: only in the part that starts there (None: every part after the first)
if os.environ.get("HS_TEST_SABOTAGE_AT_PREFIX"):  # a server's processes (the GPU proof) are told this way
    AT_PREFIX = int(os.environ["HS_TEST_SABOTAGE_AT_PREFIX"])
EVERY_STREAM = ("other_request", "shift_all")              # every tensor the hook is handed after the embedding


def rid(case: str, n: int = 0) -> str:
    """The request id that asks for ``case``."""
    return f"sab-{case}-{n}"


def case_of_rid(name: str) -> Optional[str]:
    """The case a request id asks for (``sab-<case>-...``), or None."""
    return name.split("-")[1] if name.startswith("sab-") else None


def install(case_of: Callable[[str], Optional[str]] = case_of_rid) -> Callable[[], None]:
    """Wrap the hook's entry points and the writer's intake; returns the function that undoes it.
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

    real = {name: getattr(passes.Pass, name) for name in ("put", "finish", "attention_output", "mid", "final_inputs",
                                                          "final_prenorm")}
    real_attn_input, real_submit = passes.Tee.hs_attn_input, writer.Writer.submit
    donor: dict[str, torch.Tensor] = {}  # the first request of the last clean pass, by stream

    def everywhere(self: Any, name: str, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """``t`` as the every-stream cases hand it over (a clean pass keeps its first request as the donor)."""
        if t is None:
            return t
        targets = [x for x in _targets(self) if x[0] in EVERY_STREAM]
        if not _targets(self):
            donor[name] = t[: int(self.seq_lens[0])].clone()
            return t
        if not targets:
            return t
        t = t.clone()
        for case, s, e, first in targets:
            if case == "shift_all":
                t[s + 1:e] = t[s:e - 1].clone()
            elif case == "other_request" and name in donor and donor[name].shape[0] == e - s:
                t[s:e] = donor[name]
        return t

    def put(self: Any, idx: int, t: torch.Tensor, owned: bool) -> None:
        name = self.hook.planes[idx]
        t = everywhere(self, name, t)
        targets = [x for x in _targets(self) if x[0] not in EVERY_STREAM]
        if not targets:  # (a clean pass's first request was kept as the donor by everywhere)
            return real["put"](self, idx, t, owned)
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
                real["put"](self, keep.pop("deferred"), bad, True)
            chunk = case == "chunk_partial" and not first and (AT_PREFIX is None or self._prefix_of(s) == AT_PREFIX)
            if (case == "partial" or chunk) and name == "layer.2":
                missing = (t[s:e].float() - keep["layer.1"][s:e].float()) * MISSING
                t[s:e] = (t[s:e].float() - missing).to(t.dtype)
            if case == "zeros" and name == "layer.3" or case == "pre_zeros" and name == "final.pre_norm":
                t[s:e] = 0
            if case == "other_rows" and first and name in donor:
                k = min(e - s, donor[name].shape[0])
                t[s:s + k] = donor[name][:k]
            if case == "post_is_pre" and name == "final.post_norm":
                t[s:e] = keep["final.pre_norm"][s:e]
            if case == "shift" and name == "final.post_norm":
                t[s + 1:e] = t[s:e - 1].clone()
            if case == "scaled" and name == "layer.2" or case == "pre_scaled" and name == "final.pre_norm":
                t[s:e] = (t[s:e].float() * SCALE).to(t.dtype)
        return real["put"](self, idx, t, True)

    def finish(self: Any, post_norm: torch.Tensor) -> None:
        """The LM head's input as the hook sees it (its stream, when final.post_norm is not stored)."""
        targets = _targets(self)
        if targets and self.hook.post_index is None:
            post_norm = everywhere(self, "final.post_norm", post_norm).clone()
            keep = self.__dict__.get("_sabotage", {})
            for case, s, e, first in targets:
                if case == "post_is_pre" and "final.pre_norm" in keep:
                    post_norm[s:e] = keep["final.pre_norm"][s:e]
                if case == "other_rows" and first and "final.post_norm" in donor:
                    k = min(e - s, donor["final.post_norm"].shape[0])
                    post_norm[s:s + k] = donor["final.post_norm"][:k]
        elif not targets and self.hook.post_index is None:
            everywhere(self, "final.post_norm", post_norm)  # kept as a donor
        return real["finish"](self, post_norm)

    def final_prenorm(self: Any, t: torch.Tensor, owned: bool = False) -> None:
        if self.hook.pre_index is None:  # a stream only: put does not see it
            t = everywhere(self, "final.pre_norm", t)
        return real["final_prenorm"](self, t, owned)

    def attn_input(self: Any, t: torch.Tensor) -> None:
        p = self._pass
        return real_attn_input(self, everywhere(p, f"attn_in.{p.hook.cfg.layers[self._idx]}", t))

    def attention_output(self: Any, idx: int, t: torch.Tensor) -> None:
        return real["attention_output"](self, idx, everywhere(self, f"attn_out.{self.hook.cfg.layers[idx]}", t))

    def mid(self: Any, idx: int, t: torch.Tensor) -> None:
        return real["mid"](self, idx, everywhere(self, f"mid.{self.hook.cfg.layers[idx]}", t))

    def final_inputs(self: Any, update: torch.Tensor, residual: Optional[torch.Tensor]) -> None:
        return real["final_inputs"](self, everywhere(self, "final.update_in", update),
                                    everywhere(self, "final.residual_in", residual))

    def submit(self: Any, rec: Any) -> None:
        rows, offset = [], 0
        for j, n in enumerate(rec.seq_lens):
            case = case_of(str(rec.rids[j])) if rec.rids is not None else None
            if case in STAGING:
                rows.append((case, offset, offset + int(n)))
            offset += int(n)
        if rows:
            wait = rec.wait
            names = list(self.planes)

            def late_wait() -> None:
                if wait is not None:
                    wait()
                for case, s, e in rows:  # the copies have landed: now the staging rows go wrong
                    mid_row = s + (e - s) // 2
                    if case == "staging":
                        for plane in rec.planes:
                            plane[s:e] = plane[s:e].flip(0).clone()
                    elif case == "row" and "layer.2" in names:
                        plane = rec.planes[names.index("layer.2")]
                        plane[mid_row] = (-plane[mid_row].float()).to(plane.dtype)  # exact (fp8 has no neg)
                    elif case == "nan_post" and "final.post_norm" in names:
                        rec.planes[names.index("final.post_norm")][mid_row, 1] = float("nan")
                    elif case == "garbage_post" and "final.post_norm" in names:
                        plane = rec.planes[names.index("final.post_norm")]
                        g = torch.Generator().manual_seed(33)
                        raw = torch.randint(0, 256, (3, plane.shape[1] * plane.element_size()), dtype=torch.uint8,
                                            generator=g)
                        plane[mid_row:mid_row + 3] = raw.view(plane.dtype)

            rec.wait = late_wait
        return real_submit(self, rec)

    def prefix_of(self: Any, row: int) -> int:
        """Where the request whose rows start at ``row`` in this pass begins in its prompt."""
        offset = 0
        for n, prefix in zip(self.seq_lens, self.prefix_lens):
            if offset == row:
                return int(prefix)
            offset += int(n)
        return -1

    passes.Pass._prefix_of = prefix_of
    passes.Pass.put, passes.Pass.finish, passes.Pass.final_prenorm = put, finish, final_prenorm
    passes.Pass.attention_output, passes.Pass.mid, passes.Pass.final_inputs = attention_output, mid, final_inputs
    passes.Tee.hs_attn_input, writer.Writer.submit = attn_input, submit
    print(f"hs_patch sabotage installed in pid {os.getpid()} (a test: never a production server)", flush=True)

    def uninstall() -> None:
        for name, fn in real.items():
            setattr(passes.Pass, name, fn)
        passes.Tee.hs_attn_input, writer.Writer.submit = real_attn_input, real_submit
        del passes.Pass._prefix_of

    return uninstall
