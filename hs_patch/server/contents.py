"""What one sample file holds, as the capture writer (:mod:`hs_patch.server.writer`) writes it.

The planes (whole, or in place chunk by chunk: :mod:`hs_patch.server.inplace`), then the
small tensors: ``input_ids``, the driver's ``loss_mask`` (from its intent: :mod:`hs_patch.samples.intent`)
and the ``fingerprint`` and ``checksum`` rows (:mod:`hs_patch.server.fingerprint`); the header metadata: the
hook's, the sample's own (key, length, parts and where each began, request id), and the
intent's provenance. The manifest line's extra fields come from here too. Runs in the writer's
threads inside the SGLang server: standard library and torch only.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

from hs_patch.samples import intent as intents
from hs_patch.samples import store
from hs_patch.server import fingerprint, fp8
from hs_patch.server.inplace import InPlaceSample, OpenPrompt

if TYPE_CHECKING:  # pragma: no cover
    from pathlib import Path

    import torch

log = logging.getLogger("hs_patch")


class Contents:
    """Builds and writes sample files for one capture directory (the writer owns one)."""

    def __init__(self, directory: "Path", planes: Sequence[str], metadata: dict[str, str], *, fsync: bool):
        self.directory, self.planes, self.metadata, self.fsync = directory, list(planes), dict(metadata), fsync
        self.fingerprinted = fingerprint.META in metadata  # then every pass brings its fingerprint rows
        self.checksummed = fingerprint.CHECKSUM_META in metadata  # and its checksum rows
        self.fp8 = fp8.META in metadata  # and, fp8 planes, their scales

    def start_open(self, ids: "torch.Tensor", full: int, rid: Optional[str], like: "torch.Tensor") -> OpenPrompt:
        """The in-place file of a prompt longer than this pass, laid out for all ``full`` tokens."""
        sample = InPlaceSample(self.directory, f"open-{store.sample_key(ids)[:12]}", self.planes, full,
                               like.shape[1], store.dtype_name(like))
        return OpenPrompt(sample, 0, store.key_hasher(), rid, [], 1, str(like.dtype).replace("torch.", ""))

    def put(self, sample: InPlaceSample, start: int, slices: list["torch.Tensor"]) -> None:
        """A chunk's rows of every plane, one after another: writes into one file serialize on its inode lock
        in Linux (tmpfs included), so planes written side by side gained nothing and cost CPU (issue #22)."""
        for k, (name, t) in enumerate(zip(self.planes, slices)):
            sample.put(k, start, store.raw_bytes(name, t))

    def write_whole(self, ids: "torch.Tensor", slices: list["torch.Tensor"], rid: Optional[str],
                    fp: Optional["torch.Tensor"], cs: Optional["torch.Tensor"] = None,
                    check: Optional["torch.Tensor"] = None,
                    scales: Optional["torch.Tensor"] = None) -> tuple[store.Written, dict[str, Any]]:
        """A request prefilled in one pass: the whole file at once, its ranges written and hashed side by side."""
        key = store.sample_key(ids)
        n = int(ids.shape[0])
        found = self.intent(key, n)
        tensors = [store.tensor_bytes(name, t) for name, t in zip(self.planes, slices)] + \
            self.tail(ids, found, fp, cs, check, scales)
        meta = self.meta(key, n, str(slices[0].dtype).replace("torch.", ""), rid, [0], found, check)
        return store.write_temp(self.directory, key, tensors, meta, fsync=self.fsync, ranges=True), \
            self.extra(found, rid, 1, n)

    def complete(self, part: OpenPrompt) -> tuple[store.Written, dict[str, Any]]:
        """A chunked prompt's last chunk is in: small tensors, header, one hashing read."""
        import torch

        key = part.hasher.hexdigest()[: store.KEY_HEX]
        ids = torch.cat(part.ids)
        n = int(ids.shape[0])
        found = self.intent(key, n)
        fp = torch.cat(part.fingerprints) if part.fingerprints else None
        cs = torch.cat(part.checksums) if part.checksums else None
        sc = torch.cat(part.scales, dim=1) if part.scales else None
        meta = self.meta(key, n, part.dtype, part.rid, part.starts, found, part.check)
        return part.sample.finish(key, self.tail(ids, found, fp, cs, part.check, sc), meta, fsync=self.fsync), \
            self.extra(found, part.rid, part.parts, n)

    def meta(self, key: str, n: int, dtype: str, rid: Optional[str], starts: Sequence[int],
             found: Optional[intents.Intent], check: Optional["torch.Tensor"] = None) -> dict[str, str]:
        meta = dict(self.metadata, key=key, num_tokens=str(n), parts=str(len(starts)), dtype=dtype,
                    chunks=",".join(map(str, starts)), rid="" if rid is None else str(rid),
                    created=f"{time.time():.3f}")
        if check is not None:
            meta[store.CHECK_ROWS] = str(check.shape[0])  # the prompt's last positions the tensor holds
        if found is not None:
            meta.update({k: v for k, v in found.metadata.items() if k not in meta}, loss_tokens=str(found.loss_tokens))
        return meta

    def tail(self, ids: "torch.Tensor", found: Optional[intents.Intent], fp: Optional["torch.Tensor"],
             cs: Optional["torch.Tensor"] = None, check: Optional["torch.Tensor"] = None,
             scales: Optional["torch.Tensor"] = None) -> list[store.TensorBytes]:
        tail = [store.tensor_bytes("input_ids", ids.contiguous())]
        if self.fp8:  # each plane's scales, F32 [n] (hs_patch.server.fp8)
            if scales is None or tuple(scales.shape) != (len(self.planes), ids.shape[0]):
                raise RuntimeError("a pass of fp8 planes came without their scales (internal error)")
            tail += [store.tensor_bytes(fp8.scale_name(name), scales[k].contiguous())
                     for k, name in enumerate(self.planes)]
        if check is not None:
            tail.append(store.tensor_bytes(store.CHECK_TENSOR, check.contiguous()))
        if found is not None:
            tail.append(store.TensorBytes("loss_mask", "U8", (found.tokens,), [found.loss_mask()]))
        for on, rows, name in ((self.fingerprinted, fp, fingerprint.TENSOR),
                               (self.checksummed, cs, fingerprint.CHECKSUM_TENSOR)):
            if on:
                if rows is None or rows.shape[0] != ids.shape[0]:
                    raise RuntimeError(f"a pass came without the {name} rows of its samples (internal error)")
                tail.append(store.tensor_bytes(name, rows.contiguous()))
        return tail

    def extra(self, found: Optional[intents.Intent], rid: Optional[str], parts: int, n: int) -> dict[str, Any]:
        """The manifest line's fields beyond the file's key, name, size and sha256."""
        extra: dict[str, Any] = {"rid": "" if rid is None else str(rid), "parts": parts, "tokens": n}
        if found is not None:
            extra.update(sample_id=found.metadata.get("sample_id", ""), run=found.metadata.get("run", ""),
                         loss_tokens=found.loss_tokens)
        return extra

    def intent(self, key: str, tokens: int) -> Optional[intents.Intent]:
        try:
            return intents.read(self.directory, key, tokens)
        except intents.IntentError as e:
            log.error("hs_patch: sample %s is written without the driver's loss mask: %s", key, e)
            store.log_error(self.directory, {"error": "intent_unusable", "key": key, "why": str(e)})
            return None
