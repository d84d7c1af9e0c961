"""The export run: plan, then every sample in a pool of worker processes, then the table.

Workers read a sample through :func:`hs_patch.samples.lazy_sample.open_sample` (checked against the
source manifest's sha256), write its export file and return a manifest record; only this
process appends to ``export.jsonl``. At most ``2 x workers`` samples are in flight, so
memory is bounded by the largest samples, not the dataset. A re-run keeps every file
whose source is unchanged and whose bytes still match its record (sha256; ``quick``:
size only) and redoes the rest.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from hs_patch import __version__
from hs_patch.engine import serving
from hs_patch.host.export import arrow, layout
from hs_patch.host.export.spec import ExportRefused, ExportSpec, check_sample, like_first, resolve
from hs_patch.samples import lazy_sample, reader, store
from hs_patch.samples.files import disk_full
from hs_patch.server.status import STATUS_FILE


@dataclass
class Task:
    key: str
    src: str
    src_entry: dict[str, Any]
    dst: str
    rel: str
    row: Optional[int]
    prev: Optional[dict[str, Any]]
    spec: ExportSpec
    quick: bool = False
    fsync: bool = True
    first: dict[str, str] = field(default_factory=dict)  # spec.like_first of the export's first sample


@dataclass
class Summary:
    state: str
    exported: int = 0
    kept: int = 0
    failed: dict[str, str] = field(default_factory=dict)
    removed: int = 0
    moved: int = 0
    swept: int = 0
    src_bytes: int = 0
    out_bytes: int = 0
    tokens: int = 0
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    full: str = ""          # the destination filled up: why, and the samples not tried after it
    not_tried: int = 0


_NORM: dict[str, Any] = {}


def _norm(model: str) -> tuple[Any, float]:
    if model not in _NORM:
        from hs_patch.host.model_files import NORM_NAMES, find_name, model_info, read_tensor

        _NORM[model] = (read_tensor(model, find_name(model, NORM_NAMES, "final norm weight")),
                        model_info(model).rms_norm_eps)
    return _NORM[model]


def norm_digest(model: str) -> str:
    """sha256 of the final norm weight (and eps) ``--derive-post-norm`` computes with."""
    import hashlib

    import torch

    weight, eps = _norm(model)
    raw = weight.detach().to(torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(raw + repr(float(eps)).encode()).hexdigest()


def _init_worker(parent: Optional[int] = None) -> None:
    import torch

    torch.set_num_threads(1)
    if parent is not None:
        threading.Thread(target=_exit_with, args=(parent,), daemon=True, name="exit-with-parent").start()


def _exit_with(parent: int) -> None:
    """A worker whose export was killed (SIGKILL, the OOM killer) exits too: it would otherwise
    wait forever on the task queue, whose write end every worker holds."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def work(t: Task) -> dict[str, Any]:
    """Keep or (re)write one sample's export file; a result record for the parent."""
    dst = Path(t.dst)
    if t.prev and t.prev.get("src_sha256") == t.src_entry["sha256"] and t.prev["file"] == t.rel:
        path = dst / t.rel
        bad = (None if path.is_file() and path.stat().st_size == t.prev["bytes"] else "size") if t.quick \
            else store.verify_entry(dst, t.prev)
        if bad is None:
            return {"key": t.key, "status": "kept", "tokens": t.prev.get("tokens", 0)}
    try:
        from hs_patch.host.export import writers

        with lazy_sample.open_sample(Path(t.src) / t.src_entry["file"], entry=t.src_entry) as s:
            check_sample(t.spec, s.metadata, s.has("loss_mask"), t.first)
            rec: dict[str, Any] = {"op": "add", "key": t.key, "src_sha256": t.src_entry["sha256"],
                                   "tokens": s.num_tokens, "t": round(time.time(), 3)}
            if t.spec.format == "specforge":
                final = s.tensor(t.spec.final_source())
                if t.spec.derive_post_norm:
                    final = writers.post_norm_from_pre(final, *_norm(str(t.spec.model)))
                out = writers.write_specforge(dst, t.rel, s, t.spec.aux_planes, final, fsync=t.fsync)
            else:
                rec["row"] = t.row
                rec["mask_sha256"] = arrow.mask_sha256(s.tensor("loss_mask"))
                out = writers.write_speculators(dst, t.rel, s, t.spec.aux_planes + ["final.pre_norm"],
                                                fp8=t.spec.fp8, fsync=t.fsync)
        rec.update(file=out.file, bytes=out.nbytes, sha256=out.sha256)
        return {"key": t.key, "status": "written", "record": rec, "tokens": rec["tokens"],
                "src_bytes": t.src_entry["bytes"], "out_bytes": out.nbytes}
    except (store.SampleError, ExportRefused, OSError, RuntimeError, ValueError) as e:
        return {"key": t.key, "status": "failed", "error": f"{type(e).__name__}: {e}",
                "full": disk_full(e)}


