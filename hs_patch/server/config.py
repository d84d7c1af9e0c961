"""Capture configuration: the environment variables the patched SGLang reads once,
when it builds the model. Standard library only (imported inside the server).

``ENV_DOCS`` below describes every variable once; ``docs/capture.md`` and
``hs-patch --help`` show that table.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping

# (name, default as shown, meaning): the one description of each variable.
ENV_DOCS = (
    ("HS_CAPTURE", "unset", "1 turns capture on. Unset or 0: the patched server runs the pristine code paths "
     "and imports nothing of hs_patch."),
    ("HS_CAPTURE_DIR", "/dev/shm/hs_capture", "Absolute directory the hook writes into: samples, manifest.jsonl, "
     "errors.jsonl, hook_status.json."),
    ("HS_CAPTURE_LAYERS", "2,n/2,n-3", "Decoder layers whose INPUT is captured (layer.<i> = residual stream "
     "entering layer i = output of layer i-1), ascending, separated by commas or spaces. Unset: what SGLang "
     "feeds an EAGLE-3 drafter whose config names no layers, [2, n//2, n-3] for a model of n layers: 2,30,58 "
     "on Kimi-K2.5's 61 (eagle ids [1,29,57] on every release)."),
    ("HS_CAPTURE_FINAL", "both", "The last layer's output to store: pre (before the final norm: speculators), "
     "post (after it, what the LM head reads: SpecForge), both, or none. both: a default run feeds both "
     "trainers exactly; 5 planes = 72,617 bytes per token at hidden 7168 (ids, mask, fingerprints and checksums included)."),
    ("HS_CAPTURE_SLOTS", "6", "Pinned host staging buffers, one prefill pass each (587 MB each at 8,192 tokens x "
     "hidden 7168 x 5 planes); when all are busy the forward pass waits for the writer (back-pressure, counted in "
     "hook_status.json). A pass holds one from its launch, while the scheduler runs a pass ahead, until its last "
     "file is written: about three passes' time where the engine makes 2 GB/s of states; 6 leave room for twice "
     "that rate."),
    ("HS_CAPTURE_SLOT_TOKENS", "--chunked-prefill-size", "Tokens one staging buffer holds; every buffer is "
     "allocated (pinned) at startup and a larger pass fails loudly. Default: the server's chunked-prefill size, "
     "the most tokens SGLang puts in one prefill pass."),
    ("HS_CAPTURE_DEVICE_BUFFERS", "2", "Device buffers of HS_CAPTURE_SLOT_TOKENS rows on the writing rank's GPU, "
     "made at startup (before SGLang sizes its KV cache): each captured tensor is copied into the next one on the "
     "compute stream, then to a staging buffer on a side stream, so nothing sized by the pass is allocated on the "
     "forward path. GPU memory: N x slot tokens x hidden x 2 bytes (2 x 8192 x 7168 x 2 = 235 MB). The forward "
     "pass waits, on the GPU, only when a buffer's copy to the host (about 2 ms for 117 MB) has not ended by the "
     "time its turn comes again."),
    ("HS_CAPTURE_WRITERS", "8", "Writer threads that write and sha256-hash sample files (about 0.85 GB/s of "
     "states a busy core; the writer's ceiling: docs/capture.md)."),
    ("HS_CAPTURE_STALL_SECONDS", "120", "How long a forward pass may wait for a free staging buffer before the "
     "server fails loudly instead of waiting on; must stay below SGLang's --watchdog-timeout (300)."),
    ("HS_CAPTURE_SKIP_RID_PREFIX", "nocap-", "Requests whose id starts with this are not captured (releases with "
     "request ids in the forward batch: 0.5.10 and later)."),
    ("HS_CAPTURE_RANK", "0", "The tensor-parallel rank that writes (after the all-reduce every rank holds the "
     "full residual stream)."),
    ("HS_CAPTURE_DTYPE", "bf16", "How the planes are stored: bf16 (the model's own values, exact) or fp8 "
     "(float8_e4m3fn with one fp32 scale a token a plane, amax/448, quantized on the GPU before the copy to the "
     "host: half the plane bytes through PCIe, host staging and disk; format hs_patch.sample/5, docs/samples.md; "
     "made at start besides: one work buffer of slot tokens x hidden x 2 bytes on the GPU, and in each staging "
     "buffer the check rows' room, a quarter of slot tokens x hidden x 2 bytes, as with HS_CAPTURE_FINAL=none: "
     "0.56 of bf16's staging memory with 5 planes at hidden 7168). The "
     "fingerprints are of the values "
     "before quantization, the checksums of the bytes stored; the fidelity check's logits come from the bf16 "
     "check rows kept beside them (HS_CAPTURE_CHECK_ROWS)."),
    ("HS_CAPTURE_CHECK_ROWS", "16", "With HS_CAPTURE_FINAL=none or HS_CAPTURE_DTYPE=fp8 only: the LM head's input "
     "at each prompt's last N positions, as the engine computed it (bf16), is kept in the sample (tensor "
     "check.post_norm, N x hidden x 2 bytes; a staging buffer has room for a quarter of a pass of such rows, so "
     "a pass of more than slot tokens / 4N prompts keeps fewer a prompt, at least the last, each sample's header "
     "saying how many) for the fidelity check's logit gaps, which tie every sample to its own "
     "request (hs-extract drive --fidelity-gap-positions, default 16); 0: none kept, and nothing ties such a sample "
     "to its request."),
)

ENV_PREFIX = "HS_CAPTURE"
DEFAULT_DIR = "/dev/shm/hs_capture"
DEFAULT_LAYERS = ()  # unset: SGLang's EAGLE-3 default for the model's depth (CaptureConfig.for_model)
FINAL_CHOICES = ("pre", "post", "both", "none")
DTYPE_CHOICES = ("bf16", "fp8")


class ConfigError(ValueError):
    """An HS_CAPTURE_* variable has a value we cannot use."""


@dataclass(frozen=True)
class CaptureConfig:
    enabled: bool = False
    directory: str = DEFAULT_DIR
    layers: tuple[int, ...] = DEFAULT_LAYERS
    final: str = "both"
    slots: int = 6
    slot_tokens: int = 0  # 0: the server's --chunked-prefill-size (hook.attach)
    device_buffers: int = 2
    writers: int = 8
    stall_seconds: float = 120.0
    skip_rid_prefix: str = "nocap-"
    rank: int = 0
    check_rows: int = 16  # HS_CAPTURE_FINAL=none: the LM head's input kept at each prompt's last positions
    dtype: str = "bf16"  # HS_CAPTURE_DTYPE: bf16 (the model's values) or fp8 (e4m3fn + a scale a token a plane)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def for_model(self, num_hidden_layers: int) -> "CaptureConfig":
        """This config with its layers resolved for a model of ``num_hidden_layers``: unset layers become
        SGLang's own EAGLE-3 default ``[2, n//2, n-3]``; ids the model does not have are refused."""
        cfg = self if self.layers else replace(self, layers=default_layers(num_hidden_layers))
        cfg.check_layers(num_hidden_layers)
        return cfg

    def check_layers(self, num_hidden_layers: int) -> None:
        """Refuse layer ids the model does not have (the input of layer i exists for 0 <= i < n)."""
        bad = [i for i in self.layers if not 0 <= i < num_hidden_layers]
        if bad:
            raise ConfigError(
                f"HS_CAPTURE_LAYERS has {bad}, but the model has layers 0..{num_hidden_layers - 1}; "
                f"the last layer's output is captured with HS_CAPTURE_FINAL=pre|post|both")


