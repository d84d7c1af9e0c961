"""The SGLang releases the patch supports and the exact edits it makes to each.

A release is recognised by the sha256 of its pristine ``deepseek_v2.py`` (read from the
released wheels); the patched file's sha256 is recorded too, so ``verify`` can tell an
intact patch from a damaged one. Each edit replaces one anchor that must occur exactly
once in the pristine file. Every inserted line carries or follows an ``hs_patch`` marker.

Where the capture sits, per release (all capture the residual stream *entering* layer i,
after the layer's input communication, so it is the fully reduced state):

- 0.5.9: the decoder layer has no capture point, so the patch adds one right after
  ``prepare_attn`` (which completes any all-reduce deferred by flashinfer fusion: the
  trap where ``hidden_states + residual`` in the model loop is a per-rank partial sum).
- 0.5.16: the layer's own ``captured_last_layer_outputs`` list (EAGLE-3's path).
- 0.5.23: the layer's ``capture_gathered`` collector (``AuxHiddenStatePacker`` path).

The last layer's output is taken where the final norm produces it (pre-norm residual
and post-norm output), and SGLang's own EAGLE-3 capture keeps working alongside. Each
captured layer also hands the hook what its attention reads (the layer's normed input):
the fidelity check proves with it that the stored residual is that layer's, fully reduced
(:mod:`hs_patch.server.fingerprint`).
"""

from __future__ import annotations

from dataclasses import dataclass

TARGET = "sglang/srt/models/deepseek_v2.py"


@dataclass(frozen=True)
class Edit:
    anchor: str
    replacement: str


@dataclass(frozen=True)
class Release:
    version: str
    torch: str
    pristine_sha256: str
    patched_sha256: str
    edits: tuple[Edit, ...]
    # The software stack the release runs on (read from its wheel and torch's metadata):
    # torch's CUDA build (the JIT kernels need a CUDA toolkit of that major version), and
    # packages installed over the resolved set with --no-deps (pip cannot override a pin).
    cuda: str = ""
    pip_overrides: tuple[str, ...] = ()


def _init_block(version: str) -> Edit:
    return Edit(
        "        self.layers_to_capture = []\n",
        "        self.layers_to_capture = []\n"
        "        # hs_patch: hidden-state capture, off unless HS_CAPTURE=1 (see hs_patch.server.hook)\n"
        "        import os as _hs_os\n"
        "\n"
        "        self._hs_capture = None\n"
        '        if _hs_os.environ.get("HS_CAPTURE", "") not in ("", "0"):\n'
        "            from hs_patch.server.hook import attach as _hs_attach\n"
        "\n"
        f'            self._hs_capture = _hs_attach(self, config, "{version}")\n',
    )


_BEGIN = (
    "        _hs = (  # hs_patch: None unless this pass is a prefill to capture\n"
    "            self._hs_capture.begin(forward_batch, input_ids)\n"
    "            if self._hs_capture is not None\n"
    "            else None\n"
    "        )\n"
)