def source_entries(src: Path) -> dict[str, dict[str, Any]]:
    """The live samples of a samples dir or shipped destination, or of a whole fleet run
    (``RUN/HOST/`` parts, merged by :func:`hs_patch.samples.reader.manifest_entries`)."""
    if not src.is_dir():
        raise ExportRefused(f"{src} {'is not a directory' if src.exists() else 'does not exist'}: give a driver's "
                            "--samples-dir, a shipped run directory (RUN/ with manifest.jsonl and samples/) or a "
                            "fleet run (RUN/HOST/ parts)")
    if (src / STATUS_FILE).is_file():  # the server's capture dir: its samples are not adopted (checked) yet
        raise ExportRefused(f"{src} is the server's capture directory (it holds {STATUS_FILE}): its samples have not "
                            "passed the driver's fidelity check; export the driver's --samples-dir or a shipped run")
    entries, problems = reader.manifest_entries(src)
    if problems:
        raise ExportRefused(f"{src}: {len(problems)} manifest problem(s), e.g. {problems[0]}; hs-patch inspect {src} "
                            "lists them: repair the run (or export its parts one by one) first")
    if not entries:
        raise ExportRefused(f"{src}: no samples in {store.MANIFEST}: give a driver's --samples-dir, a shipped run "
                            "directory (RUN/ with manifest.jsonl and samples/) or a fleet run (RUN/HOST/ parts)")
    return entries


def first_metadata(src: Path, entries: dict[str, dict[str, Any]]) -> dict[str, str]:
    """The header of the first sample that opens: what the export holds. A missing or damaged
    file is not the export's business here: it fails as that one sample, in its turn."""
    first_error: Optional[Exception] = None
    for key in sorted(entries):
        try:
            with lazy_sample.open_sample(src / entries[key]["file"]) as s:
                return dict(s.metadata)
        except (store.SampleError, OSError) as e:
            first_error = first_error or e
    raise ExportRefused(f"{src}: no sample opens (e.g. {first_error}); hs-patch inspect {src} lists what is wrong: "
                        "re-ship or re-extract the run first")


def same_width(model: str, meta: dict[str, str]) -> None:
    """Refuse a --model that did not serve these samples (its norm weight and depth would be used)."""
    from hs_patch.host.model_files import model_info

    info = model_info(model)
    if meta.get("hidden_size", "").isdigit() and int(meta["hidden_size"]) != info.hidden_size:
        raise ExportRefused(f"--model {model} has hidden_size {info.hidden_size}, the samples {meta['hidden_size']} "
                            f"(captured from {meta.get('model') or 'another model'}): give the served model's "
                            "directory")


def _serving(spec: ExportSpec, meta: dict[str, str]) -> dict[str, Any]:
    n = meta.get("num_hidden_layers")
    arch = meta.get("architecture", "")
    if spec.model:
        from hs_patch.host.model_files import model_info

        info = model_info(spec.model)
        n, arch = info.num_hidden_layers, info.architecture or arch
    if n is None:
        return {"unknown": "give --model DIR (the served model's directory) to record the serving ids"}
    return {"num_hidden_layers": int(n), "architecture": arch, "captured_layers": spec.layers,
            "releases": serving.serving_table(spec.layers, int(n), arch)}


