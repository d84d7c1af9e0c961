"""The SGLang releases the patch supports and the exact edits it makes to each.

A release is recognised by the sha256 of its pristine ``deepseek_v2.py`` (from its wheel;
three pairs share one file, told apart by the installed version); the patched file's sha256
is recorded too, so ``verify`` can tell an intact patch from a damaged one. Each edit
replaces one anchor that must occur exactly once in the pristine file, at the line recorded.

Releases are grouped into families by the code the patch touches; the families and the code
each inserts are in :mod:`hs_patch.engine.families`, with ``<<slot>>`` names for the lines its
releases spell differently; a release here gives its family and its own spelling in ``own``.
Per-release findings: docs/capture.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from hs_patch.engine.families import COMMUNICATOR, LAYER_BOUNDARY, LAYER_POINT, Edit, Family

TARGET = "sglang/srt/models/deepseek_v2.py"
# The regions of deepseek_v2.py the patch touches or depends on, compared by hs-patch status
# for a file no release has (hs_patch.host.patching.nearest): (class, method).
REGIONS = (("DeepseekV2DecoderLayer", "forward"), ("DeepseekV2Model", "__init__"), ("DeepseekV2Model", "forward"),
           ("DeepseekV2ForCausalLM", "set_eagle3_layers_to_capture"))


@dataclass(frozen=True)
class Release:
    version: str
    family: Family
    pristine_sha256: str
    patched_sha256: str
    anchor_lines: tuple[int, ...]  # 1-based line where each edit's anchor starts in the pristine file
    regions: tuple[str, ...]       # sha256[:8] of each REGIONS source segment, pristine
    # The stack it runs on (its wheel's and torch's metadata): torch, torch's CUDA build (the JIT
    # kernels need that toolkit), packages put over the resolved set with --no-deps (pip cannot
    # override a pin), the cuDNN torch must then load, SGLang requirements replaced (deployment.md).
    torch: str
    cuda: str
    own: Mapping[str, str] = field(default_factory=dict)  # this release's spelling of family slots
    pip_overrides: tuple[str, ...] = ()
    cudnn_min: int = 0  # torch.backends.cudnn.version(); 0 = not checked
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
# 0.5.18 on resolve the gfx95 quant format with a method.
_QUANT_METHOD = {"quant_kw": "                quant_format=self._resolve_gfx95_quant_format(),\n"}
# 0.5.21 names the residual stream's final norm `norm` and its callback `capture_output`, and
# the layer's collector keyword `captured_last_layer_outputs`.
_NORM_0_5_21 = {"final_norm": "norm", "capture_kw": "capture_output", "gathered_kw": "captured_last_layer_outputs"}
# 0.5.9 refuses a multimodal model (Kimi-K2.5) on torch 2.9.1 with cuDNN < 9.15
# (server_args.check_torch_2_9_1_cudnn_compatibility); torch 2.9.1 pins nvidia-cudnn-cu12==9.10.2.21.
_CUDNN_0_5_9 = {"pip_overrides": ("nvidia-cudnn-cu12==9.16.0.29",), "cudnn_min": 91500}
# 0.5.18 .. 0.5.22 pin cuda-tile==1.6.0rc5, which PyPI serves only as a stub that downloads the
# wheel from pypi.nvidia.com while installing; 1.6.0 is the same release line as a wheel on PyPI
# (cuda-tile is used by the Kimi-Linear KDA kernel only, never by DeepSeek-V3/Kimi-K2.5).
_CUDA_TILE = {"replaces": ("cuda-tile==1.6.0",)}


def _r(version: str, family: Family, torch: str, cuda: str, pristine: str, patched: str, regions: str,
       lines: tuple[int, ...], own: Mapping[str, str] | None = None, **stack) -> Release:
    return Release(version=version, family=family, pristine_sha256=pristine, patched_sha256=patched,
                   anchor_lines=lines, regions=tuple(regions.split()), torch=torch, cuda=cuda, own=own or {}, **stack)


_ALL = (
    _r("0.5.9", LAYER_POINT, "2.9.1", "12.8", "4071b9a6a6ac71e1143204708df42f2ba5bd163a5d7a020579242df56e490a35",
       "826163be8c627018f8455f75e091dbaf1269abad9fc3ef6aa116fc6e2042ca7b", "02704ce0 94bc6503 da94dec8 43d24380",
       (2359, 2388, 2403, 2631, 2712, 2737, 2763, 2776), own=_NO_TOPK, **_CUDNN_0_5_9),
    _r("0.5.10", LAYER_POINT, "2.9.1", "12.8", "ace3cfb8eeb74f21bbfb9463b5cc0be3682232989f0a12472ef533ec618af67e",
       "6b797f8c0cfb10903693ccf19aae505f3e4323fcf366444001e2a5415c059187", "64dfcee6 94bc6503 3cb747e8 43d24380",
       (1682, 1711, 1732, 1962, 2042, 2069, 2095, 2108), own=_LOCAL_QUANT),
    _r("0.5.10.post1", LAYER_POINT, "2.9.1", "12.8", "ace3cfb8eeb74f21bbfb9463b5cc0be3682232989f0a12472ef533ec618af67e",
       "c339d2c369731167f92c310941e0c35f61911c7e463efe389fb919a63a26d75f", "64dfcee6 94bc6503 3cb747e8 43d24380",
       (1682, 1711, 1732, 1962, 2042, 2069, 2095, 2108), own=_LOCAL_QUANT),
    _r("0.5.11", LAYER_POINT, "2.11.0", "13.0", "505a213c65a30389ca36d6d0ba56990530a979d95dc2e3b30b46a962b7db1bf5",
       "1cdae51fcdf8d33ad31c325e8f5550d37f77c5e81a6c69624bb1376e9429e4d7", "4f569dd8 77da60ef 3cb747e8 43d24380",
       (1761, 1763, 1784, 2009, 2089, 2116, 2142, 2155)),
    _r("0.5.12", LAYER_POINT, "2.11.0", "13.0", "3947d605e2ffeafb2d20baa2d87490d02a5671df0eb7bd0527ec60581580a49c",
       "f40c7b65cfad4e1ed97456ee5f80f216ae8274fc5be5394c40cff4e7a4e8eb62", "4f569dd8 732b0b7c 3cb747e8 43d24380",
       (1932, 1934, 1955, 2185, 2265, 2292, 2318, 2331)),
    _r("0.5.12.post1", LAYER_POINT, "2.11.0", "13.0", "3947d605e2ffeafb2d20baa2d87490d02a5671df0eb7bd0527ec60581580a49c",
       "1955db7fcf9c037e5aaee9fb2a7545ab59b63c08f517fefb809dec27740bfcb7", "4f569dd8 732b0b7c 3cb747e8 43d24380",
       (1932, 1934, 1955, 2185, 2265, 2292, 2318, 2331)),
    _r("0.5.13", LAYER_POINT, "2.11.0", "13.0", "c8f6670afa18ec5cb388e9891f6c73fd65e46392930f0ef4d1f0ea5981503222",
       "2a1735158ae894312f3c3c7954f1ae92b0e5fe999b98a51f0a33377c5b67aa30", "c6a42f98 ad854453 a0b04776 6a8658cf",
       (2092, 2095, 2117, 2354, 2436, 2463, 2489, 2505)),
    _r("0.5.13.post1", LAYER_POINT, "2.11.0", "13.0", "c8f6670afa18ec5cb388e9891f6c73fd65e46392930f0ef4d1f0ea5981503222",
       "5b950179884ca0672246e25a5411caf70a45c1587213968d48c1fa39eb06e5c1", "c6a42f98 ad854453 a0b04776 6a8658cf",
       (2092, 2095, 2117, 2354, 2436, 2463, 2489, 2505)),
    _r("0.5.14", COMMUNICATOR, "2.11.0", "13.0", "947fdc256101f538a668090f82e5eb5f888e2434f2bbbf69a99cdaa628cf902e",
       "2bba21e2c2c7ecf6d79f47b4b02c9663c99c6202549cc27cf6d3e6736cf6c726", "a8e748f2 099285ac 8b6e05f2 6a8658cf",
       (2378, 2116, 2141, 2480, 2501, 2548, 2564), own=_LIST),
    _r("0.5.15", COMMUNICATOR, "2.11.0", "13.0", "c19120d6daa4e8003ffd0e17f593c9cacd9c30b6cea1f2cc6139ed910749ee31",
       "3fc5cafa301e36d9fb59fc21b81d9d57dc1426c3413075fc86405df0722e5a24", "a8e748f2 099285ac 8b6e05f2 6a8658cf",
       (2471, 2209, 2234, 2573, 2594, 2641, 2657), own=_LIST),
    _r("0.5.15.post1", COMMUNICATOR, "2.11.0", "13.0", "a73242802d810bf7fabe45303909eb015c00aeec567a46b404f6583e26e2a237",
       "b83f9b4cd99d119ddd9612b179d032c109182136991d88775c9b0083aae5fa11", "a8e748f2 099285ac 8b6e05f2 6a8658cf",
       (2479, 2217, 2242, 2581, 2602, 2649, 2665), own=_LIST),
    _r("0.5.16", COMMUNICATOR, "2.11.0", "13.0", "47709951b15d7ac494c25f079a242c17375a8ee01007c829ea0c9ab604794689",
       "889b48ab9846686eddf89de38041f465acfa83256747b2fc8640f925a610270a", "5e76aa22 55f3f5fc e5a81a4e 6a8658cf",
       (2485, 2212, 2241, 2591, 2612, 2662, 2675), own=_LIST),
    _r("0.5.17", COMMUNICATOR, "2.11.0", "13.0", "e73c033416e8746bb435dd4e7d39ead521039c511182b5f8b536a40a3308d08a",
       "8a932f92e904f8c6754742f5f4607bb0a797eac065ea35473e28505370b43914", "809cac2e 55f3f5fc 920027cd 6a8658cf",
       (2697, 2423, 2453, 2804, 2825, 2875, 2888)),
    _r("0.5.18", COMMUNICATOR, "2.13.0", "13.0", "d61238da43a34df8ee324b1c3d36082894aa75b34775a1af7772c2a6c016c932",
       "33c7c4b1720703bd990c05c5b178e70db5697de0a9fe6bf42c0fd48d268b83d5", "ff8a53da 55f3f5fc 3567faac 6a8658cf",
       (2726, 2452, 2482, 2836, 2855, 2907, 2920), own=_QUANT_METHOD, **_CUDA_TILE),
    _r("0.5.19", COMMUNICATOR, "2.13.0", "13.0", "8fa0cfb8e8d61b7e41680fb19a3d83bd00e0a1c2d7403b42e0a0db259b308c0b",
       "d40085164b18f5b6da181c75d1bc136a73abbd9d55dd609c76f2323040eda703", "ff8a53da 4f472598 3567faac 6a8658cf",
       (2768, 2489, 2519, 2879, 2898, 2950, 2963), own=_QUANT_METHOD, **_CUDA_TILE),
    _r("0.5.20", COMMUNICATOR, "2.13.0", "13.0", "1578dd16dd71b78b95d4a5625f22a152fbdb6822ac6b38a4f24d106464c2831f",
       "15294fa7ac4cb5c1cfc008007428f3b2f92c863284fb0b1f8e860ede70835eb2", "61999426 9cd1eb34 ac6dfffa 6a8658cf",
       (2705, 2438, 2468, 2805, 2824, 2876, 2881), own=_QUANT_METHOD, **_CUDA_TILE),
    _r("0.5.21", LAYER_BOUNDARY, "2.13.0", "13.0", "74f67224cc3d3edcf465bea54af572ebd3b4fb9e784a6a38a445e59db6c58d7b",
       "0232d565cfeac417ca3948fad138ad2ca300e979a22d45b68364e16c50e46f5c", "b0278421 855f91b7 40bb11dd 6a8658cf",
       (2971, 2724, 2753, 3095, 3113, 3159, 3163), own=_NORM_0_5_21, **_CUDA_TILE),
    _r("0.5.22", LAYER_BOUNDARY, "2.14.1", "13.0", "1edf877e54ca6acf37e2d7dccb1704054175e2b78b8737bb9b617ffc97a2134e",
       "49a9db9a790ab6d2a546d063bfbf00ab16f835512483f7be96dc569a3311630e", "b43660f6 dcf744a6 145da102 6a8658cf",
       (2997, 2753, 2780, 3121, 3139, 3185, 3189), **_CUDA_TILE),
    _r("0.5.23", LAYER_BOUNDARY, "2.14.1", "13.0", "f61f93019bf1e7680f45a1fe227244433e1b22021cb955e53d25b9cf900473f9",
       "5147b04660f2a5b88fa888e5fd99dc17eeefc698717b3e849c9796a475075347", "b43660f6 dcf744a6 e02cee2a 6a8658cf",
       (3051, 2807, 2834, 3175, 3193, 3239, 3243)),
)

RELEASES = {r.version: r for r in _ALL}
DEFAULT_RELEASE = "0.5.9"


def by_pristine_sha(sha: str, installed: str | None = None) -> Release | None:
    """The release whose pristine file has ``sha``; where several share it, the installed one."""
    found = [r for r in RELEASES.values() if r.pristine_sha256 == sha]
    return next((r for r in found if r.version == installed), found[0] if found else None)


def by_patched_sha(sha: str) -> Release | None:
    return next((r for r in RELEASES.values() if r.patched_sha256 == sha), None)


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


def pristine_text(release: Release, patched: str) -> str:
    """Undo the edits (each replacement occurs exactly once in the patched text)."""
    for edit in reversed(release.edits):
        if patched.count(edit.replacement) != 1:
            raise PatchError(f"cannot undo an edit of {release.version}: the patched text was changed")
        patched = patched.replace(edit.replacement, edit.anchor)
    return patched
