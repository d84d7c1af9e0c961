"""speculators' sample table: a ``datasets`` ``save_to_disk`` directory at the export's root.

Row i is ``hidden_states/hs_<i>.safetensors`` (speculators pairs them by position):
``input_ids`` and ``loss_mask`` (int64 lists) and ``seq_len`` (its packing sampler reads
it), torch format, as speculators' own ``prepare_data`` saves them. Written after every
hidden-state file is in place; the old table's ``state.json`` is removed when a run starts
changing the export, so ``load_from_disk`` fails on a half-updated export instead of
pairing rows with the wrong files.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from hs_patch.samples import lazy_sample, store

STATE, INFO = "state.json", "dataset_info.json"
WRITER_BATCH = 64   # rows per Arrow record batch: bounds memory for long samples


def mask_sha256(mask: Any) -> str:
    """Digest of a loss mask as int64 (recorded at export, checked when the table is built)."""
    import torch

    return hashlib.sha256(memoryview(mask.to(torch.int64).contiguous().numpy()).cast("B")).hexdigest()


def unpublish(dst: Path) -> None:
    """Make ``load_from_disk(dst)`` fail until :func:`write_table` publishes a table again."""
    (dst / STATE).unlink(missing_ok=True)


def published_rows(dst: Path) -> Optional[int]:
    """The rows of the table a trainer loads from ``dst`` now (None: none loads)."""
    if not (dst / STATE).is_file():
        return None
    import datasets

    try:
        return len(datasets.load_from_disk(str(dst)))
    except Exception:  # noqa: BLE001  (any table datasets cannot load is one to write again)
        return None


def _rows(src: Path, keys: list[str], src_entries: Mapping[str, Mapping[str, Any]],
          records: Mapping[str, Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    import torch

    for key in keys:
        with lazy_sample.open_sample(src / src_entries[key]["file"]) as s:   # ids checked against the key
            ids, mask = s.tensor("input_ids"), s.tensor("loss_mask").to(torch.int64)
        if mask_sha256(mask) != records[key]["mask_sha256"]:
            raise store.SampleError(f"sample {key}: its loss mask changed since it was exported (the source file "
                                    f"is damaged, or rewritten without a new manifest line): hs-patch inspect {src} "
                                    "names it; re-ship or re-extract that sample, then run the export again")
        yield {"input_ids": ids.tolist(), "loss_mask": mask.tolist(), "seq_len": int(ids.shape[0])}


def write_table(dst: Path, src: Path, keys_by_row: list[str], src_entries: Mapping[str, Mapping[str, Any]],
                records: Mapping[str, Mapping[str, Any]]) -> int:
    """Build the table under ``dst/.tmp`` and move it in, ``state.json`` last. Returns its bytes."""
    import datasets

    datasets.disable_progress_bars()
    work = dst / store.TMPDIR / f"table.{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    try:
        try:
            ds = datasets.Dataset.from_generator(
                _rows, features=features, cache_dir=str(work / "cache"), writer_batch_size=WRITER_BATCH,
                gen_kwargs={"src": src, "keys": keys_by_row, "src_entries": src_entries, "records": records})
        except datasets.exceptions.DatasetGenerationError as e:  # what _rows raised, wrapped by datasets
            if isinstance(e.__cause__, (store.SampleError, OSError)):
                raise e.__cause__ from None
            raise
        if len(ds) != len(keys_by_row):
            raise RuntimeError(f"the table has {len(ds)} rows, expected {len(keys_by_row)}")
        ds.set_format("torch")
        ds.save_to_disk(str(work / "out"))
        del ds
        out = work / "out"
        files = [f["filename"] for f in json.loads((out / STATE).read_text())["_data_files"]]
        unpublish(dst)   # the old state.json must not name a mix of old and new data files after a crash
        for name in files + [INFO]:
            os.replace(out / name, dst / name)
        os.replace(out / STATE, dst / STATE)
        for old in dst.glob("data-*.arrow"):
            if old.name not in files:
                old.unlink()
        return sum((dst / n).stat().st_size for n in files + [INFO, STATE])
    finally:
        shutil.rmtree(work, ignore_errors=True)