def export(src: str | Path, dst: str | Path, spec: ExportSpec, *, workers: int = 1, quick: bool = False,
           fsync: bool = True, progress: Optional[Callable[[int, int, int, int], None]] = None) -> Summary:
    """Export SRC into DST; ``progress(done, samples, bytes_done, bytes_total)`` after each sample."""
    t0 = time.time()
    src, dst = Path(src).resolve(), Path(dst).resolve()
    entries = source_entries(src)
    meta = first_metadata(src, entries)
    spec = resolve(spec, meta)
    first = like_first(meta)
    if spec.model:
        same_width(spec.model, meta)
    if spec.format == "speculators":
        try:
            import datasets  # noqa: F401  (the table is written last: refuse before any work)
        except ImportError:
            raise ExportRefused("--format speculators writes its table with the datasets package: "
                                "pip install 'hs-patch[export]'") from None
    lock = layout.ExportLock(dst)
    try:
        prev = layout.read_info(dst)
        identity = spec.identity()
        if spec.derive_post_norm:  # the model's norm weight decides the bytes: another model's makes others
            identity["norm_weight_sha256"] = norm_digest(str(spec.model))
        if prev and prev.get("identity") != identity:
            raise ExportRefused(f"{dst} holds another export ({prev.get('identity')}); export into a new directory "
                                "or remove this one")
        if not prev and any(p.name != layout.LOCK for p in dst.iterdir()):
            raise ExportRefused(f"{dst} is not empty and holds no export.json: give a new or empty directory")
        gone = set(layout.live_entries(dst)) - set(entries) if prev else set()
        if gone and prev.get("source") not in (None, str(src)):
            raise ExportRefused(f"{dst} is an export of {prev['source']}, and {src} lacks {len(gone)} of its samples, "
                                "which this run would delete from it: export into a new directory (runs are merged "
                                f"at the source, e.g. a fleet run's RUN/HOST/ parts), or remove {dst} first")
        info = {"identity": identity, "source": str(src), "hs_patch": __version__, "state": "in-progress",
                "sample_format": meta.get("format"), "dtype": spec.files_dtype(meta), "capture_dtype": meta.get("dtype"),
                "hidden_size": meta.get("hidden_size"),
                "sglang_release_captured": meta.get("sglang_release"), "model": meta.get("model"),
                "final": spec.final_label(), "serving": _serving(spec, meta), "started": time.time()}
        if spec.format == "speculators":
            info.update(hidden_states_dir=layout.hs_dir(spec.fp8), table_bytes=prev.get("table_bytes"))
        layout.write_info(dst, info)
        log = store.Manifest(dst, layout.LOG)
        keys = sorted(entries)
        table_ok = spec.format == "speculators" and arrow.published_rows(dst) == len(keys)
        pl = layout.plan(dst, spec.format, spec.fp8, keys, log,
                         before_rows_change=lambda: arrow.unpublish(dst))  # no trainer may load the old table
        if spec.format == "speculators" and (pl.removed or pl.moved):
            table_ok = False
        live = layout.live_entries(dst)
        rows_added = any(k not in live for k in keys)
        if table_ok and any(live[k].get("src_sha256") != entries[k]["sha256"] for k in keys if k in live):
            arrow.unpublish(dst)  # a row's source changed (its loss mask may have): its table is built again
            table_ok = False
        tasks = [Task(k, str(src), entries[k], str(dst), layout.rel_path(spec.format, k, pl.rows[k], spec.fp8),
                      pl.rows[k], live.get(k), spec, quick, fsync, first) for k in keys]
        summ = Summary("incomplete", removed=len(pl.removed), moved=len(pl.moved), swept=len(pl.swept))
        total = sum(e["bytes"] for e in entries.values())
        done_bytes = 0
        results = _results(tasks, workers)
        for i, res in enumerate(results, 1):
            done_bytes += entries[res["key"]]["bytes"]
            if res["status"] == "written":
                log.append(res["record"])
                summ.exported += 1
                summ.src_bytes += res["src_bytes"]
                summ.out_bytes += res["out_bytes"]
            elif res["status"] == "kept":
                summ.kept += 1
            else:
                summ.failed[res["key"]] = res["error"]
                if res.get("full"):   # every later sample would be read in full only to fail the same way
                    summ.full, summ.not_tried = res["error"], len(tasks) - i
                    results.close()
                    break
            summ.tokens += int(res.get("tokens", 0))
            if progress:
                progress(i, len(tasks), done_bytes, total)
        live = layout.live_entries(dst)
        if not summ.failed and spec.format == "speculators" and not (table_ok and not rows_added):
            by_row = sorted(keys, key=lambda k: pl.rows[k])
            try:
                info["table_bytes"] = arrow.write_table(dst, src, by_row, entries, live)
            except store.SampleError as e:  # a source read again for its row: the export stays incomplete
                summ.failed["the speculators table"] = f"SampleError: {e}"
        summ.state = "complete" if not summ.failed else "incomplete"
        info.update(state=summ.state, samples=len(live), tokens=summ.tokens, finished=time.time(),
                    bytes=sum(e["bytes"] for e in live.values()), failed=len(summ.failed))
        layout.write_info(dst, info)
        summ.info = info
    finally:
        lock.close()
    summ.seconds = round(time.time() - t0, 3)
    return summ


def _results(tasks: list[Task], workers: int) -> Iterable[dict[str, Any]]:
    if workers <= 1:
        _init_worker()
        yield from map(work, tasks)
        return
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=_init_worker, initargs=(os.getpid(),)) as pool:
        pending: set[Future] = set()
        it = iter(tasks)
        try:
            while True:
                while len(pending) < 2 * workers and (t := next(it, None)) is not None:
                    pending.add(pool.submit(work, t))
                if not pending:
                    return
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    yield f.result()
        except BaseException:
            for f in pending:
                f.cancel()
            raise