def default_layers(num_hidden_layers: int) -> tuple[int, ...]:
    """What SGLang's ``set_eagle3_layers_to_capture`` captures when a drafter config names no ids
    (the same on every supported release; ``hs_patch.engine.serving.default_layers``), deduplicated for
    shallow models."""
    n = num_hidden_layers
    return tuple(sorted({i for i in (2, n // 2, n - 3) if 0 <= i < n})) or (0,)


def _int(env: Mapping[str, str], name: str, default: int, low: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < low:
        raise ConfigError(f"{name}={value} must be >= {low}")
    return value


def parse_layers(raw: str) -> tuple[int, ...]:
    """``"2,30,58,60"``, ``"2 30 58 60"`` or ``"2, 30"`` -> (2, 30, ...); sorted, no duplicates, non-negative.
    Commas and whitespace both separate (``"1 2"`` is two layers, never 12)."""
    try:
        layers = tuple(int(x) for x in re.split(r"[,\s]+", raw.strip()) if x)
    except ValueError:
        raise ConfigError(f"HS_CAPTURE_LAYERS={raw!r}: expected comma-separated layer numbers, e.g. 2,30,58,60") from None
    if not layers:
        raise ConfigError("HS_CAPTURE_LAYERS is empty; give at least one layer, e.g. 2,30,58")
    if len(set(layers)) != len(layers) or list(layers) != sorted(layers) or layers[0] < 0:
        raise ConfigError(f"HS_CAPTURE_LAYERS={raw!r}: layers must be ascending, distinct and >= 0")
    return layers


def from_env(env: Mapping[str, str] | None = None) -> CaptureConfig:
    """Read the HS_CAPTURE_* variables; raise :class:`ConfigError` with what to fix."""
    env = os.environ if env is None else env
    enabled_raw = env.get("HS_CAPTURE", "").strip().lower()
    if enabled_raw not in ("", "0", "1"):
        raise ConfigError(f"HS_CAPTURE={enabled_raw!r}: use 1 to capture, 0 or unset to serve normally")
    final = env.get("HS_CAPTURE_FINAL", "").strip() or CaptureConfig.final
    if final not in FINAL_CHOICES:
        raise ConfigError(f"HS_CAPTURE_FINAL={final!r}: choose one of {', '.join(FINAL_CHOICES)}")
    dtype = env.get("HS_CAPTURE_DTYPE", "").strip().lower() or CaptureConfig.dtype
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(f"HS_CAPTURE_DTYPE={dtype!r}: choose bf16 (the default, exact) or fp8 (float8_e4m3fn with "
                          "a scale a token a plane)")
    directory = env.get("HS_CAPTURE_DIR", "").strip() or DEFAULT_DIR
    if not os.path.isabs(directory):
        raise ConfigError(f"HS_CAPTURE_DIR={directory!r} must be an absolute path")
    layers_raw = env.get("HS_CAPTURE_LAYERS", "").strip()
    stall = env.get("HS_CAPTURE_STALL_SECONDS", "").strip()
    try:
        stall_seconds = float(stall) if stall else 120.0
    except ValueError:
        raise ConfigError(f"HS_CAPTURE_STALL_SECONDS={stall!r} is not a number") from None
    if not math.isfinite(stall_seconds) or stall_seconds <= 0:
        raise ConfigError(f"HS_CAPTURE_STALL_SECONDS={stall!r} must be a finite number of seconds > 0")
    return CaptureConfig(
        enabled=enabled_raw == "1",
        directory=directory,
        layers=parse_layers(layers_raw) if layers_raw else DEFAULT_LAYERS,
        final=final,
        slots=_int(env, "HS_CAPTURE_SLOTS", 6, 1),
        slot_tokens=_int(env, "HS_CAPTURE_SLOT_TOKENS", 0, 1),
        device_buffers=_int(env, "HS_CAPTURE_DEVICE_BUFFERS", 2, 1),
        writers=_int(env, "HS_CAPTURE_WRITERS", 8, 1),
        stall_seconds=stall_seconds,
        skip_rid_prefix=env.get("HS_CAPTURE_SKIP_RID_PREFIX", "nocap-"),
        rank=_int(env, "HS_CAPTURE_RANK", 0, 0),
        check_rows=_int(env, "HS_CAPTURE_CHECK_ROWS", 16, 0),
        dtype=dtype,
    )
