"""The capture hook that runs inside the SGLang server (imported only when HS_CAPTURE=1).

The patched ``DeepseekV2Model`` calls, per forward pass::

    _hs = self._hs_capture.begin(forward_batch, input_ids, <the embedded rows>)  # None: nothing to capture
    ... layer(..., captured_last_layer_outputs=_hs.collector(i, <SGLang's own collector>))
        # inside the decoder layer, after prepare_attn: the collector gets the residual and
        # collector.hs_attn_input(<what the layer's attention reads>); around prepare_mlp:
        # collector.hs_attn_output(<the attention's output>), collector.hs_mid(<the residual after it>)
    ... _hs.final_prenorm(<output of the last layer, before the final norm>)
    _hs.finish(<hidden states after the final norm>)

Rules it keeps: only plain prefill passes (``ForwardMode.EXTEND``), never decode, never
while a CUDA graph is being captured or torch.compile traces; one tensor-parallel rank
writes (under TP every rank holds the full residual stream; the others add their share of
each captured layer's attention-output fingerprints: ``ranks.py``); what the model computes
and returns is never changed (captures are copies). On the GPU a captured tensor is
snapshotted into one of the device buffers made at start (``device_ring.py``; its storage is
updated in place later) on the compute stream, then copied to pinned host memory on a side
stream, so the forward pass never waits for PCIe or disk and allocates nothing sized by the
pass; every captured tensor is also fingerprinted there, on the live tensor
(``fingerprint.py``), for the driver's check of every plane. A background writer
(``writer.py``) writes the files. When all staging buffers are busy the forward pass waits
(back-pressure, logged); past HS_CAPTURE_STALL_SECONDS, or if the writer stopped (a failed
write, or its coordinator thread ended), the server fails loudly with the cause. Nothing is
ever dropped silently. At start, holding the directory's lock, the hook removes what a
killed server left there (``leftovers.py``).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import queue
import threading
import time
from typing import Any, Optional

import torch

from hs_patch.engine import serving
from hs_patch.engine.releases import RELEASES
from hs_patch.samples import files, store
from hs_patch.server import config as capture_config
from hs_patch.server import checks as server_checks
from hs_patch.server import fingerprint, fp8, leftovers
from hs_patch.server.check_rows import check_room
from hs_patch.server.device_ring import DeviceRing
from hs_patch.server.passes import Pass, Slot
from hs_patch.server.ranks import RankHook, capturable, tp_all_reduce
from hs_patch.server.records import PassRecord
from hs_patch.server.writer import Writer

log = logging.getLogger("hs_patch")
WRITER_LOCK = ".hs-writer.lock"
WAIT_LOG_SECONDS = 60.0  # back-pressure is logged at most this often (every wait is counted)


def attach(model: torch.nn.Module, config: Any, release: str) -> Optional["CaptureHook | RankHook"]:
    """Called by the patched ``DeepseekV2Model.__init__`` when HS_CAPTURE is set.

    Refuses unsupported server settings (raises, so the server does not start); on a rank that does
    not write (tensor parallelism), a :class:`RankHook` that adds its share of the fingerprints.
    """
    cfg = capture_config.from_env()
    if not cfg.enabled:
        return None
    cfg = cfg.for_model(int(config.num_hidden_layers))
    settings = server_checks.read_settings()
    problems = server_checks.refusals(settings) + server_checks.capture_refusals(cfg, settings)
    if problems:
        raise RuntimeError("hs_patch capture (HS_CAPTURE=1) cannot run with these settings:\n  - "
                           + "\n  - ".join(problems))
    if not cfg.slot_tokens:  # a pass holds at most --chunked-prefill-size tokens (refused above when unbounded)
        cfg = dataclasses.replace(cfg, slot_tokens=int(settings["chunked_prefill_size"]))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    all_reduce = tp_all_reduce(int(settings["tp_size"]))
    if settings["tp_rank"] != cfg.rank:
        # said on every rank that does not write, so a TP=N server log shows N-1 of these and one "capturing"
        rank = RankHook(cfg.layers, cfg.slot_tokens, cfg.skip_rid_prefix, device, all_reduce)
        log.info("hs_patch: rank %d of %d does not write (HS_CAPTURE_RANK=%d writes); it adds its share of the "
                 "captured layers' attention-output fingerprints (%.1f MB on %s, made at start)",
                 settings["tp_rank"], settings["tp_size"], cfg.rank, rank.device_bytes / 1e6, device)
        return rank
    meta = {
        "sglang_release": release,
        "model_type": str(getattr(config, "model_type", "")),
        "model": str(getattr(config, "_name_or_path", "") or ""),
        "architecture": ",".join(getattr(config, "architectures", None) or []),
        "tp_size": str(settings["tp_size"]),
        "tp_rank": str(settings["tp_rank"]),
        "num_hidden_layers": str(int(config.num_hidden_layers)),
    }
    meta.update(_serving_ids(release, cfg.layers, int(config.num_hidden_layers), meta["architecture"]))
    hook = CaptureHook(cfg, hidden_size=int(config.hidden_size), metadata=meta, dtype=torch.get_default_dtype(),
                       pinned=device is not None, device=device, all_reduce=all_reduce, release=release)
    _register(hook)
    log.info("hs_patch: capturing layers %s + final=%s as %s into %s (rank %d of %d); made at start: %.2f GB of "
             "pinned host staging (%d x %d tokens) and %.2f GB on %s (%d device buffers + fingerprints), nothing on "
             "the forward path", list(cfg.layers), cfg.final, cfg.dtype, cfg.directory, settings["tp_rank"],
             settings["tp_size"], hook.host_bytes / 1e9, cfg.slots, cfg.slot_tokens, hook.device_bytes / 1e9, device,
             cfg.device_buffers)
    return hook


def _serving_ids(release: str, layers: Any, n: int, architecture: str) -> dict[str, str]:
    """The drafter ids that make this release feed the captured layers (hs_patch.engine.serving), for every sample."""
    try:
        return {"eagle_aux_hidden_state_layer_ids": json.dumps(serving.eagle_ids(release, list(layers), n,
                                                                                  architecture))}
    except serving.NotServable as e:
        return {"eagle_serving_refused": str(e)}


class CaptureHook:
    """One per captured model; owns the staging buffers, the copy stream and the writer."""

    def __init__(self, cfg: capture_config.CaptureConfig, *, hidden_size: int, metadata: dict[str, str],
                 dtype: torch.dtype = torch.bfloat16, pinned: bool = False, device: Optional[torch.device] = None,
                 all_reduce: Any = None, release: str = ""):
        """``all_reduce``: sums a tensor in place over the tensor-parallel ranks (None at TP=1): the
        attention output's fingerprints (:mod:`hs_patch.server.ranks`). What the patch hands the hook depends
        on its ``release``'s family (default: ``metadata['sglang_release']``; the final norm's inputs where its
        family's ``final_add``; an unknown release: everything)."""
        self.cfg = cfg
        itemsize = torch.empty((), dtype=dtype, device="cpu").element_size()
        fingerprint.check_hidden(hidden_size, itemsize)
        self.fp8 = cfg.dtype == "fp8"
        if self.fp8:
            fingerprint.check_hidden(hidden_size, 1)  # the checksums' words of one-byte values
        self.all_reduce = all_reduce
        self._lock_fd = _lock_capture_dir(cfg.directory)
        self.cleaned = leftovers.clean(cfg.directory)  # a dead server's files: no writer is alive (we hold the lock)
        self.hidden_size = hidden_size
        self.planes = store.plane_names(cfg.layers, cfg.final)
        known = RELEASES.get(release or metadata.get("sglang_release", ""))
        self.streams = fingerprint.streams(cfg.layers, cfg.final, known is None or known.family.final_add)
        self.layer_index = {layer: k for k, layer in enumerate(cfg.layers)}
        self.checksums = fingerprint.checksum_streams(cfg.layers, cfg.final)
        self.attn_index = [self.streams.index(fingerprint.attn_stream(layer)) for layer in cfg.layers]
        self.additive_index = [tuple(self.streams.index(fingerprint.layer_stream(kind, layer))
                                     for kind in fingerprint.ADDITIVE) for layer in cfg.layers]
        final = store.FINAL_PLANES[cfg.final]
        self.pre_index = self.planes.index("final.pre_norm") if "final.pre_norm" in final else None
        self.post_index = self.planes.index("final.post_norm") if "final.post_norm" in final else None
        self._free: "queue.Queue[Slot]" = queue.Queue()
        if cfg.slot_tokens < 1:
            raise capture_config.ConfigError("HS_CAPTURE_SLOT_TOKENS must be >= 1 (or unset: the server's "
                                             "--chunked-prefill-size)")
        # the LM head's input at each prompt's last rows, as the engine computed it (bf16), for the fidelity check's
        # logits: where no final plane is stored, and where the stored ones are fp8
        self.check_rows = cfg.check_rows if cfg.final == "none" or self.fp8 else 0
        slots = [Slot(cfg.slot_tokens, len(self.planes), len(self.streams), hidden_size, itemsize, pinned, device,
                      nchecksums=len(self.checksums), check=check_room(cfg.slot_tokens, self.check_rows),
                      fp8=self.fp8)
                 for _ in range(cfg.slots)]  # all staging memory now: never an allocation on the forward path
        for slot in slots:
            self._free.put(slot)
        self._ring = None if device is None else \
            DeviceRing(cfg.device_buffers, cfg.slot_tokens, hidden_size, itemsize, device)
        # fp8: one work buffer of the model's dtype where the quantization runs (compute-stream order only)
        self._work = torch.empty(cfg.slot_tokens * hidden_size * itemsize if self.fp8 else 0, dtype=torch.uint8,
                                 device=device if device is not None else "cpu")
        self.host_bytes = sum(slot.host_bytes for slot in slots) + (0 if device is not None else self._work.numel())
        self.device_bytes = (self._ring.nbytes if self._ring else 0) + sum(slot.device_bytes for slot in slots) + \
            (self._work.numel() if device is not None else 0)
        self._streams: dict[Any, torch.cuda.Stream] = {}
        self._current: Optional[Pass] = None
        self.waits = 0
        self.wait_seconds = 0.0
        self._wait_logged: Optional[float] = None
        meta = {
            "format": store.FORMAT_FP8 if self.fp8 else store.FORMAT,
            "layers": ",".join(map(str, cfg.layers)),
            "final": cfg.final,
            "planes": ",".join(self.planes),
            "hidden_size": str(hidden_size),
            "convention": "layer.<i> = residual stream entering decoder layer i (output of layer i-1); "
                          "final.pre_norm = output of the last layer before the final norm",
            fingerprint.META: fingerprint.describe(self.streams),
            fingerprint.CHECKSUM_META: fingerprint.describe_checksums(self.checksums),
            **({fp8.META: fp8.SCHEME, fp8.SOURCE_META: str(dtype).replace("torch.", "")} if self.fp8 else {}),
            **metadata,
        }
        self.writer = Writer(cfg.directory, self.planes, meta, workers=cfg.writers,
                             skip_rid_prefix=cfg.skip_rid_prefix, fsync=not _on_tmpfs(cfg.directory),
                             extra_status=lambda: {"waits": self.waits, "wait_seconds": round(self.wait_seconds, 3),
                                                   "free_slots": self._free.qsize(), "cleaned_at_start": self.cleaned,
                                                   "host_bytes_at_start": self.host_bytes, "gpu": self._gpu_status()})

    # ------------------------------------------------------------------ per pass
    def begin(self, forward_batch: Any, input_ids: Optional[torch.Tensor],
              embedded: Optional[torch.Tensor] = None) -> Optional[Pass]:
        """The capture of this forward pass (None: nothing to capture). ``embedded``: the rows the model's
        residual stream begins from (its embedding of the ids); a patch older than #33 does not give it,
        and its passes are then refused at ``finish``, saying to re-apply the patch."""
        if not capturable(forward_batch, self.cfg.skip_rid_prefix):
            return None
        self._check_writer()
        if self._current is not None:  # the previous pass raised before finish(): give its buffer back
            log.warning("hs_patch: a prefill pass ended without finishing its capture; it is not written")
            self._free.put(self._current.slot)
            self._current = None
        ids = input_ids if input_ids is not None else forward_batch.input_ids
        seq_lens = forward_batch.extend_seq_lens_cpu
        prefix_lens = forward_batch.extend_prefix_lens_cpu
        if seq_lens is None:
            seq_lens = forward_batch.extend_seq_lens.tolist()
        if prefix_lens is None:
            prefix_lens = forward_batch.extend_prefix_lens.tolist()
        rids = getattr(forward_batch, "rids", None)
        tokens = int(ids.shape[0])
        if sum(seq_lens) != tokens:
            raise RuntimeError(f"hs_patch: the pass has {tokens} tokens but extend_seq_lens sum to "
                               f"{sum(seq_lens)} (padded batch?); capture cannot split it per request")
        if tokens > self.cfg.slot_tokens:
            raise RuntimeError(f"hs_patch: a prefill pass of {tokens} tokens exceeds the staging buffers' "
                               f"{self.cfg.slot_tokens} (HS_CAPTURE_SLOT_TOKENS, default --chunked-prefill-size); "
                               "set HS_CAPTURE_SLOT_TOKENS to at least the largest pass and restart")
        full = getattr(forward_batch, "orig_seq_lens", None)
        if full is None:
            raise RuntimeError("hs_patch: the forward batch has no orig_seq_lens (each prompt's whole length), "
                               "which the capture needs to reassemble chunked prompts; this SGLang build differs "
                               "from the supported releases")
        slot = self._acquire()
        p = Pass(self, slot, tokens, list(seq_lens), list(prefix_lens), rids)
        p.copy_ids(ids, full)
        p.embedded(embedded)
        self._current = p
        return p

    # ------------------------------------------------------------------ what a pass asks of its hook
    def ended(self, p: Pass) -> None:
        """``p`` reached its ``finish``: the next pass begins afresh."""
        self._current = None

    def give_back(self, slot: Slot) -> None:
        self._free.put(slot)

    def submit(self, record: PassRecord) -> None:
        self.writer.submit(record)

    def _check_writer(self) -> None:
        """Raise, with its cause, if the writer stopped (a failed write, or its coordinator thread ended)."""
        error = self.writer.stopped()
        if error is None:
            return
        hint = (f"Fix the cause (disk full? permissions on {self.cfg.directory}?) and restart the server."
                if isinstance(error, OSError) else "Please report this with the server log; restart the server.")
        raise RuntimeError(f"hs_patch: the sample writer failed ({error}); samples after it were not written. "
                           + hint) from error

    def _acquire(self) -> Slot:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        t0 = time.monotonic()
        if self._wait_logged is None or t0 - self._wait_logged >= WAIT_LOG_SECONDS:
            self._wait_logged = t0
            log.warning("hs_patch: all %d staging buffers are busy; the forward pass waits for the writer "
                        "(%d earlier waits, %.1f s in all; logged at most once a minute, counted in "
                        "hook_status.json). Persistent waits: raise HS_CAPTURE_SLOTS or HS_CAPTURE_WRITERS, "
                        "or write to a faster directory.", self.cfg.slots, self.waits, self.wait_seconds)
        deadline = t0 + self.cfg.stall_seconds
        while True:  # in short waits: a writer that stopped meanwhile gives no buffer back, and says why
            try:
                slot = self._free.get(timeout=max(0.0, min(0.5, deadline - time.monotonic())))
                break
            except queue.Empty:
                self._check_writer()
                if time.monotonic() >= deadline:
                    raise RuntimeError(
                        f"hs_patch: the sample writer has been behind for {self.cfg.stall_seconds:g}s "
                        f"(HS_CAPTURE_STALL_SECONDS); {self.cfg.directory} is too slow or blocked. Failing loudly "
                        "instead of dropping samples.") from None
        self.waits += 1
        self.wait_seconds += time.monotonic() - t0
        return slot

    def _gpu_status(self) -> Optional[dict[str, int]]:
        """The writing rank's GPU memory (PyTorch's allocator: this process, every allocation, SGLang's too)."""
        if self._ring is None:
            return None
        d = self._ring.device
        return {"made_at_start": self.device_bytes, "allocated": torch.cuda.memory_allocated(d),
                "max_allocated": torch.cuda.max_memory_allocated(d), "reserved": torch.cuda.memory_reserved(d),
                "max_reserved": torch.cuda.max_memory_reserved(d)}

    def ring(self, device: torch.device) -> DeviceRing:
        """The device buffers captured tensors are snapshotted into (made at start on the model's GPU)."""
        if self._ring is None or self._ring.device != device:
            raise RuntimeError(f"hs_patch: a captured state is on {device}, the capture's device buffers were made on "
                               f"{None if self._ring is None else self._ring.device} at start (the current CUDA device "
                               "when the model was built); please report this with the server's flags")
        return self._ring

    def work(self, like: torch.Tensor) -> torch.Tensor:
        """HS_CAPTURE_DTYPE=fp8: the work buffer made at start, as ``like``'s dtype and shape (where it is)."""
        need = like.numel() * like.element_size()
        if not self.fp8 or need > self._work.numel() or self._work.device != like.device:
            raise RuntimeError(f"hs_patch: a captured state of {tuple(like.shape)} {like.dtype} on {like.device} does "
                               f"not fit the fp8 work buffer made at start ({self._work.numel()} bytes on "
                               f"{self._work.device}); please report this with the server's flags")
        return self._work[:need].view(like.dtype).view(like.shape)

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        s = self._streams.get(device)
        if s is None:
            s = self._streams[device] = torch.cuda.Stream(device=device)
        return s

    def close(self, timeout: float = 60.0) -> None:
        """Drain the writer and let go of the capture directory (tests, benchmarks; the server just exits).
        Once only: the exit handler's close of a hook closed already does nothing. Raises if the writer had
        failed: the passes it had taken after its failure were not written."""
        if self._lock_fd < 0:
            return
        try:
            self.writer.close(timeout)
            self._check_writer()
        finally:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1


