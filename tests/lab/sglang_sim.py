"""Run the REAL patched ``DeepseekV2Model.forward`` of each SGLang release on the CPU.

SGLang cannot be imported here (it needs a GPU stack), so this harness executes the
patched method's source, taken from the release's real ``deepseek_v2.py`` after
``hs-patch``'s edits, against a stand-in model whose layers replay a tiny random
``transformers`` DeepseekV3 computed on the same tokens, for every release hs_patch knows
(its family, hs_patch.engine.releases, decides which of SGLang's steps the layer calls). The
stand-in keeps SGLang's conventions that matter to the capture:

- the residual stream is ``hidden_states + residual`` and the layer input norm adds
  them IN PLACE into ``residual`` (``fused_add_rmsnorm``), so a capture that keeps a
  reference instead of a copy reads a later value;
- with flashinfer all-reduce fusion a layer returns a per-rank partial sum of its MLP
  output and the NEXT layer's input step completes the all-reduce (the DESIGN.md trap:
  ``hidden_states + residual`` in the layer-point family's model loop is then wrong);
- the communicator family (0.5.14 .. 0.5.20) runs the release's OWN
  ``LayerCommunicator.prepare_attn_and_capture_last_layer_outputs`` from its communicator.py
  (which decides whether the collector gets a clone: ``_post_attn_residual_is_read_only``,
  from 0.5.17 ``copies_on_append``); the layer-boundary family (0.5.21 .. 0.5.23) a stand-in
  for ``attn_boundary.prepare(..., capture_gathered=)`` (0.5.21: ``captured_last_layer_outputs=``;
  its collector's ``capture(value, owned=...)``) and ``residual_batch.final_norm(..., capture=)``
  (0.5.21: ``norm(..., capture_output=)``); from 0.5.17 ``AuxHiddenStatePacker`` is the
  release's own class, loaded from its wheel (``ReleaseCode``);
- the patched ``DeepseekV2DecoderLayer.forward`` itself runs too, for every release (the
  line the patch adds after ``prepare_attn``, handing the hook what the attention reads, and
  the lines around ``prepare_mlp``: the attention's output, the residual after it);
- with ``tp_rank`` set the harness plays one of two tensor-parallel ranks: the attention
  returns that rank's share of its output and ``prepare_mlp`` adds the two shares' bf16 sum
  (an all-reduce's result), so two harnesses in two threads, one per rank, run the pass as
  SGLang's two ranks would.

Each request in a pass is looked up by the id the test gives it, so batched, chunked
and prefix-cached passes can be played exactly as SGLang's scheduler would send them.
"""

from __future__ import annotations

import ast
import types
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from lab.hf_reference import Reference, reference  # noqa: F401  (re-exported for tests)

from hs_patch.engine.releases import RELEASES

# ----------------------------------------------------------------------------- batches


@dataclass
class Part:
    """One request's slice in a pass: tokens [start, start+n) of request ``req``."""

    req: str
    start: int
    n: int


class ForwardMode:
    def __init__(self, name: str):
        self.name = name

    def is_idle(self) -> bool:
        return self.name == "IDLE"

    def is_extend(self) -> bool:
        return self.name in ("EXTEND", "MIXED", "DRAFT_EXTEND", "TARGET_VERIFY")


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    parts: list[Part]
    rids: list[str] | None = None
    orig_seq_lens: Any = None   # int32 [bs]: each request's whole prompt length (SGLang's ScheduleBatch)
    can_run_tbo: bool = False
    residual_stream: Any = None


# ----------------------------------------------------------------------------- stand-ins


def rmsnorm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    return norm(x.unsqueeze(0))[0]


class FusedNorm:
    """SGLang's RMSNorm: ``norm(x)``, or ``norm(x, residual)`` adding x into residual IN PLACE."""

    def __init__(self, hf_norm: Any):
        self.hf = hf_norm

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, *a: Any):
        if residual is None:
            return rmsnorm(self.hf, x)
        residual.add_(x)
        return rmsnorm(self.hf, residual), residual


