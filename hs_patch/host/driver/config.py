"""The driver's settings (``hs-extract drive`` options), in a module light enough for ``--help``.

The defaults here are the only ones: ``hs-extract drive`` (:mod:`hs_patch.host.driver.cli`) shows and uses them.
"""

from __future__ import annotations

import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

from hs_patch.host.driver import dataset
from hs_patch import shard
from hs_patch.names import check_run_name
from hs_patch.samples import store


@dataclass
class DriveConfig:
    run: str
    data: list[str]
    model: str
    server: str = "http://127.0.0.1:30000"
    api_key_file: str = ""              # the server's API key (else $SGLANG_API_KEY); the key is never logged
    capture_dir: str = "/dev/shm/hs_capture"
    state_dir: str = ""       # default /var/lib/hs-patch/runs/<run>
    samples_dir: str = ""     # default /dev/shm/hs-runs/<run>/samples
    trust_remote_code: bool = False
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_tokens: int = 32768
    max_line_chars: int = 0             # 0: 256 x max_tokens, at least 1 Mi (dataset.line_limit)
    on_too_long: str = "skip"           # skip | truncate
    regenerate: bool = False
    regen_max_new_tokens: int = 2048
    regen_temperature: float = 0.6
    regen_top_p: float = 1.0
    concurrency: int = 8
    awaiting: int = 32                  # answered samples awaited, checked, adopted while the next requests are sent
    retries: int = 6
    backoff: float = 1.0
    backoff_max: float = 60.0
    request_timeout: float = 600.0
    raw_timeout: float = 120.0
    max_consecutive_failures: int = 20
    server_wait: float = 600.0
    high_water: float = 80.0
    low_water: float = 60.0
    status_interval: float = 2.0
    prometheus: str = ""
    limit: int = 0                      # 0: all lines
    shard: str = ""                     # "i/n": only the samples of shard i of n (hs_patch.shard); "": all
    queue: bool = False                 # wait while another run holds the capture dir (state queued), not refuse
    host_name: str = ""                 # this GPU host's name in each sample's metadata ("": the system's)
    fidelity_check: bool = True         # --no-fidelity-check: off
    fidelity_fraction: float = 0.01     # share of samples checked at their last positions, not only the last one
    fidelity_positions: int = 32
    fidelity_tie_tolerance: float = 0.02
    fidelity_max_consecutive: int = 5
    fidelity_rows: int = 8              # rows of every chunk checked against the fingerprints and the norms
    fidelity_gap_positions: int = 16    # last positions of every sample whose server logit gaps are compared
    accept_weaker_check: bool = False   # resume under a weaker fidelity check than the run's (recorded)
    accept_changed_data: bool = False   # resume over data reconcile.py refuses (lines moved between shards, ...)

    def fidelity_settings(self) -> dict[str, Any]:
        """The fidelity check this run does, as each sample records it (hs_patch.host.fidelity.settings)."""
        from hs_patch.host.fidelity.settings import settings

        return settings(self.fidelity_check, rows=self.fidelity_rows, fraction=self.fidelity_fraction,
                        positions=self.fidelity_positions, tie_tolerance=self.fidelity_tie_tolerance,
                        gap_positions=self.fidelity_gap_positions)

    def __post_init__(self) -> None:
        check_run_name(self.run)  # it names directories: never '../x', '' or '.'
        self.state_dir = self.state_dir or f"/var/lib/hs-patch/runs/{self.run}"
        self.samples_dir = self.samples_dir or f"/dev/shm/hs-runs/{self.run}/samples"
        if self.shard:
            self.shard = str(shard.parse(self.shard))  # one spelling in run.json: "1/3", never " 1/3"

    def owns(self) -> Callable[[str], bool] | None:
        """The shard's test of a sample id, or None when the run takes every sample."""
        return shard.parse(self.shard).owns if self.shard else None

    def identity(self) -> dict[str, Any]:
        """The parameters that decide what the samples are; a resumed run must keep them."""
        ident = {k: getattr(self, k) for k in ("run", "chat_template_kwargs", "max_tokens", "on_too_long",
                                               "regenerate")}
        if self.regenerate:
            # regen_samples: how a regenerated sample is built; a run begun by a driver that rendered the answers'
            # text again through the template (before regenerate.py) holds none, so its resume is refused, not mixed
            ident.update(regen_max_new_tokens=self.regen_max_new_tokens, regen_temperature=self.regen_temperature,
                         regen_top_p=self.regen_top_p, regen_samples="the server's token ids")
        if self.shard:  # only then: a run without one keeps the identity it always had
            ident["shard"] = self.shard
        ident["model"] = str(Path(self.model).resolve())
        ident["samples_dir"] = str(Path(self.samples_dir).resolve())
        ident["data"] = [{"name": dataset.source_name(p), "path": str(Path(p).resolve()),
                          "bytes": os.path.getsize(p), "sha256": store.file_sha256(p)[1]} for p in self.data]
        return ident


DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(DriveConfig) if f.default is not MISSING}