_FINISH = (
    "        if _hs is not None:  # hs_patch: hand the pass to the writer\n"
    "            _hs.finish(hidden_states)\n"
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

_COLLECTOR_NEW = (
    "                    captured_last_layer_outputs=(\n"
    "                        aux_hidden_states if i in self.layers_to_capture else None\n"
    "                    )\n"
    "                    if _hs is None\n"
    "                    else _hs.collector(  # hs_patch\n"
    "                        i, aux_hidden_states if i in self.layers_to_capture else None\n"
    "                    ),\n"
)

_RETURN = "        if len(aux_hidden_states) == 0:\n            return hidden_states\n"


# DeepseekV2DecoderLayer.forward: the layer's input communication and norm, after which
# ``hidden_states`` is what the layer's attention reads. The patch hands it to the hook's
# collector (only ours has ``hs_attn_input``; SGLang's own EAGLE-3 collectors and None do not):
# the host checks that the captured residual, normalised with this layer's norm weight, is it
# (hs_patch.server.fingerprint).
_PREPARE_0_5_16 = (
    "        hidden_states, residual = (\n"
    "            self.layer_communicator.prepare_attn_and_capture_last_layer_outputs(\n"
    "                hidden_states,\n"
    "                residual,\n"
    "                forward_batch,\n"
    "                captured_last_layer_outputs=captured_last_layer_outputs,\n"
    '                quant_format=getattr(self, "_gfx95_quant_format", ""),\n'
    "            )\n"
    "        )\n"
)

_PREPARE_0_5_23 = (
    "        hidden_states = self.attn_boundary.prepare(\n"
    "            hidden_states,\n"
    "            forward_batch,\n"
    "            capture_gathered=captured_last_layer_outputs,\n"
    "            quant_format=self._resolve_gfx95_quant_format(),\n"
    "        )\n"
)

_ATTN_INPUT = (
    "        if captured_last_layer_outputs is not None and hasattr(  # hs_patch: what attention reads\n"
    '            captured_last_layer_outputs, "hs_attn_input"\n'
    "        ):\n"
    "            captured_last_layer_outputs.hs_attn_input(hidden_states)\n"
)


def _finish(ret_tail: str) -> Edit:
    return Edit(_RETURN + ret_tail, _FINISH + _RETURN + ret_tail)


V0_5_9 = Release(
    version="0.5.9",
    torch="2.9.1",
    cuda="12.8",
    # server_args.check_torch_2_9_1_cudnn_compatibility refuses a multimodal model (Kimi-K2.5)
    # on torch 2.9.1 with cuDNN < 9.15; torch 2.9.1 pins nvidia-cudnn-cu12==9.10.2.21.
    pip_overrides=("nvidia-cudnn-cu12==9.16.0.29",),
    pristine_sha256="4071b9a6a6ac71e1143204708df42f2ba5bd163a5d7a020579242df56e490a35",
    patched_sha256="b701133b9abce8136c4b4ed632813156058ce1cea158f9f716b719401e1bd5c0",
    edits=(
        # DeepseekV2DecoderLayer.forward: a capture point after the input communication
        Edit(
            "        gemm_output_zero_allocator: BumpAllocator = None,\n"
            "        llama_4_scaling: Optional[torch.Tensor] = None,\n"
            "    ) -> torch.Tensor:\n"
            "        quant_format = (",
            "        gemm_output_zero_allocator: BumpAllocator = None,\n"
            "        llama_4_scaling: Optional[torch.Tensor] = None,\n"
            "        captured_last_layer_outputs: Optional[Any] = None,  # hs_patch\n"
            "    ) -> torch.Tensor:\n"
            "        quant_format = (",
        ),
        Edit(
            "        hidden_states, residual = self.layer_communicator.prepare_attn(\n"
            "            hidden_states,\n"
            "            residual,\n"
            "            forward_batch,\n"
            "            quant_format,\n"
            "        )\n",
            "        hidden_states, residual = self.layer_communicator.prepare_attn(\n"
            "            hidden_states,\n"
            "            residual,\n"
            "            forward_batch,\n"
            "            quant_format,\n"
            "        )\n"
            "        if captured_last_layer_outputs is not None:  # hs_patch: the reduced input\n"
            "            captured_last_layer_outputs.capture(residual)\n"
            "            captured_last_layer_outputs.hs_attn_input(hidden_states)\n",
        ),
        _init_block("0.5.9"),
        Edit(
            "        aux_hidden_states = []\n"
            "        for i in range(normal_start_layer, normal_end_layer):\n",
            "        aux_hidden_states = []\n"
            + _BEGIN
            + "        for i in range(normal_start_layer, normal_end_layer):\n",
        ),
        Edit(
            "                    gemm_output_zero_allocator,\n"
            "                    llama_4_scaling,\n"
            "                )\n"
            "\n"
            "        if normal_end_layer != self.end_layer:\n",
            "                    gemm_output_zero_allocator,\n"
            "                    llama_4_scaling,\n"
            "                    captured_last_layer_outputs=(\n"
            "                        None if _hs is None else _hs.collector(i, None)  # hs_patch\n"
            "                    ),\n"
            "                )\n"
            "\n"
            "        if normal_end_layer != self.end_layer:\n",
        ),
        _NORM,
        _finish("        return hidden_states, aux_hidden_states\n"),
    ),
)

V0_5_16 = Release(
    version="0.5.16",
    torch="2.11.0",
    cuda="13.0",
    pristine_sha256="47709951b15d7ac494c25f079a242c17375a8ee01007c829ea0c9ab604794689",
    patched_sha256="e9060d78b996b0b468a3d3deaade0fa520f4ef2713d366d8b9276ed322e895c8",
    edits=(
        _init_block("0.5.16"),
        Edit(_PREPARE_0_5_16, _PREPARE_0_5_16 + _ATTN_INPUT),
        Edit(
            "        aux_hidden_states = []\n"
            "        if self.pp_group.is_first_rank:\n"
            "            topk_indices = None\n",
            "        aux_hidden_states = []\n"
            "        if self.pp_group.is_first_rank:\n"
            "            topk_indices = None\n" + _BEGIN,
        ),
        Edit(
            "                    captured_last_layer_outputs=(\n"
            "                        aux_hidden_states if i in self.layers_to_capture else None\n"
            "                    ),\n",
            _COLLECTOR_NEW,
        ),
        _NORM,
        _finish("        return hidden_states, aux_hidden_states\n"),
    ),
)

V0_5_23 = Release(
    version="0.5.23",
    torch="2.14.1",
    cuda="13.0",
    pristine_sha256="f61f93019bf1e7680f45a1fe227244433e1b22021cb955e53d25b9cf900473f9",
    patched_sha256="cfd55d507c3fc5c9b0e8b86a9b4722c44e72fe1955d61f9d46a27bb060d31907",
    edits=(
        _init_block("0.5.23"),
        Edit(_PREPARE_0_5_23, _PREPARE_0_5_23 + _ATTN_INPUT),
        Edit(
            "        aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))\n",
            "        aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))\n" + _BEGIN,
        ),
        Edit(
            "                    captured_last_layer_outputs=aux_hidden_states\n"
            "                    if i in self.layers_to_capture\n"
            "                    else None,\n",
            _COLLECTOR_NEW,
        ),
        Edit(
            "                hidden_states = residual_batch.final_norm(\n"
            "                    hidden_states, forward_batch, self.norm\n"
            "                )\n",
            "                hidden_states = residual_batch.final_norm(\n"
            "                    hidden_states,\n"
            "                    forward_batch,\n"
            "                    self.norm,\n"
            "                    capture=None if _hs is None else _hs.final_prenorm,  # hs_patch\n"
            "                )\n",
        ),
        _finish("        return hidden_states, aux_hidden_states.finalize()\n"),
    ),
)

RELEASES = {r.version: r for r in (V0_5_9, V0_5_16, V0_5_23)}
DEFAULT_RELEASE = "0.5.9"


def by_pristine_sha(sha: str) -> Release | None:
    return next((r for r in RELEASES.values() if r.pristine_sha256 == sha), None)


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


# hs-patch before issue #25 did not hand the hook what each layer's attention reads; a file it
# patched is today's patched file without these lines. ``apply`` upgrades it (undo the earlier
# edits, check the pristine sha256, apply today's), ``verify`` fails on it (the hook would refuse
# every pass: no attention input).
_ATTN_LINES = (_ATTN_INPUT, "            captured_last_layer_outputs.hs_attn_input(hidden_states)\n")


def earlier_edits(release: Release) -> tuple[Edit, ...]:
    """The edits hs-patch made to ``release`` before the attention input was handed to the hook."""
    out = []
    for e in release.edits:
        replacement = e.replacement
        for line in _ATTN_LINES:
            replacement = replacement.replace(line, "")
        if replacement != e.anchor:
            out.append(Edit(e.anchor, replacement))
    return tuple(out)


def from_earlier_patch(text: str) -> tuple[Release, str] | None:
    """(release, today's patched text) if ``text`` is a release's file as an earlier hs-patch patched it."""
    import hashlib

    for release in RELEASES.values():
        original = text
        for edit in reversed(earlier_edits(release)):
            if original.count(edit.replacement) != 1:
                break
            original = original.replace(edit.replacement, edit.anchor)
        else:
            if hashlib.sha256(original.encode("utf-8")).hexdigest() == release.pristine_sha256:
                return release, apply_edits(release, original)
    return None


class PatchError(Exception):
    """The pristine text does not have an anchor exactly once."""


def apply_edits(release: Release, text: str) -> str:
    """The patched text of ``release``'s pristine ``deepseek_v2.py``."""
    for n, edit in enumerate(release.edits, 1):
        count = text.count(edit.anchor)
        if count != 1:
            raise PatchError(f"edit {n} of {release.version}: anchor found {count} times, expected once")
        text = text.replace(edit.anchor, edit.replacement)
    return text