class Sim:
    """A stand-in DeepseekV2Model for ``release`` whose layers replay ``refs``."""

    def __init__(self, release: str, patched_source: str, model: Any, refs: dict[str, Reference],
                 *, fusion: bool = False, layers_to_capture: tuple[int, ...] = (), hook: Any = None,
                 code: Optional["ReleaseCode"] = None, tp_rank: Optional[int] = None):
        """``code``: the release's own files the harness runs besides ``patched_source`` (ReleaseCode.read);
        ``tp_rank``: 0 or 1, this harness plays that rank of two (None: TP=1)."""
        self.release, self.refs, self.fusion, self.tp_rank = release, refs, fusion, tp_rank
        self.family = RELEASES[release].family.name
        cfg = model.config
        self.n_layers = cfg.num_hidden_layers
        ns = self._namespace(code.aux if code is not None else None)
        tree = ast.parse(patched_source)
        cls = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}
        self.model_forward = _function(cls["DeepseekV2Model"], "forward", ns)
        layer_forward = _function(cls["DeepseekV2DecoderLayer"], "forward", ns)
        self.comm_capture = None
        if self.family == "communicator":
            if code is None or code.communicator is None:
                raise ValueError(f"SGLang {release}: the communicator family runs its own communicator.py; pass code=")
            comm = next(c for c in ast.walk(ast.parse(code.communicator))
                        if isinstance(c, ast.ClassDef) and c.name == "LayerCommunicator")
            self.comm_capture = _function(comm, "prepare_attn_and_capture_last_layer_outputs", ns)
        m = types.SimpleNamespace(
            _hs_capture=hook, start_layer=0, end_layer=self.n_layers, first_k_dense_replace=1,
            layers_to_capture=list(layers_to_capture), enable_a2a_moe=False, gemm_output_zero_allocator_size=0,
            llama_4_scaling_config=None, cp_size=None, config=cfg, use_dsa=False, dsa_enable_prefill_cp=False,
            mla_enable_prefill_cp=False, next_full_attention_layer_id={},
            pp_group=types.SimpleNamespace(is_first_rank=True, is_last_rank=True),
            embed_tokens=lambda ids: model.model.embed_tokens(ids),
            norm=FusedNorm(model.model.norm), _dsa_forward_uses_topk=lambda: False)
        m.layers = [self._layer(i, layer_forward, model.model.layers[i]) for i in range(self.n_layers)]
        self.m = m
        self.sglang_aux: Any = None

    # -- the names the patched forward methods read from their module
    def _namespace(self, aux_module: Any) -> dict[str, Any]:
        class _Recorder:
            def with_current_layer(self, i: int) -> Any:
                return nullcontext()

        class _Phase:
            PREFILL, DECODE = "prefill", "decode"

        class _Backend:
            TC_PIECEWISE, FULL, BREAKABLE, DISABLED = "tc_piecewise", "full", "breakable", "disabled"

        class _IndexTopK:
            def __init__(self, fb: Any, initial: Any):
                self.topk_indices = initial

            def update(self, t: Any) -> None:
                self.topk_indices = t

        sim = self

        class _ResidualBatch:  # 0.5.23's residual stream API, as the model forward uses it
            @staticmethod
            def start(fb: ForwardBatch) -> None:
                fb.residual_stream = types.SimpleNamespace(residual=None, pending=None)

            @staticmethod
            def complete_output(h: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
                return sim._complete(h)

            @staticmethod
            def final_norm(h: torch.Tensor, fb: ForwardBatch, norm: FusedNorm, capture: Any = None) -> torch.Tensor:
                residual = fb.residual_stream.residual
                fb.residual_stream = None
                if residual is None:
                    if capture is not None:
                        capture(h)
                    return norm(h)
                out, residual = norm(h, residual)
                if capture is not None:
                    capture(residual)
                return out

            @staticmethod  # 0.5.21's name and keyword for the same step
            def norm(h: torch.Tensor, fb: ForwardBatch, norm: FusedNorm, capture_output: Any = None) -> torch.Tensor:
                return _ResidualBatch.final_norm(h, fb, norm, capture_output)

        ns: dict[str, Any] = {
            "torch": torch, "nullcontext": nullcontext, "Optional": Optional, "Union": Any, "Any": Any,
            "List": list, "ForwardBatch": ForwardBatch, "BumpAllocator": lambda **kw: None,
            "PPProxyTensors": dict, "get_global_expert_distribution_recorder": _Recorder,
            "get_global_server_args": lambda: types.SimpleNamespace(enable_piecewise_cuda_graph=False,
                                                                    disable_piecewise_cuda_graph=True),
            "nsa_use_prefill_cp": lambda fb: False, "dsa_use_prefill_cp": lambda fb, flag: False,
            "mla_use_prefill_cp": lambda fb, flag: False, "is_cp_v2_active": lambda fb: False,
            "check_cuda_graph_backend": lambda phase, backend: False, "Phase": _Phase, "Backend": _Backend,
            "IndexTopKShareState": _IndexTopK, "residual_batch": _ResidualBatch,
            # what the decoder layer's forward reads (0.5.16, 0.5.23)
            "get_attn_tp_context": lambda: types.SimpleNamespace(clear_attn_inputs=lambda: None),
            "maybe_prefetch_next_full_attention_kv": lambda fb, layer_id: None,
            "get_forward": lambda: types.SimpleNamespace(scoped=lambda **kw: nullcontext()),
            "residual_access": types.SimpleNamespace(buffer=lambda h: h),
            "_is_gfx95_supported": False, "DeepseekV2MLP": type("DeepseekV2MLP", (), {}),
            "DeepseekV2MoE": type("DeepseekV2MoE", (), {}), "AuxHiddenStateAccumulator": Any,
        }
        if aux_module is not None:
            ns["AuxHiddenStatePacker"] = aux_module.AuxHiddenStatePacker
        return ns

    # -- replayed per-token values of the current pass
    def _gather(self, fb: ForwardBatch, pick: Any) -> torch.Tensor:
        return torch.cat([pick(self.refs[p.req])[p.start:p.start + p.n] for p in fb.parts])

    def _complete(self, h: torch.Tensor) -> torch.Tensor:
        """Finish a deferred all-reduce: add the other ranks' share of the MLP output."""
        rest = getattr(h, "_sim_rest", None)
        return h if rest is None else h + rest

    def _mlp_out(self, fb: ForwardBatch, i: int, fuse: bool) -> torch.Tensor:
        full = self._gather(fb, lambda r: r.mlp_out[i])
        if not fuse:
            return full
        part = full * 0.5  # exact in floating point, and part + (full - part) == full exactly
        part._sim_rest = full - part
        return part

    def _fuse(self, i: int) -> bool:
        return self.fusion and i < self.n_layers - 1

    TP_SHARE = 0.3  # rank 0's share of the attention output; rank 1 holds the rest

    def _attn_shares(self, fb: ForwardBatch, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        full = self._gather(fb, lambda r: r.attn_out[i])
        first = (full.float() * self.TP_SHARE).to(full.dtype)
        return first, (full.float() - first.float()).to(full.dtype)

    def _attention(self, fb: ForwardBatch, i: int) -> torch.Tensor:
        """What the attention returns: the whole output, or this rank's share of it."""
        if self.tp_rank is None:
            return self._gather(fb, lambda r: r.attn_out[i])
        return self._attn_shares(fb, i)[self.tp_rank]

    def _reduced(self, h: torch.Tensor, fb: ForwardBatch, i: int) -> torch.Tensor:
        """The attention output after the all-reduce: both shares added in bf16 (NCCL's arithmetic)."""
        if self.tp_rank is None:
            return h
        first, second = self._attn_shares(fb, i)
        return first + second

    def _layer(self, i: int, layer_forward: Any, hf_layer: Any) -> Any:
        sim = self

        def prepare_attn(h: torch.Tensor, residual: torch.Tensor | None, fb: ForwardBatch, *a: Any):
            if residual is None:
                return rmsnorm(hf_layer.input_layernorm, h), h
            if getattr(h, "_sglang_needs_allreduce_fusion", False):
                residual = residual + sim._complete(h)  # flashinfer writes a fresh residual_out
                return rmsnorm(hf_layer.input_layernorm, residual), residual
            residual.add_(h)
            return rmsnorm(hf_layer.input_layernorm, residual), residual

        def prepare_mlp(h: torch.Tensor, residual: torch.Tensor, fb: ForwardBatch):
            h = sim._reduced(h, fb, i)
            if sim.fusion:  # flashinfer's fused all-reduce + add + norm writes a fresh residual_out
                residual = residual + h
            else:
                residual.add_(h)
            return rmsnorm(hf_layer.post_attention_layernorm, residual), residual

        def attention(**kw: Any) -> torch.Tensor:
            return sim._attention(kw["forward_batch"], i)

        def mlp(h: torch.Tensor, fb: ForwardBatch, *a: Any) -> torch.Tensor:
            fuse = a[0] if len(a) == 3 else sim._fuse(i)  # through 0.5.15.post1 the layer passes its decision
            return sim._mlp_out(fb, i, fuse)

        comm = types.SimpleNamespace(
            prepare_attn=prepare_attn, prepare_mlp=prepare_mlp,
            should_fuse_mlp_allreduce_with_next_layer=lambda fb: sim._fuse(i),
            should_use_reduce_scatter=lambda fb: False,
            postprocess_layer=lambda h, r, fb: (h, r))

        if sim.comm_capture is not None:  # the communicator family: the release's own step, on this layer's
            own = types.SimpleNamespace(  # (only flashinfer's fused path writes a fresh residual)
                prepare_attn=lambda h, r, fb, quant_format="", post_residual_addition=None: prepare_attn(h, r, fb),
                _communicate_simple_fn=lambda hidden_states, forward_batch, context: hidden_states, _context=None,
                _post_attn_residual_is_read_only=lambda residual: sim.fusion)
            comm.prepare_attn_and_capture_last_layer_outputs = lambda *a, **kw: sim.comm_capture(own, *a, **kw)

        class Attention:  # 0.5.23 asks the attention module for a decode-TP scope
            def __call__(self, **kw: Any) -> torch.Tensor:
                return attention(**kw)

            def maybe_use_decode_attn_tp(self, fb: ForwardBatch) -> Any:
                return nullcontext()

        class AttnBoundary:  # 0.5.21 on: the layer_boundary stage of the attention (layer_boundary/stage.py)
            input_on_attn_tp_slices = input_on_attention_tp_slices = False  # 0.5.22 on, 0.5.21

            def prepare(self, h, fb, *, capture_gathered=None, captured_last_layer_outputs=None, quant_format=""):
                if capture_gathered is None:  # 0.5.21's keyword (a collector can be falsy: it has a length)
                    capture_gathered = captured_last_layer_outputs
                stream = fb.residual_stream
                h, stream.residual = prepare_attn(h, stream.residual, fb)
                if capture_gathered is not None:
                    capture_gathered.capture(stream.residual, owned=False)
                return h

            def finish(self, h, fb):
                return h

        class FfnExit:
            def __enter__(self) -> "FfnExit":
                return self

            def __exit__(self, *exc: Any) -> None:
                return None

            def finish(self, h: torch.Tensor) -> torch.Tensor:
                if sim._fuse(i):
                    h._sglang_needs_allreduce_fusion = True
                return h

        class FfnBoundary:
            def prepare(self, h, fb):
                stream = fb.residual_stream
                h, stream.residual = prepare_mlp(h, stream.residual, fb)
                return h

            def exit(self, fb):
                return FfnExit()

        layer = types.SimpleNamespace(
            layer_communicator=comm, self_attn=Attention(), nsa_enable_prefill_cp=False, dsa_enable_prefill_cp=False,
            mla_enable_prefill_cp=False, layer_scatter_modes=None, _gfx95_quant_format="", mlp=mlp,
            attn_boundary=AttnBoundary(), ffn_boundary=FfnBoundary(), _resolve_gfx95_quant_format=lambda: "")
        return lambda *a, **kw: layer_forward(layer, *a, **kw)

    # -- one forward pass
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Run the patched forward; returns what it returns (post-norm states, or with aux)."""
        positions = torch.cat([torch.arange(p.start, p.start + p.n) for p in fb.parts])
        out = self.model_forward(self.m, fb.input_ids, positions, fb)
        if isinstance(out, tuple):
            out, self.sglang_aux = out
        return out


def _function(cls: ast.ClassDef, name: str, ns: dict[str, Any]) -> Any:
    fn = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == name)
    fn = ast.fix_missing_locations(ast.Module(body=[_strip(fn)], type_ignores=[]))
    code = compile(fn, f"<patched {cls.name}.{name}>", "exec")
    local: dict[str, Any] = {}
    exec(code, ns, local)
    return local[name]


def _strip(fn: ast.FunctionDef) -> ast.FunctionDef:
    """Drop decorators and annotations (they name SGLang types we do not load)."""
    fn.decorator_list = []
    fn.returns = None
    for a in fn.args.args + fn.args.kwonlyargs:
        a.annotation = None
    return fn


@dataclass
class ReleaseCode:
    """A release's own files the harness runs besides its patched ``deepseek_v2.py``."""

    aux: Any = None                     # aux_hidden_states.py as a module (0.5.17 on: AuxHiddenStatePacker)
    communicator: Optional[str] = None  # communicator.py's source (the communicator family's capture step)

    @classmethod
    def read(cls, site: Path) -> "ReleaseCode":
        comm = site / "sglang/srt/layers/communicator.py"
        return cls(load_aux_module(site), comm.read_text() if comm.is_file() else None)


def load_aux_module(site: Path) -> Any:
    """The release's ``aux_hidden_states.py`` (torch only) loaded standalone; None before 0.5.17, which has none."""
    path = site / "sglang/srt/layers/aux_hidden_states.py"
    if not path.is_file() or "class AuxHiddenStatePacker" not in path.read_text():
        return None
    mod = types.ModuleType("aux_hidden_states")
    mod.__dict__["__name__"] = "aux_hidden_states"
    exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)
    return mod


def make_batch(sim_refs: dict[str, Reference], parts: list[Part], *, mode: str = "EXTEND",
               rids: bool = True) -> ForwardBatch:
    ids = torch.cat([sim_refs[p.req].ids[p.start:p.start + p.n] for p in parts])
    return ForwardBatch(ForwardMode(mode), ids, [p.n for p in parts], [p.start for p in parts], parts,
                        rids=[p.req for p in parts] if rids else None,
                        orig_seq_lens=torch.tensor([len(sim_refs[p.req].ids) for p in parts], dtype=torch.int32))
