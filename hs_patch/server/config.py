"""Capture configuration: the environment variables the patched SGLang reads once,
when it builds the model. Standard library only (imported inside the server).

========================  =====================  ==============================================
variable                  default                meaning
========================  =====================  ==============================================
HS_CAPTURE                (unset: off)           ``1`` turns capture on. Unset or ``0``: the
                                                 patched server behaves exactly like the
                                                 pristine one and imports nothing of ours.
HS_CAPTURE_DIR            /dev/shm/hs_capture    where samples and ``manifest.jsonl`` go
HS_CAPTURE_LAYERS         2,30,58,60             decoder layers whose INPUT is captured
                                                 (SGLang's convention: the residual stream
                                                 entering layer i = output of layer i-1)
HS_CAPTURE_FINAL          pre                    the last layer's output: ``pre`` (before the
                                                 final norm; speculators reads this, and
                                                 post-norm is derivable from it), ``post``
                                                 (after it; SpecForge reads this), ``both``
                                                 or ``none``
HS_CAPTURE_SLOTS          3                      pinned host staging buffers (each holds one
                                                 prefill pass); all busy = the forward pass
                                                 waits for the writer (back-pressure). 3: one
                                                 being filled, one whose copy is finishing,
                                                 one being written (with 2, the H200 proof's
                                                 CPU waited ~160 ms on 3 passes in 4 at 2 GB/s)
HS_CAPTURE_SLOT_TOKENS    16384                  initial size of a staging buffer in tokens
                                                 (grows if a pass is larger)
HS_CAPTURE_WRITERS        4                      threads writing (and sha256-hashing) files
HS_CAPTURE_STALL_SECONDS  300                    if the writer stays this long behind, the
                                                 server fails loudly instead of waiting on
HS_CAPTURE_SKIP_RID_PREFIX nocap-                requests whose id starts with this are not
                                                 captured (releases with request ids, >=0.5.10)
HS_CAPTURE_RANK           0                      the tensor-parallel rank that writes
========================  =====================  ==============================================
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any, Mapping

ENV_PREFIX = "HS_CAPTURE"
DEFAULT_DIR = "/dev/shm/hs_capture"
DEFAULT_LAYERS = (2, 30, 58, 60)
FINAL_CHOICES = ("pre", "post", "both", "none")


class ConfigError(ValueError):
    """An HS_CAPTURE_* variable has a value we cannot use."""


@dataclass(frozen=True)
class CaptureConfig:
    enabled: bool = False
    directory: str = DEFAULT_DIR
    layers: tuple[int, ...] = DEFAULT_LAYERS
    final: str = "pre"
    slots: int = 3
    slot_tokens: int = 16384
    writers: int = 4
    stall_seconds: float = 300.0
    skip_rid_prefix: str = "nocap-"
    rank: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_layers(self, num_hidden_layers: int) -> None:
        """Refuse layer ids the model does not have (the input of layer i exists for 0 <= i < n)."""
        bad = [i for i in self.layers if not 0 <= i < num_hidden_layers]
        if bad:
            raise ConfigError(
                f"HS_CAPTURE_LAYERS has {bad}, but the model has layers 0..{num_hidden_layers - 1}; "
                f"the last layer's output is captured with HS_CAPTURE_FINAL=pre|post|both")


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
    """``"2,30,58,60"`` -> (2, 30, 58, 60); sorted, no duplicates, non-negative."""
    try:
        layers = tuple(int(x) for x in raw.replace(" ", "").split(",") if x)
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
    final = env.get("HS_CAPTURE_FINAL", "pre").strip() or "pre"
    if final not in FINAL_CHOICES:
        raise ConfigError(f"HS_CAPTURE_FINAL={final!r}: choose one of {', '.join(FINAL_CHOICES)}")
    directory = env.get("HS_CAPTURE_DIR", "").strip() or DEFAULT_DIR
    if not os.path.isabs(directory):
        raise ConfigError(f"HS_CAPTURE_DIR={directory!r} must be an absolute path")
    layers_raw = env.get("HS_CAPTURE_LAYERS", "").strip()
    stall = env.get("HS_CAPTURE_STALL_SECONDS", "").strip()
    try:
        stall_seconds = float(stall) if stall else 300.0
    except ValueError:
        raise ConfigError(f"HS_CAPTURE_STALL_SECONDS={stall!r} is not a number") from None
    if stall_seconds <= 0:
        raise ConfigError("HS_CAPTURE_STALL_SECONDS must be > 0")
    return CaptureConfig(
        enabled=enabled_raw == "1",
        directory=directory,
        layers=parse_layers(layers_raw) if layers_raw else DEFAULT_LAYERS,
        final=final,
        slots=_int(env, "HS_CAPTURE_SLOTS", 3, 1),
        slot_tokens=_int(env, "HS_CAPTURE_SLOT_TOKENS", 16384, 1),
        writers=_int(env, "HS_CAPTURE_WRITERS", 4, 1),
        stall_seconds=stall_seconds,
        skip_rid_prefix=env.get("HS_CAPTURE_SKIP_RID_PREFIX", "nocap-"),
        rank=_int(env, "HS_CAPTURE_RANK", 0, 0),
    )
