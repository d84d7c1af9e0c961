"""``hs-extract export``: the subcommand's options, progress bar and summary."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hs_patch.samples.files import disk_full

DESCRIPTION = """\
Export finished samples (a driver's --samples-dir, or a shipped RUN directory with
manifest.jsonl and samples/) in the layout an EAGLE-3 trainer reads:

  specforge    DST/samples/<key>.ckpt: torch.save dicts of input_ids, loss_mask (int64 [L]),
               hidden_state [1,L,H] (final state AFTER the norm) and aux_hidden_state
               [1,L,3H] (exactly 3 aux layers, ascending). SpecForge 0.2.0's offline reader
               trains on every *.ckpt under DST.
  speculators  DST: a datasets table (input_ids, loss_mask, seq_len) + DST/hidden_states/
               hs_<row>.safetensors: token_ids [L], hidden_states [L,K,H] (aux layers
               ascending, then the final state BEFORE the norm). --fp8: hs_connectors'
               per-token-scale fp8 in DST/hidden_states_fp8/ (read with speculators'
               --hidden-states-backend fp8; half the bytes).

Every source sample is checked against its manifest (size, sha256) before it is read; every
exported file is written under DST/.tmp, fsynced and renamed, and recorded in
DST/export.jsonl with its sha256. Run the same command again to resume: files whose source is
unchanged and whose bytes match their record are kept, the rest redone; samples no longer in
the source are deleted (a trainer would count them twice). DST/export.json says what the
export holds, the SGLang serving ids of its layers, and state complete|incomplete|in-progress:
train only on a complete export.

exit codes: 0 complete; 1 refused or error; 3 incomplete (some samples failed: see the list,
run again); 130 interrupted (run again to resume)
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="samples directory or shipped run directory (with manifest.jsonl)")
    p.add_argument("dst", metavar="DST", help="export directory (new, empty, or an earlier export of the same kind)")
    p.add_argument("--format", required=True, choices=("specforge", "speculators"), help="the trainer's layout")
    p.add_argument("--layers", default="", metavar="I,J,K", help="aux planes layer.<i> to export, ascending "
                   "(default: every captured layer; SpecForge needs exactly 3)")
    p.add_argument("--fp8", action="store_true", help="speculators: store hidden states as fp8 e4m3 with one "
                   "fp32 scale per token (hs_connectors' scheme)")
    p.add_argument("--derive-post-norm", action="store_true", help="specforge: compute the post-norm final state "
                   "from final.pre_norm with the model's norm weight (needs --model; see docs/training.md)")
    p.add_argument("--model", metavar="DIR", help="the served model's directory: its norm weight for "
                   "--derive-post-norm, its num_hidden_layers for the serving ids in export.json")
    p.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)), metavar="N",
                   help="worker processes, one sample each (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="on resume, compare kept files by size only (default: sha256)")
    p.add_argument("--no-fsync", action="store_true", help="do not fsync each file (faster; a crash may then "
                   "leave renamed files whose bytes were not on disk yet; a re-run finds them by sha256)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object only")


def run_args(a: argparse.Namespace) -> int:
    from hs_patch.host.export.run import export
    from hs_patch.host.export.spec import ExportRefused, ExportSpec
    from hs_patch.host.model_files import ModelFileError
    from hs_patch.samples.store import SampleError

    try:
        layers = [int(x) for x in a.layers.replace(" ", "").split(",") if x]
    except ValueError:
        print(f"hs-extract export: --layers {a.layers!r}: comma-separated layer numbers, e.g. 2,30,58", file=sys.stderr)
        return 1
    if a.workers < 1:
        print("hs-extract export: --workers must be >= 1", file=sys.stderr)
        return 1
    spec = ExportSpec(a.format, layers, a.fp8, a.derive_post_norm, a.model)
    bar = _Bar(enabled=not a.json and sys.stderr.isatty())
    try:
        with bar:
            s = export(a.src, a.dst, spec, workers=a.workers, quick=a.quick, fsync=not a.no_fsync,
                       progress=bar.update)
    except OSError as e:
        if disk_full(e):
            print(f"hs-extract export: {a.dst} is full ({e.strerror}): free space there and run the same command "
                  "again (what is written is kept)", file=sys.stderr)
        else:
            print(f"hs-extract export: {e}", file=sys.stderr)
        return 1
    except (ExportRefused, ModelFileError, SampleError, RuntimeError) as e:
        print(f"hs-extract export: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hs-extract export: interrupted; run the same command to resume", file=sys.stderr)
        return 130
    out = {"state": s.state, "exported": s.exported, "kept": s.kept, "failed": len(s.failed), "removed": s.removed,
           "moved": s.moved, "swept": s.swept, "tokens": s.tokens, "seconds": s.seconds,
           "src_bytes_read": s.src_bytes, "bytes_written": s.out_bytes, "export": str(a.dst),
           "serving": s.info.get("serving"), **({"full": s.full, "not_tried": s.not_tried} if s.full else {})}
    if a.json:
        print(json.dumps(out, sort_keys=True))
    else:
        for key, err in sorted(s.failed.items()):
            print(f"  failed {key}: {err}", file=sys.stderr)
        print(f"{s.state}: {s.exported} exported, {s.kept} kept, {len(s.failed)} failed, {s.removed} removed from "
              f"the export, {s.swept} stray files deleted; {s.tokens} tokens in {s.seconds:.1f}s")
        if s.full:
            print(f"stopped: {a.dst} is full ({s.full}); {s.not_tried} samples not tried: free space there and run "
                  "the same command again", file=sys.stderr)
        elif s.state == "complete":
            print(train_hint(a, s.info))
    return 0 if s.state == "complete" else 3


def train_hint(a: argparse.Namespace, info: dict[str, Any]) -> str:
    layers = info.get("identity", {}).get("layers", [])
    if a.format == "specforge":
        return f"train: specforge train --config run.yaml data.hidden_states_path={a.dst}  (docs/training.md)"
    backend = f"--hidden-states-backend fp8 --hidden-states-path {a.dst}/hidden_states_fp8" if a.fp8 else ""
    return (f"train: speculators train --data-path {a.dst} {backend} --on-missing raise --target-layer-ids "
            f"{' '.join(map(str, layers))} ...  (docs/training.md)").replace("  ", " ")


class _Bar:
    """A rich progress bar on a terminal (samples, bytes, rate, ETA); nothing otherwise."""

    def __init__(self, enabled: bool):
        self.enabled, self.progress, self.task = enabled, None, None

    def __enter__(self) -> "_Bar":
        if self.enabled:
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            self.progress = Progress(TextColumn("export {task.fields[samples]} samples"), BarColumn(),
                                     DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(), transient=False)
            self.progress.__enter__()
        return self

    def update(self, done: int, samples: int, nbytes: int, total: int) -> None:
        if self.progress is None:
            return
        if self.task is None:
            self.task = self.progress.add_task("export", total=total, samples="")
        self.progress.update(self.task, completed=nbytes, samples=f"{done}/{samples}")

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.__exit__(*exc)