def _lock_capture_dir(directory: str) -> int:
    """One writing server per capture directory: an exclusive flock held for the process's life."""
    files.private_dirs(directory)
    path = os.path.join(directory, WRITER_LOCK)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RuntimeError(f"hs_patch: {directory} is written by {holder}; give each server its own "
                           "HS_CAPTURE_DIR") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"SGLang server pid {os.getpid()}".encode(), 0)
    return fd


def _on_tmpfs(path: str) -> bool:
    """True if ``path`` is on tmpfs (/dev/shm): fsync is pointless there."""
    best, fstype = "", ""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and (path == parts[1] or path.startswith(parts[1].rstrip("/") + "/")) \
                        and len(parts[1]) > len(best):
                    best, fstype = parts[1], parts[2]
    except OSError:
        return False
    return fstype == "tmpfs"


# Interpreter exit: let the writer finish what is queued (daemon threads would be cut).
_HOOKS: list[CaptureHook] = []
_lock = threading.Lock()


def _register(hook: CaptureHook) -> None:
    import atexit

    with _lock:
        if not _HOOKS:
            atexit.register(lambda: [h.close(timeout=float(os.environ.get("HS_CAPTURE_EXIT_SECONDS", "60")))
                                     for h in _HOOKS])
        _HOOKS.append(hook)
