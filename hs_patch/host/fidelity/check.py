"""Production fidelity check: is every plane of a sample what the server computed in that pass?

Three checks per sample, all on every sample. The row checks (:mod:`hs_patch.host.fidelity.rows`):
every row of every plane against what the capture hook took on the GPU (finite, not zeros, its
exact bytes, the embedding of its token, the additive relation of every captured layer), and
rows of every chunk against what the model's own norm weights say (layer identity, full
reduction, the final norm). The server's logit gaps at the last ``gap_positions`` positions
against ours from the stored final state (:mod:`hs_patch.host.fidelity.gaps`): every sample's
final state is tied to its own request however its template ends it. And the same-pass top-1,
below: argmax of an fp32 ``lm_head`` over the dumped final state at the last prompt
position must equal the token the server generated in the SAME pass (greedy,
``max_new_tokens`` 1). On a sampled fraction (chosen by key, so a resumed run samples the
same ones) the last N positions are compared with the server's own top-1 of that pass
(``return_logprob``, ``logprob_start_len`` L - N, ``top_logprobs_num`` 2). A disagreement
whose logit margin is within ``tie_tolerance`` standard deviations of that position's
logits is a near-tie (bf16 server logits against our fp32 ones), not a mismatch: on
H200 / SGLang 0.5.16 every disagreement was below 0.015 std (docs/training.md); a shifted,
partial or wrong-rank state fails at almost every position. When the post-norm state is
derived from a stored ``final.pre_norm`` (HS_CAPTURE_FINAL=pre), our norm and the server's
fused one round differently (measured: one bf16 unit in the last place on ~20% of the
elements), so each disagreement is also allowed what such rounding can move its margin
(:func:`rounding_allowance`, about 0.04 std; the GPU proof saw a 0.025 std disagreement
on a derived state, which the plain tolerance failed). And the server's logits are in the
model dtype (SGLang's ``LogitsProcessor``: a bf16 matmul unless ``--enable-fp32-lm-head``)
and greedy decoding takes their argmax: two logits closer than one unit in the last place
of bf16 at their magnitude can round to one value there, and argmax then takes the lower
id. Such a tie is deterministic (the same state ties on every resume) and can exceed the
tolerance wherever the top logits sit high in their binade, so each disagreement is also
allowed that unit (:func:`logit_rounding`): on the test lab's tiny model, every one of 65
last-position disagreements of 6,000 stand-in prompts was such a tie (equal bf16 logits,
the server's id the lower), and ties reach 0.022 std there.

The LM head and final norm weight are read by name from the model directory
(:mod:`hs_patch.host.model_files`); the head is kept in fp32 (Kimi-K2.5: 4.7 GB of RAM) and
concurrent checks are batched into one matrix product (:class:`FidelityChecker`). Each
result is one line of the fidelity log; :mod:`hs_patch.host.fidelity.policy` turns a run
of mismatches into a stop with what is likely wrong.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from hs_patch.host.driver.client import generated_token, server_top
from hs_patch.host.fidelity.checksums import Embeddings
from hs_patch.host.fidelity.gaps import DEFAULT_GAP_POSITIONS, Gap, compare_gaps
from hs_patch.host.fidelity.rows import DEFAULT_ROWS, Norms, check_rows
from hs_patch.samples import lazy_sample, store

if TYPE_CHECKING:  # pragma: no cover
    import torch

DEFAULT_TIE_TOLERANCE = 0.02   # std of the row's logits; the largest same-pass disagreement measured: 0.015
DEFAULT_POSITIONS = 32
DEFAULT_FRACTION = 0.01
FIDELITY_LOG = "fidelity.jsonl"
DERIVED = "final.pre_norm+norm"  # the plane name of a post-norm state derived from the stored pre-norm one


@dataclass
class Position:
    pos: int
    server: int
    ours: int
    margin_std: float    # (our logit of ours - our logit of the server's) / std of our logits
    tie: bool
    allowance_std: float = 0.0  # what rounding can explain (a derived state, the server's logits), added to the tolerance


@dataclass
class Check:
    key: str
    kind: str                      # "last", "positions", or "rows" (no final state stored: the row checks alone)
    checked: int = 0
    mismatches: int = 0
    ties: int = 0
    parts: int = 1
    plane: str = ""
    details: list[Position] = field(default_factory=list)   # disagreements only
    hints: dict[str, float] = field(default_factory=dict)   # alternative explanations that fit better
    rows: dict[str, Any] = field(default_factory=dict)      # the row checks (rows.RowCheck.record())
    gaps: int = 0                                           # positions whose server logit gap was compared
    gap_mismatches: list[Gap] = field(default_factory=list)  # those that disagree beyond rounding
    gap_worst: float = 0.0                                  # the largest |server - ours| / tolerance compared

    @property
    def problems(self) -> list[str]:
        """What the row checks found wrong (empty: every checked row is right)."""
        return list(self.rows.get("problems", []))

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and not self.problems and not self.gap_mismatches

    def record(self, **extra: Any) -> dict[str, Any]:
        d = asdict(self)
        d.update(ok=self.ok, t=round(time.time(), 3), **extra)
        return d


class LMHead:
    """An fp32 LM head and the final norm, for argmax over dumped final states."""

    def __init__(self, head: "torch.Tensor", norm: "torch.Tensor", eps: float, directory: Optional[Path] = None):
        import torch

        self.logit_dtype = head.dtype   # the server computes its logits in the head's dtype
        self.weight = head.to(torch.float32).contiguous()
        self.norm, self.eps = norm, eps
        self.directory = directory  # where the row checks read each captured layer's input norm

    @classmethod
    def from_model_dir(cls, directory: str | Path) -> "LMHead":
        from hs_patch.host.model_files import head_and_norm

        head, norm, info = head_and_norm(directory)
        return cls(head, norm, info.rms_norm_eps, Path(directory))

    def logits(self, states: "torch.Tensor") -> "torch.Tensor":
        """fp32 logits [N, V] of post-norm states [N, H]."""
        return states.float() @ self.weight.T

    def post_norm(self, sample: lazy_sample.LazySample, start: int, stop: int) -> tuple["torch.Tensor", str]:
        """Post-norm final states of rows [start, stop): the stored plane, or derived from the pre-norm one."""
        from hs_patch.host.model_files import rms_norm

        if sample.has("final.post_norm") and not sample.fp8:
            return sample.rows("final.post_norm", start, stop), "final.post_norm"
        if sample.has("final.pre_norm") and not sample.fp8:
            return rms_norm(sample.rows("final.pre_norm", start, stop), self.norm, self.eps), DERIVED
        first = check_from(sample)
        if first is not None and start >= first:  # HS_CAPTURE_FINAL=none or fp8: the bf16 rows kept for the check
            return sample.rows(store.CHECK_TENSOR, start - first, stop - first), store.CHECK_TENSOR
        raise store.SampleError(f"{sample.path}: no final state stored (HS_CAPTURE_FINAL=none) at positions "
                                f"{start}..{stop - 1}: nothing to check")


def check_from(sample: lazy_sample.LazySample) -> Optional[int]:
    """The first position of the LM head's input kept for the check (HS_CAPTURE_FINAL=none, or fp8 planes), or
    None."""
    if not sample.has(store.CHECK_TENSOR):
        return None
    return sample.num_tokens - int(sample.metadata[store.CHECK_ROWS])


def compare(logits: "torch.Tensor", server: Sequence[int], positions: Sequence[int], tol: float, *,
            derived: Optional[tuple["torch.Tensor", "torch.Tensor"]] = None,
            logit_dtype: Optional["torch.dtype"] = None) -> list[Position]:
    """Positions where our argmax differs from the server's token (ties marked).

    ``derived``: (the post-norm states [N, H], the head [V, H]) when the states were derived from
    ``final.pre_norm``: a disagreement is then a tie up to ``tol`` plus its :func:`rounding_allowance`.
    ``logit_dtype``: the dtype of the server's logits; a disagreement is also allowed its
    :func:`logit_rounding`.
    """
    out: list[Position] = []
    if not len(positions):  # nothing to compare (no final state stored): no statistics of no rows
        return out
    ours = logits.argmax(-1)
    std = logits.std(-1)
    for i, (pos, tok) in enumerate(zip(positions, server)):
        o = int(ours[i])
        if o != tok:
            scale = std[i].clamp_min(1e-30)
            margin = float((logits[i, o] - logits[i, tok]) / scale)
            allow = 0.0 if derived is None else float(rounding_allowance(derived[0][i], derived[1], o, int(tok)) / scale)
            if logit_dtype is not None:
                allow += logit_rounding(float(logits[i, o]), float(logits[i, tok]), logit_dtype) / float(scale)
            out.append(Position(pos, int(tok), o, round(margin, 6), margin <= tol + allow, round(allow, 6)))
    return out


def logit_rounding(a: float, b: float, dtype: "torch.dtype") -> float:
    """One unit in the last place of ``dtype`` at the larger magnitude of two logits: closer than
    that, the server's logits (in ``dtype``) may hold one value for both, and its argmax takes the
    lower id."""
    import torch

    top = max(abs(a), abs(b))
    return math.ldexp(torch.finfo(dtype).eps, math.frexp(top)[1] - 1) if top else 0.0


ROUNDING_FALSE_FAILURE = 1e-6  # the chance that rounding alone exceeds the allowance of one disagreement


def rounding_allowance(state: "torch.Tensor", head: "torch.Tensor", a: int, b: int) -> float:
    """How far ``logit[a] - logit[b]`` can move when each element of ``state`` is rounded
    differently by at most one unit in the last place of its dtype (independently, either way):
    Hoeffding's bound at ROUNDING_FALSE_FAILURE, sqrt(2 ln(2/p) * sum_j (|head[a,j] - head[b,j]| ulp_j)^2).
    A rescaled row (another rsqrt) never moves the argmax, so only such per-element noise counts."""
    import torch

    x = state.float()
    ulp = torch.ldexp(torch.full_like(x, torch.finfo(state.dtype).eps), torch.frexp(x).exponent - 1)
    c = (head[a].float() - head[b].float()).abs() * ulp
    return math.sqrt(2 * math.log(2 / ROUNDING_FALSE_FAILURE)) * float(c.pow(2).sum().sqrt())


def wants_positions(key: str, fraction: float) -> bool:
    """The sampled fraction, decided by the key (stable across resumes)."""
    return int(key[:8], 16) < fraction * 16 ** 8


def request_fields(key: str, num_tokens: int, *, fraction: float = DEFAULT_FRACTION,
                   positions: int = DEFAULT_POSITIONS, gaps: int = DEFAULT_GAP_POSITIONS) -> dict[str, Any]:
    """Extra keyword arguments of ``SGLangClient.generate`` for this sample: the server's best two at its last
    ``gaps`` positions (every sample), or ``positions`` (the sampled fraction); {} when neither is asked."""
    last = positions if wants_positions(key, fraction) else gaps
    if last < 1:
        return {}
    return {"return_logprob": True, "logprob_start_len": max(0, num_tokens - last), "top_logprobs_num": 2}


@dataclass
class _Job:
    key: str
    path: Path
    response: dict[str, Any]
    states: Any = None                                   # the post-norm rows whose argmax is compared
    positions: list[int] = field(default_factory=list)  # their positions
    server: list[int] = field(default_factory=list)     # the server's top-1 there
    check: Optional[Check] = None
    error: Optional[BaseException] = None
    done: threading.Event = field(default_factory=threading.Event)


class FidelityChecker:
    """Check samples against the server's answers; callers from several threads are batched.

    ``check(key, path, response)`` blocks until its result; a background thread runs one
    matrix product for everything queued meanwhile (at most ``batch`` samples).
    """

    def __init__(self, head: LMHead, log_dir: str | Path, *, tie_tolerance: float = DEFAULT_TIE_TOLERANCE,
                 positions: int = DEFAULT_POSITIONS, batch: int = 32, norms: Optional[Norms] = None,
                 rows: int = DEFAULT_ROWS, gaps: int = DEFAULT_GAP_POSITIONS,
                 embeddings: Optional[Embeddings] = None):
        """``gaps``: the positions every request asked the server's best two for (:func:`request_fields`); an
        answer with more is a sampled one, whose argmax is compared at all of them. ``embeddings``: the
        embedding weight's row checksums (default: read from the head's model directory when a sample first
        needs them; None there and no directory: the embedded rows are not checked)."""
        self.head, self.tol, self.positions, self.batch = head, tie_tolerance, positions, batch
        self.norms = norms if norms is not None else Norms(head.norm, head.eps, head.directory)
        self.rows, self.gaps = rows, gaps
        self.embeddings = embeddings if embeddings is not None or head.directory is None else \
            Embeddings(head.directory)
        self.log = store.Manifest(log_dir, FIDELITY_LOG)
        self._q: list[_Job] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="hs-fidelity", daemon=True)
        self._thread.start()

    def prepare(self, job: _Job) -> None:
        """Run the row checks; read the final states to check and the server's tokens for them."""
        with lazy_sample.open_sample(job.path) as s:
            rows = check_rows(s, self.norms, per_chunk=self.rows, embeddings=self.embeddings).record()
            n = s.num_tokens
            # an fp8 sample's final planes are fp8: its logits come from the bf16 check rows the hook keeps beside
            # them (HS_CAPTURE_CHECK_ROWS), exactly what the engine computed, as with HS_CAPTURE_FINAL=none
            stored = not s.fp8 and (s.has("final.post_norm") or s.has("final.pre_norm"))
            first = 0 if stored else check_from(s)
            if first is None:
                # HS_CAPTURE_FINAL=none with HS_CAPTURE_CHECK_ROWS=0: no final state to give the server's token;
                # every stored plane is still checked by the row checks (fingerprints, layer identity)
                import torch

                job.positions, job.server = [], []
                job.states = torch.empty(0, self.head.weight.shape[1])
                job.check = Check(job.key, "rows", checked=0, parts=int(s.metadata.get("parts", 1)), plane="",
                                  rows=rows)
                return
            meta = job.response.get("meta_info") or {}
            top: dict[int, list[tuple[float, int]]] = {}
            if meta.get("input_top_logprobs") is not None:
                top = server_top(job.response, n, n - len(meta["input_top_logprobs"]))
                top = {pos: best for pos, best in top.items() if pos >= first}  # where a final state is kept
            # asked for more than every sample's gap positions (a sampled one), or a prompt no longer than them
            if len(top) > self.gaps or top and len(top) >= n - first:
                job.positions, kind = sorted(top), "positions"
                job.server = [top[p][0][1] for p in job.positions]
            else:
                job.positions, job.server, kind = [n - 1], [generated_token(job.response)], "last"
            covered = sorted(set(top) | set(job.positions))
            states, plane = self.head.post_norm(s, covered[0], n)
            job.states = states[[p - covered[0] for p in job.positions]]
            gaps = compare_gaps(states[[p - covered[0] for p in sorted(top)]], self.head.weight, sorted(top), top,
                                self.head.logit_dtype, self._derived if plane == DERIVED else None)
            job.check = Check(job.key, kind, checked=len(job.positions), parts=int(s.metadata.get("parts", 1)),
                              plane=plane, rows=rows, gaps=len(gaps), gap_mismatches=[g for g in gaps if not g.ok],
                              gap_worst=round(max((abs(g.server - g.ours) / g.tolerance for g in gaps), default=0.0),
                                              4))

    def _derived(self, state: "torch.Tensor", a: int, b: int) -> float:
        """What our norm's rounding (a state derived from final.pre_norm) may move a logit difference."""
        return rounding_allowance(state, self.head.weight, a, b)

    def check(self, key: str, path: str | Path, response: dict[str, Any], **log_extra: Any) -> Check:
        """Check one final sample against the server's answer to its request; logged."""
        job = _Job(key, Path(path), response)
        self.prepare(job)
        with self._cv:
            if self._closed:
                raise RuntimeError("the fidelity checker is closed")
            self._q.append(job)
            self._cv.notify()
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.check is not None
        self.log.append(job.check.record(**log_extra))
        return job.check

    def _loop(self) -> None:
        import torch

        while True:
            with self._cv:
                while not self._q and not self._closed:
                    self._cv.wait()
                if not self._q:
                    return
                jobs, self._q = self._q[:self.batch], self._q[self.batch:]
            try:
                logits = self.head.logits(torch.cat([j.states for j in jobs]))
                row = 0
                for j in jobs:
                    n = len(j.positions)
                    assert j.check is not None
                    derived = (j.states, self.head.weight) if j.check.plane == DERIVED else None
                    diff = compare(logits[row:row + n], j.server, j.positions, self.tol, derived=derived,
                                   logit_dtype=self.head.logit_dtype)
                    j.check.details = diff
                    j.check.ties = sum(d.tie for d in diff)
                    j.check.mismatches = len(diff) - j.check.ties
                    if j.check.mismatches:
                        j.check.hints = hints(logits[row:row + n], j.server)
                    row += n
            except BaseException as e:  # noqa: BLE001 - handed to every waiting caller
                for j in jobs:
                    j.error = e
            for j in jobs:
                j.done.set()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()


def hints(logits: "torch.Tensor", server: Sequence[int]) -> dict[str, float]:
    """How often our argmax equals the server's token one position EARLIER or LATER (a shift)."""
    ours = logits.argmax(-1).tolist()
    n = len(ours)
    if n < 2:
        return {}
    return {"shift_plus_one": sum(ours[i] == server[i + 1] for i in range(n - 1)) / (n - 1),
            "shift_minus_one": sum(ours[i + 1] == server[i] for i in range(n - 1)) / (n - 1)}
