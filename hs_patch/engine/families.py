"""The code the patch inserts into SGLang's ``deepseek_v2.py``, written once per family.

Releases are grouped into families by the code the patch touches (:mod:`hs_patch.engine.releases`
says which release is in which). ``Family.where`` says where each captures (always the
residual stream *entering* layer i, after the layer's input step, so fully reduced even where
flashinfer fusion defers the previous layer's all-reduce). A family writes its edits once with
``<<slot>>`` names for the lines its releases spell differently; a release gives its own
spelling (``Release.own`` in :mod:`hs_patch.engine.releases`). Each edit replaces one anchor that must
occur exactly once in the pristine file. Every inserted line carries or follows an
``hs_patch`` marker. The final norm's input and output are captured where the norm runs, and
each captured layer hands the hook what its attention reads, which the fidelity check uses
(:mod:`hs_patch.server.fingerprint`). Per-release findings: docs/capture.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class Edit:
    anchor: str
    replacement: str


@dataclass(frozen=True)
class Family:
    name: str
    where: str                # where the capture sits, one sentence
    prepare: str              # the decoder layer's input step, after which the hook gets the attention input
    edits: tuple[Edit, ...]   # with <<piece>> slots
    pieces: Mapping[str, str] = field(default_factory=dict)  # the family's own spelling of each slot
    final_add: bool = True    # the patch hands the final norm's inputs (hs_patch.server.fingerprint.FINAL_ADD)



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

_BEGIN = (  # hidden_states: the embedding the residual stream begins from (the first PP rank: PP is refused)
    "        _hs = (  # hs_patch: None unless this pass is a prefill to capture\n"
    "            self._hs_capture.begin(forward_batch, input_ids, hidden_states)\n"
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

_NORM = Edit(  # the norm's inputs are handed first: the fused norm adds them into ``residual`` in place
    "                if residual is None:\n"
    "                    hidden_states = self.norm(hidden_states)\n"
    "                else:\n"
    "                    hidden_states, _ = self.norm(hidden_states, residual)\n",
    "                if _hs is not None:  # hs_patch: the final norm's inputs\n"
    "                    _hs.final_inputs(hidden_states, residual)\n"
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

# DeepseekV2DecoderLayer.forward: after the layer's input step ``hidden_states`` is what its
# attention reads; the patch hands it to the hook's collector (only ours has ``hs_attn_input``;
# SGLang's own EAGLE-3 collectors and None do not): the host checks that the captured residual,
# normalised with this layer's norm weight, is it (hs_patch.server.fingerprint).
ATTN_INPUT = (
    "        if captured_last_layer_outputs is not None and hasattr(  # hs_patch: what attention reads\n"
    '            captured_last_layer_outputs, "hs_attn_input"\n'
    "        ):\n"
    "            captured_last_layer_outputs.hs_attn_input(hidden_states)\n"
)
ATTN_INPUT_LINE = "            captured_last_layer_outputs.hs_attn_input(hidden_states)\n"  # the layer-point form


def _hands(method: str, value: str, why: str) -> str:
    """The patch's lines that hand one of the additive relation's tensors to our collector (only ours has
    ``method``): the attention's output before the step that all-reduces it and adds it to the residual,
    and the residual after that step (hs_patch.server.fingerprint)."""
    return ("        if captured_last_layer_outputs is not None and hasattr(  # hs_patch: " + why + "\n"
            f'            captured_last_layer_outputs, "{method}"\n'
            "        ):\n"
            f"            captured_last_layer_outputs.{method}({value})\n")


ATTN_OUTPUT = _hands("hs_attn_output", "hidden_states", "the attention's output")
MID = _hands("hs_mid", "residual", "the residual after it")
_PREPARE_MLP = ("        hidden_states, residual = self.layer_communicator.prepare_mlp(\n"
                "            hidden_states, residual, forward_batch\n"
                "        )\n")
_AROUND_MLP = Edit(_PREPARE_MLP, ATTN_OUTPUT + _PREPARE_MLP + MID)  # the layer-point and communicator families
_BOUNDARY_MLP = ("        hidden_states = self.attn_boundary.finish(hidden_states, forward_batch)\n"
                 "        hidden_states = self.ffn_boundary.prepare(hidden_states, forward_batch)\n")

# ------------------------------------------------------------------ families

LAYER_POINT = Family(
    name="layer-point",
    where="a capture point the patch adds to DeepseekV2DecoderLayer.forward, right after prepare_attn (which "
          "completes an all-reduce flashinfer fusion deferred from the previous layer; SGLang's own EAGLE-3 capture, "
          "hidden_states + residual in the model loop, is a per-rank partial sum then)",
    prepare="self.layer_communicator.prepare_attn",
    pieces={
        "layer_args_end": "        prev_topk_indices: Optional[torch.Tensor] = None,\n",
        "quant_arg": '            getattr(self, "_gfx95_quant_format", ""),\n',
        "layer_call_end": "                    prev_topk_indices=topk_indices,\n",
        "aux_return": "aux_hidden_states",
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
            "            captured_last_layer_outputs.capture(residual)\n" + ATTN_INPUT_LINE,
        ),
        _AROUND_MLP,
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
        _FINISH,
    ),
)

_PREPARE_COMM = (
    "        hidden_states, residual = (\n"
    "            self.layer_communicator.prepare_attn_and_capture_last_layer_outputs(\n"
    "                hidden_states,\n"
    "                residual,\n"
    "                forward_batch,\n"
    "                captured_last_layer_outputs=captured_last_layer_outputs,\n"
    "<<quant_kw>>"
    "            )\n"
    "        )\n"
)

_PREPARE_BOUNDARY = (
    "        hidden_states = self.attn_boundary.prepare(\n"
    "            hidden_states,\n"
    "            forward_batch,\n"
    "            <<gathered_kw>>=captured_last_layer_outputs,\n"
    "            quant_format=self._resolve_gfx95_quant_format(),\n"
    "        )\n"
)

COMMUNICATOR = Family(
    name="communicator",
    where="the layer's own captured_last_layer_outputs, filled by "
          "LayerCommunicator.prepare_attn_and_capture_last_layer_outputs (SGLang's EAGLE-3 path)",
    prepare="self.layer_communicator.prepare_attn_and_capture_last_layer_outputs",
    pieces={
        "aux_init": "        aux_hidden_states = AuxHiddenStatePacker(len(self.layers_to_capture))\n",
        "aux_return": "aux_hidden_states.finalize()",
        "quant_kw": '                quant_format=getattr(self, "_gfx95_quant_format", ""),\n',
    },
    edits=(
        _INIT,
        Edit(_PREPARE_COMM, _PREPARE_COMM + ATTN_INPUT),
        _AROUND_MLP,
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
    final_add=False,  # the residual stream adds inside residual_batch.final_norm: its inputs are out of reach
    where="the collector layer_boundary/stage.py hands the gathered residual to, capture(value, owned=) (the "
          "residual is carried in forward_batch.residual_stream)",
    prepare="self.attn_boundary.prepare",
    pieces={"final_norm": "final_norm", "capture_kw": "capture", "gathered_kw": "capture_gathered",
            "aux_return": "aux_hidden_states.finalize()"},
    edits=(
        _INIT,
        Edit(_PREPARE_BOUNDARY, _PREPARE_BOUNDARY + ATTN_INPUT),
        # the residual after the attention's output was added: the stream's, once the FFN stage's prepare
        # has consumed the pending contribution (layer_boundary/residual/stream.py: prepare writes it)
        Edit(_BOUNDARY_MLP, ATTN_OUTPUT + _BOUNDARY_MLP
             + _hands("hs_mid", "forward_batch.residual_stream.residual", "the residual after it")),
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
        _FINISH,
    ),
)

FAMILIES = (LAYER_POINT, COMMUNICATOR, LAYER_BOUNDARY)
