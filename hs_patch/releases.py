"""The SGLang releases the patch supports and the exact edits it makes to each.

A release is recognised by the sha256 of its pristine ``deepseek_v2.py`` (read from the
released wheels; three pairs share one file: 0.5.10/0.5.10.post1, 0.5.12/0.5.12.post1,
0.5.13/0.5.13.post1, told apart by the installed version); the patched file's sha256 is
recorded too, so ``verify`` can tell an intact patch from a damaged one. Each edit
replaces one anchor that must occur exactly once in the pristine file, starting at the
line recorded for the release. Every inserted line carries or follows an ``hs_patch`` marker.

Releases are grouped into families by the code the patch touches (``Family.where`` says
where each captures: always the residual stream *entering* layer i, after the layer's input
communication, so the fully reduced state even where flashinfer fusion defers the previous
layer's all-reduce). A family writes its edits once, with ``<<slot>>`` names for the few
lines its releases spell differently; a release gives its own spelling in ``own``, and the
patched file names the release (``<<release>>``). The last layer's output is taken where
the final norm produces it. Per-release findings (lines, traps): docs/capture.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

TARGET = "sglang/srt/models/deepseek_v2.py"
# The regions of deepseek_v2.py the patch touches or depends on, compared by hs-patch status
# for a file no release has (hs_patch.host.patching.nearest): (class, method).
REGIONS = (("DeepseekV2DecoderLayer", "forward"), ("DeepseekV2Model", "__init__"), ("DeepseekV2Model", "forward"),
           ("DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture"))


@dataclass(frozen=True)
class Edit:
    anchor: str
    replacement: str


@dataclass(frozen=True)
class Family:
    name: str
    where: str                # where the capture sits, one sentence
    edits: tuple[Edit, ...]   # with <<piece>> slots
    pieces: Mapping[str, str] = field(default_factory=dict)  # the family's own spelling of each slot


@dataclass(frozen=True)
class Release:
    version: str
    family: Family
    pristine_sha256: str
    patched_sha256: str
    anchor_lines: tuple[int, ...]  # 1-based line where each edit's anchor starts in the pristine file
    regions: tuple[str, ...]       # sha256[:16] of each REGIONS source segment, pristine
    torch: str
    # The software stack the release runs on (read from its wheel and torch's metadata):
    # torch's CUDA build (the JIT kernels need a CUDA toolkit of that major version), and
    # packages installed over the resolved set with --no-deps (pip cannot override a pin).
    cuda: str
    own: Mapping[str, str] = field(default_factory=dict)  # this release's spelling of family slots
    pip_overrides: tuple[str, ...] = ()
    cudnn_min: int = 0  # lowest cuDNN torch must load (torch.backends.cudnn.version()); 0 = not checked
    # SGLang's own requirements replaced when resolving its dependencies (same package, a
    # version the package index serves as a wheel); see docs/deployment.md.
    replaces: tuple[str, ...] = ()

    @property
    def edits(self) -> tuple[Edit, ...]:
        slots = {**self.family.pieces, **self.own, "release": self.version}
        return tuple(Edit(_fill(e.anchor, slots), _fill(e.replacement, slots)) for e in self.family.edits)


def _fill(text: str, slots: Mapping[str, str]) -> str:
    for name, value in slots.items():
        text = text.replace(f"<<{name}>>", value)
    if "<<" in text and ">>" in text.partition("<<")[2]:
        raise ValueError(f"an edit slot has no value: {text.partition('<<')[2].partition('>>')[0]}")
    return text


# ------------------------------------------------------------------ the edits every family shares

_INIT = Edit(
    "        self.layers_to_capture = []\n",
    "        self.layers_to_capture = []\n"
    "        # hs_patch: hidden-state capture, off unless HS_CAPTURE=1 (see hs_patch.server.hook)\n"
    "        import os as _hs_os\n"
    "\n"
    "        self._hs_capture = None\n"
    '        if _hs_os.environ.get("HS_CAPTURE", "") not in ("", "0"):\n'
    "            from hs_patch.server.hook import attach as _hs_attach\n"
    "\n"
    '            self._hs_capture = _hs_attach(self, config, "<<release>>")\n',
)

_BEGIN = (
    "        _hs = (  # hs_patch: None unless this pass is a prefill to capture\n"
    "            self._hs_capture.begin(forward_batch, input_ids)\n"
    "            if self._hs_capture is not None\n"
    "            else None\n"
    "        )\n"
)

_RETURN = "        if len(aux_hidden_states) == 0:\n            return hidden_states\n"
_FINISH = Edit(
    _RETURN + "        return hidden_states, <<aux_return>>\n",
    "        if _hs is not None:  # hs_patch: hand the pass to the writer\n"
    "            _hs.finish(hidden_states)\n" + _RETURN + "        return hidden_states, <<aux_return>>\n",
)

_NORM = Edit(
    "                if residual is None:\n"
    "                    hidden_states = self.norm(hidden_states)\n"
    "                else:\n"
    "                    hidden_states, _ = self.norm(hidden_states, residual)\n",
    "                if residual is None:\n"
    "                    if _hs is not None:  # hs_patch: last layer's output, pre-norm\n"
    "                        _hs.final_prenorm(hidden_states)\n"
    "                    hidden_states = self.norm(hidden_states)\n"
    "                else:\n"
    "                    hidden_states, _hs_prenorm = self.norm(hidden_states, residual)\n"
    "                    if _hs is not None:  # hs_patch: last layer's output, pre-norm\n"
    "                        _hs.final_prenorm(_hs_prenorm)\n",
)

_COLLECTOR = (
    "                    captured_last_layer_outputs=(\n"
    "                        aux_hidden_states if i in self.layers_to_capture else None\n"
    "                    )\n"
    "                    if _hs is None\n"
    "                    else _hs.collector(  # hs_patch\n"
    "                        i, aux_hidden_states if i in self.layers_to_capture else None\n"
    "                    ),\n"
)

# ------------------------------------------------------------------ families

LAYER_POINT = Family(
    name="layer-point",
    where="a capture point the patch adds to DeepseekV2DecoderLayer.forward, right after prepare_attn (which "
          "completes an all-reduce flashinfer fusion deferred from the previous layer; SGLang's own EAGLE-3 capture, "
          "hidden_states + residual in the model loop, is a per-rank partial sum then)",
    pieces={
        "layer_args_end": "        prev_topk_indices: Optional[torch.Tensor] = None,\n",
        "quant_arg": '            getattr(self, "_gfx95_quant_format", ""),\n',
        "layer_call_end": "                    prev_topk_indices=topk_indices,\n",
    },
    edits=(
        # DeepseekV2DecoderLayer.forward: a capture point after the input communication
        Edit(
            "<<layer_args_end>>    ) -> torch.Tensor:\n",
            "<<layer_args_end>>"
            "        captured_last_layer_outputs: Optional[Any] = None,  # hs_patch\n"
            "    ) -> torch.Tensor:\n",
        ),
        Edit(
            "        hidden_states, residual = self.layer_communicator.prepare_attn(\n"
            "            hidden_states,\n"
            "            residual,\n"
            "            forward_batch,\n"
            "<<quant_arg>>"
            "        )\n",
            "        hidden_states, residual = self.layer_communicator.prepare_attn(\n"
            "            hidden_states,\n"
            "            residual,\n"
            "            forward_batch,\n"
            "<<quant_arg>>"
            "        )\n"
            "        if captured_last_layer_outputs is not None:  # hs_patch: the reduced input\n"
            "            captured_last_layer_outputs.capture(residual)\n",
        ),
        _INIT,
        Edit("        aux_hidden_states = []\n", "        aux_hidden_states = []\n" + _BEGIN),
        Edit(
            "<<layer_call_end>>                )\n",
            "<<layer_call_end>>"
            "                    captured_last_layer_outputs=(\n"
            "                        None if _hs is None else _hs.collector(i, None)  # hs_patch\n"
            "                    ),\n"
            "                )\n",
        ),
        _NORM,
        Edit(_FINISH.anchor.replace("<<aux_return>>", "aux_hidden_states"),
             _FINISH.replacement.replace("<<aux_return>>", "aux_hidden_states")),
    ),
)

COMMUNICATOR = Family(
    name="communicator",
    where="the layer's own captured_last_layer_outputs, filled by "
          "LayerCommunicator.prepare_attn_and_capture_last_layer_outputs (SGLang's EAGLE-3 path)",
    pieces={
        "aux_init": "        aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))\n",
        "aux_return": "aux_hidden_states.finalize()",
    },
    edits=(
        _INIT,
        Edit("<<aux_init>>", "<<aux_init>>" + _BEGIN),
        Edit(
            "                    captured_last_layer_outputs=(\n"
            "                        aux_hidden_states if i in self.layers_to_capture else None\n"
            "                    ),\n",
            _COLLECTOR,
        ),
        _NORM,
        _FINISH,
    ),
)

LAYER_BOUNDARY = Family(
    name="layer-boundary",
    where="the collector layer_boundary/stage.py hands the gathered residual to, capture(value, owned=) (the "
          "residual is carried in forward_batch.residual_stream)",
    pieces={"final_norm": "final_norm", "capture_kw": "capture"},
    edits=(
        _INIT,
        Edit("        aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))\n",
             "        aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))\n" + _BEGIN),
        Edit(
            "                    captured_last_layer_outputs=aux_hidden_states\n"
            "                    if i in self.layers_to_capture\n"
            "                    else None,\n",
            _COLLECTOR,
        ),
        Edit(
            "                hidden_states = residual_batch.<<final_norm>>(\n"
            "                    hidden_states, forward_batch, self.norm\n"
            "                )\n",
            "                hidden_states = residual_batch.<<final_norm>>(\n"
            "                    hidden_states,\n"
            "                    forward_batch,\n"
            "                    self.norm,\n"
            "                    <<capture_kw>>=None if _hs is None else _hs.final_prenorm,  # hs_patch\n"
            "                )\n",
        ),
        Edit(_FINISH.anchor.replace("<<aux_return>>", "aux_hidden_states.finalize()"),
             _FINISH.replacement.replace("<<aux_return>>", "aux_hidden_states.finalize()")),
    ),
)

FAMILIES = (LAYER_POINT, COMMUNICATOR, LAYER_BOUNDARY)

# ------------------------------------------------------------------ each release's own spelling

# 0.5.9 .. 0.5.10.post1 pass the layer's local quant_format to prepare_attn; 0.5.9 also has no
# top-k indices (no prev_topk_indices argument, the layer returns two values).
_LOCAL_QUANT = {"quant_arg": "            quant_format,\n"}
_NO_TOPK = {**_LOCAL_QUANT, "layer_args_end": "        llama_4_scaling: Optional[torch.Tensor] = None,\n",
            "layer_call_end": "                    llama_4_scaling,\n"}
# 0.5.14 .. 0.5.16 collect SGLang's EAGLE-3 states into a list (AuxHiddenStatePacker from 0.5.17).
_LIST = {"aux_init": "        aux_hidden_states = []\n        if self.pp_group.is_first_rank:\n"
                     "            topk_indices = None\n",
         "aux_return": "aux_hidden_states"}
# 0.5.21 names the residual stream's final norm `norm` and its callback `capture_output`.
_NORM_0_5_21 = {"final_norm": "norm", "capture_kw": "capture_output"}
# 0.5.9 refuses a multimodal model (Kimi-K2.5) on torch 2.9.1 with cuDNN < 9.15
# (server_args.check_torch_2_9_1_cudnn_compatibility); torch 2.9.1 pins nvidia-cudnn-cu12==9.10.2.21.
_CUDNN_0_5_9 = {"pip_overrides": ("nvidia-cudnn-cu12==9.16.0.29",), "cudnn_min": 91500}
# 0.5.18 .. 0.5.22 pin cuda-tile==1.6.0rc5, which PyPI serves only as a stub that downloads the
# wheel from pypi.nvidia.com while installing; 1.6.0 is the same release line as a wheel on PyPI
# (cuda-tile is used by the Kimi-Linear KDA kernel only, never by DeepSeek-V3/Kimi-K2.5).
_CUDA_TILE = {"replaces": ("cuda-tile==1.6.0",)}


def _r(version: str, family: Family, torch: str, cuda: str, lines: tuple[int, ...], pristine: str, patched: str,
       regions: str, own: Mapping[str, str] | None = None, **stack) -> Release:
    return Release(version=version, family=family, pristine_sha256=pristine, patched_sha256=patched,
                   anchor_lines=lines, regions=tuple(regions.split()), torch=torch, cuda=cuda, own=own or {}, **stack)


_ALL = (
    _r("0.5.9", LAYER_POINT, "2.9.1", "12.8", (2359, 2388, 2631, 2712, 2737, 2763, 2776),
       "4071b9a6a6ac71e1143204708df42f2ba5bd163a5d7a020579242df56e490a35",
       "00a92c19ee8381fce8b2a2b2504cffe39936fc759f1fbfec30f6fc4893170a66",
       "02704ce003cf7da6 94bc6503d336d5f9 da94dec82a34837c 43d2438064a5fffc", own=_NO_TOPK, **_CUDNN_0_5_9),
    _r("0.5.10", LAYER_POINT, "2.9.1", "12.8", (1682, 1711, 1962, 2042, 2069, 2095, 2108),
       "ace3cfb8eeb74f21bbfb9463b5cc0be3682232989f0a12472ef533ec618af67e",
       "6b6fffe0d1fa39578b504ca1c1893f45296f1b46e769f583ed1fcc96bdf87fdd",
       "64dfcee64ba5789b 94bc6503d336d5f9 3cb747e8066fb26a 43d2438064a5fffc", own=_LOCAL_QUANT),
    _r("0.5.10.post1", LAYER_POINT, "2.9.1", "12.8", (1682, 1711, 1962, 2042, 2069, 2095, 2108),
       "ace3cfb8eeb74f21bbfb9463b5cc0be3682232989f0a12472ef533ec618af67e",
       "df485edcf0711ea7b6f282345ccdab97d6ce5ee9ee25c8ad38e61ec8eaeeec9f",
       "64dfcee64ba5789b 94bc6503d336d5f9 3cb747e8066fb26a 43d2438064a5fffc", own=_LOCAL_QUANT),
    _r("0.5.11", LAYER_POINT, "2.11.0", "13.0", (1761, 1763, 2009, 2089, 2116, 2142, 2155),
       "505a213c65a30389ca36d6d0ba56990530a979d95dc2e3b30b46a962b7db1bf5",
       "56b8635aefdf3bcd87de9caad8883f538bd922481475ae4e4187a16a07d712c4",
       "4f569dd8ddc9db91 77da60ef97250df8 3cb747e8066fb26a 43d2438064a5fffc"),
    _r("0.5.12", LAYER_POINT, "2.11.0", "13.0", (1932, 1934, 2185, 2265, 2292, 2318, 2331),
       "3947d605e2ffeafb2d20baa2d87490d02a5671df0eb7bd0527ec60581580a49c",
       "d9579a1a0e28656d7a1af84d9fa557aa8019afb19f49d96f581bd20852f1c4f6",
       "4f569dd8ddc9db91 732b0b7ccfbe5317 3cb747e8066fb26a 43d2438064a5fffc"),
    _r("0.5.12.post1", LAYER_POINT, "2.11.0", "13.0", (1932, 1934, 2185, 2265, 2292, 2318, 2331),
       "3947d605e2ffeafb2d20baa2d87490d02a5671df0eb7bd0527ec60581580a49c",
       "bb39acf04009012e1a50dc0e05916ea21929504d5fececa7cbc73642379c4019",
       "4f569dd8ddc9db91 732b0b7ccfbe5317 3cb747e8066fb26a 43d2438064a5fffc"),
    _r("0.5.13", LAYER_POINT, "2.11.0", "13.0", (2092, 2095, 2354, 2436, 2463, 2489, 2505),
       "c8f6670afa18ec5cb388e9891f6c73fd65e46392930f0ef4d1f0ea5981503222",
       "4ae4e5edeeef05220e6b63e74fe51634d8f0be379faa50adab43871f9275f43d",
       "c6a42f98c1e1efad ad854453c1b076ea a0b04776fd1ca4bb 6a8658cfa84ca290"),
    _r("0.5.13.post1", LAYER_POINT, "2.11.0", "13.0", (2092, 2095, 2354, 2436, 2463, 2489, 2505),
       "c8f6670afa18ec5cb388e9891f6c73fd65e46392930f0ef4d1f0ea5981503222",
       "895be9a08e9c55a1afa789fdc5103f37d7a2a73a708850c848d5b8c804a488ab",
       "c6a42f98c1e1efad ad854453c1b076ea a0b04776fd1ca4bb 6a8658cfa84ca290"),
    _r("0.5.14", COMMUNICATOR, "2.11.0", "13.0", (2378, 2480, 2501, 2548, 2564),
       "947fdc256101f538a668090f82e5eb5f888e2434f2bbbf69a99cdaa628cf902e",
       "fa8a369c567e40de0e9eedfcf4f1563b5d435a96379728620c4d34e9737e82bc",
       "a8e748f2025d8e91 099285ac981b6ee3 8b6e05f2b7ae2b94 6a8658cfa84ca290", own=_LIST),
    _r("0.5.15", COMMUNICATOR, "2.11.0", "13.0", (2471, 2573, 2594, 2641, 2657),
       "c19120d6daa4e8003ffd0e17f593c9cacd9c30b6cea1f2cc6139ed910749ee31",
       "85c6e6d611996dd0130443f7b0154827ad1adf70b7af889ae79786f12834bd67",
       "a8e748f2025d8e91 099285ac981b6ee3 8b6e05f2b7ae2b94 6a8658cfa84ca290", own=_LIST),
    _r("0.5.15.post1", COMMUNICATOR, "2.11.0", "13.0", (2479, 2581, 2602, 2649, 2665),
       "a73242802d810bf7fabe45303909eb015c00aeec567a46b404f6583e26e2a237",
       "9ef1c7c2f48163e231ee70fb102a8a0530d7f0acd8a7e37383a4349133dc7194",
       "a8e748f2025d8e91 099285ac981b6ee3 8b6e05f2b7ae2b94 6a8658cfa84ca290", own=_LIST),
    _r("0.5.16", COMMUNICATOR, "2.11.0", "13.0", (2485, 2591, 2612, 2662, 2675),
       "47709951b15d7ac494c25f079a242c17375a8ee01007c829ea0c9ab604794689",
       "ad4c847201ed5b1bcb6026c75825735be3cffecac32f12211fbd0d8ed464d214",
       "5e76aa2294317b3d 55f3f5fc8320e0c0 e5a81a4ee5407773 6a8658cfa84ca290", own=_LIST),
    _r("0.5.17", COMMUNICATOR, "2.11.0", "13.0", (2697, 2804, 2825, 2875, 2888),
       "e73c033416e8746bb435dd4e7d39ead521039c511182b5f8b536a40a3308d08a",
       "10ef72e1e6ee0dc51b5756050c7f0edc06bc65b858728761ae508c2369ca6449",
       "809cac2eacb5b50a 55f3f5fc8320e0c0 920027cd1a9737f1 6a8658cfa84ca290"),
    _r("0.5.18", COMMUNICATOR, "2.13.0", "13.0", (2726, 2836, 2855, 2907, 2920),
       "d61238da43a34df8ee324b1c3d36082894aa75b34775a1af7772c2a6c016c932",
       "9b13f78e090505f52f44b8975b070f36f9f6d7c6a5950b85555371050ff1d986",
       "ff8a53da159055b2 55f3f5fc8320e0c0 3567faaca0fc9a61 6a8658cfa84ca290", **_CUDA_TILE),
    _r("0.5.19", COMMUNICATOR, "2.13.0", "13.0", (2768, 2879, 2898, 2950, 2963),
       "8fa0cfb8e8d61b7e41680fb19a3d83bd00e0a1c2d7403b42e0a0db259b308c0b",
       "9be3ddbcc4ca4755eb2b88ebdf0c384b4029e2d50cecc669188883d6fefabeb7",
       "ff8a53da159055b2 4f472598d88a2e3f 3567faaca0fc9a61 6a8658cfa84ca290", **_CUDA_TILE),
    _r("0.5.20", COMMUNICATOR, "2.13.0", "13.0", (2705, 2805, 2824, 2876, 2881),
       "1578dd16dd71b78b95d4a5625f22a152fbdb6822ac6b38a4f24d106464c2831f",
       "43c2a173fe9f6e14dcf3ec3f9fb5365ca8f832a624347b7ed0199d5621df2710",
       "6199942607277708 9cd1eb3467380c13 ac6dfffa7fd5f1d1 6a8658cfa84ca290", **_CUDA_TILE),
    _r("0.5.21", LAYER_BOUNDARY, "2.13.0", "13.0", (2971, 3095, 3113, 3159, 3163),
       "74f67224cc3d3edcf465bea54af572ebd3b4fb9e784a6a38a445e59db6c58d7b",
       "1dfe70f511467cd442d46a00b8f30a9d8921b3d38c113cc7859d4dfb63c69b32",
       "b02784216d0b9512 855f91b7b4fcacea 40bb11dd17fa742f 6a8658cfa84ca290", own=_NORM_0_5_21, **_CUDA_TILE),
    _r("0.5.22", LAYER_BOUNDARY, "2.14.1", "13.0", (2997, 3121, 3139, 3185, 3189),
       "1edf877e54ca6acf37e2d7dccb1704054175e2b78b8737bb9b617ffc97a2134e",
       "3210d902c76b0a6b77e8cb1d0e6c8f42dd0b677b8b1b43e9980e186a26737934",
       "b43660f61bf8022a dcf744a642bdda16 145da1024626fab9 6a8658cfa84ca290", **_CUDA_TILE),
    _r("0.5.23", LAYER_BOUNDARY, "2.14.1", "13.0", (3051, 3175, 3193, 3239, 3243),
       "f61f93019bf1e7680f45a1fe227244433e1b22021cb955e53d25b9cf900473f9",
       "e163069eec8504e4f4140bb266ae8723a3a4b0c031dbed0d9a3e96bcbafcb7a8",
       "b43660f61bf8022a dcf744a642bdda16 e02cee2a6665035c 6a8658cfa84ca290"),
)

RELEASES = {r.version: r for r in _ALL}
DEFAULT_RELEASE = "0.5.9"


def by_pristine_sha(sha: str, installed: str | None = None) -> Release | None:
    """The release whose pristine file has ``sha``; where several share it, the installed one."""
    found = [r for r in RELEASES.values() if r.pristine_sha256 == sha]
    return next((r for r in found if r.version == installed), found[0] if found else None)


def by_patched_sha(sha: str) -> Release | None:
    return next((r for r in RELEASES.values() if r.patched_sha256 == sha), None)


# hs-patch 0.1.0 kept the hook at ``hs_patch.hook``; a file it patched differs from
# today's patched file only in these lines. ``apply`` upgrades such a file, ``revert``
# restores its original, ``verify`` fails on it (its import no longer exists).
_EARLIER_LAYOUT = (("(see hs_patch.hook)", "(see hs_patch.server.hook)"),
                   ("from hs_patch.hook import attach", "from hs_patch.server.hook import attach"))


def from_earlier_layout(text: str) -> str:
    """``text`` with the lines an earlier hs-patch layout wrote replaced by today's."""
    for old, new in _EARLIER_LAYOUT:
        text = text.replace(old, new)
    return text


class PatchError(Exception):
    """The pristine text does not have an anchor exactly once, where the release says."""


def anchor_lines(release: Release, text: str) -> tuple[int, ...]:
    """The 1-based line where each of ``release``'s anchors starts in ``text``; raises unless each occurs once."""
    out = []
    for n, edit in enumerate(release.edits, 1):
        count = text.count(edit.anchor)
        if count != 1:
            raise PatchError(f"edit {n} of {release.version}: anchor found {count} times, expected once")
        out.append(text[: text.index(edit.anchor)].count("\n") + 1)
    return tuple(out)


def apply_edits(release: Release, text: str) -> str:
    """The patched text of ``release``'s pristine ``deepseek_v2.py``."""
    found = anchor_lines(release, text)
    if release.anchor_lines and found != release.anchor_lines:
        raise PatchError(f"{release.version}: anchors start at lines {list(found)}, the release records "
                         f"{list(release.anchor_lines)}")
    for edit in release.edits:
        text = text.replace(edit.anchor, edit.replacement)
    return text
