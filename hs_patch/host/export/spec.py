"""What an export holds, and what each trainer's format cannot hold (refused with why).

- SpecForge 0.2.0 (offline ``*.ckpt``): EXACTLY three aux planes, concatenated ascending,
  and the final state AFTER the final norm (its target head is the bare ``lm_head``). A
  capture without ``final.post_norm`` is refused unless ``--derive-post-norm`` computes it
  from ``final.pre_norm`` with the model's norm weight. No fp8.
- speculators 0.9.0 (``hs_<row>.safetensors``): any number of aux planes ascending, then the
  final state BEFORE the norm (the trainer applies the verifier's norm itself); a capture
  without ``final.pre_norm`` is refused (it cannot be derived from the post-norm state).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Optional

from hs_patch.samples import store
from hs_patch.server import fp8

FORMATS = ("specforge", "speculators")
SPECFORGE_AUX = 3


class ExportRefused(ValueError):
    """The source cannot be exported in the asked format; the message says what to do."""


@dataclass
class ExportSpec:
    format: str
    layers: list[int] = field(default_factory=list)   # aux planes: our layer.<i>
    fp8: bool = False
    derive_post_norm: bool = False
    model: Optional[str] = None                      # model dir (norm weight, num_hidden_layers)

    def identity(self) -> dict[str, Any]:
        """What decides an export's bytes: a re-run into the same destination must match it."""
        d = asdict(self)
        d.pop("model")
        return d

    @property
    def aux_planes(self) -> list[str]:
        return [store.layer_plane(i) for i in self.layers]

    def final_source(self) -> str:
        """The stored plane the final state comes from."""
        if self.format == "speculators":
            return "final.pre_norm"
        return "final.pre_norm" if self.derive_post_norm else "final.post_norm"

    def final_label(self) -> str:
        return "pre_norm" if self.format == "speculators" else "post_norm"

    def files_dtype(self, metadata: Mapping[str, str]) -> str:
        """The dtype of the exported planes (export.json's ``dtype``): fp8 e4m3 with --fp8, else what the engine
        computed; an fp8 capture's planes are exported dequantized to that (its metadata's ``source_dtype``)."""
        if self.fp8:
            return fp8.DTYPE
        return fp8.source_name(metadata)


def captured_layers(metadata: Mapping[str, str]) -> list[int]:
    raw = metadata.get("layers", "")
    return [int(x) for x in raw.split(",") if x.strip()]


def resolve(spec: ExportSpec, metadata: Mapping[str, str]) -> ExportSpec:
    """Fill the aux layers from a sample's metadata and refuse what the format cannot hold."""
    if spec.format not in FORMATS:
        raise ExportRefused(f"--format {spec.format!r}: choose {' or '.join(FORMATS)}")
    have_layers = captured_layers(metadata)
    planes = set(metadata.get("planes", "").split(","))
    layers = spec.layers or have_layers
    missing = [i for i in layers if store.layer_plane(i) not in planes]
    if missing:
        raise ExportRefused(f"layers {missing} were not captured (the samples hold layers {have_layers})")
    if layers != sorted(set(layers)):
        raise ExportRefused(f"--layers {layers}: give them ascending and distinct")
    if spec.format == "specforge":
        if len(layers) != SPECFORGE_AUX:
            raise ExportRefused(f"SpecForge reads exactly {SPECFORGE_AUX} aux layers (aux_hidden_state [1, L, 3H]); "
                                f"the samples hold {have_layers}: pick three with --layers, e.g. "
                                f"--layers {','.join(map(str, have_layers[:3]))}")
        if spec.fp8:
            raise ExportRefused("SpecForge 0.2.0 has no fp8 reader: --fp8 is for --format speculators")
        if "final.post_norm" not in planes and not spec.derive_post_norm:
            raise ExportRefused("SpecForge trains on the final state AFTER the final norm, and these samples hold "
                                f"{metadata.get('final', '?')!r} only: capture HS_CAPTURE_FINAL=both (or post), or "
                                "pass --derive-post-norm --model DIR to compute it from final.pre_norm with the "
                                "model's norm weight (close to the server's fused norm, not bit-identical: "
                                "docs/training.md)")
        if spec.derive_post_norm and not spec.model:
            raise ExportRefused("--derive-post-norm needs --model DIR (the served model's directory: its final norm "
                                "weight and rms_norm_eps are read from it)")
    elif spec.derive_post_norm:
        raise ExportRefused("--derive-post-norm is for --format specforge (speculators reads the pre-norm state)")
    if spec.final_source() not in planes:
        raise ExportRefused(f"{spec.format} needs {spec.final_source()}, and these samples hold "
                            f"{metadata.get('final', '?')!r} only: the pre-norm state cannot be derived from the "
                            "post-norm one; capture with HS_CAPTURE_FINAL=both")
    if not layers:
        raise ExportRefused("the samples hold no layer.<i> plane: capture aux layers (HS_CAPTURE_LAYERS)")
    return ExportSpec(spec.format, list(layers), spec.fp8, spec.derive_post_norm, spec.model)


# What every sample of one export shares with the first (export.json records the first's): another width
# fails the trainer later; another model or architecture trains a drafter on another model's states, silently.
SAME_AS_FIRST = ("hidden_size", "architecture", "model")


def like_first(metadata: Mapping[str, str]) -> dict[str, str]:
    """The fields of the first sample every other sample of the export must share."""
    return {f: str(metadata.get(f) or "") for f in SAME_AS_FIRST}


def check_sample(spec: ExportSpec, metadata: Mapping[str, str], has_loss_mask: bool,
                 first: Optional[Mapping[str, str]] = None) -> None:
    """Refuse one sample that does not hold what the resolved ``spec`` exports, or that comes from another
    model than ``first`` (:func:`like_first` of the export's first sample)."""
    differ = {f: (want, str(metadata.get(f) or "")) for f, want in (first or {}).items()
              if want and metadata.get(f) and str(metadata.get(f)) != want}
    if differ:
        raise ExportRefused(f"sample {metadata.get('key')} was captured from another model than the export's first "
                            f"sample ({'; '.join(f'{f} {b!r}, not {a!r}' for f, (a, b) in differ.items())}): the "
                            "source mixes runs of different models; export each model's samples on their own")
    planes = set(metadata.get("planes", "").split(","))
    need = spec.aux_planes + [spec.final_source()]
    lacking = [p for p in need if p not in planes]
    if lacking:
        raise ExportRefused(f"sample {metadata.get('key')} lacks {lacking} (it holds {sorted(planes)}): "
                            "the source mixes captures with different layers")
    if not has_loss_mask:
        raise ExportRefused(f"sample {metadata.get('key')} has no loss_mask: export finalized samples (the driver's "
                            "--samples-dir or a shipped run), not the raw capture directory")
