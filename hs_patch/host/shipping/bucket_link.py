"""The shipper's link to an S3 bucket: what :class:`hs_patch.host.shipping.link.Link` is for rsync.

The shipper's batch loop (:mod:`hs_patch.host.shipping.batches`) drives both the same way. Here
``start_commit`` does a batch's whole round in a thread of its own (the loop starts the next batch
meanwhile): for each sample, a HEAD first (the store already holds it verified: nothing is sent,
which is how a resume skips only what the store verified; it holds another verified version
listed in its manifest: ``kept``, as at an rsync destination); then the uploads, every part and
object of the batch in flight on ``--s3-concurrency`` threads, each carrying its SHA256
(:mod:`hs_patch.host.shipping.bucket`); then a HEAD of each (size and checksum against the
manifest line), and the manifest rewritten with the verified ones (``etag`` recorded: the next
start's cheap check compares it). A sample another shipper of the prefix wrote meanwhile is ``raced``:
its object is left to that shipper for ``YIELD_SECONDS`` (kept once listed), and the batch loop decides
it again after a pause (:data:`hs_patch.host.shipping.batches.RACE_PAUSE`).

A multipart upload started is recorded in ``STATE/s3_uploads.jsonl`` until completed or aborted;
an upload cut by an outage is aborted (and its sample sent again whole), and the uploads a killed
shipper left are aborted when the link next opens, so no orphaned parts hold space at the store.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from hs_patch.host.shipping.bucket import (SAMPLES, SINGLE_PUT_MAX, Bucket, BucketDest, DigestRefused, Raced,
                                           S3Options, b64, error_code, head_holds)
from hs_patch.host.shipping.bucket_commit import BucketCommit, finish_all
from hs_patch.host.shipping.link import LinkError
from hs_patch.samples.files import RANGE, RANGED, JsonLog, file_sha256, ranged, read_jsonl, write_text_atomic

UPLOADS = "s3_uploads.jsonl"
# After losing a race for a sample (another shipper of the prefix wrote it), its object is left to that shipper
# this long: replaced only if still not listed in the manifest by then (that shipper gone). Two shippers that
# replaced each other's copies in turn each gave up after --retries rounds (seen in CI under load).
YIELD_SECONDS = 30.0


class BucketLink:
    def __init__(self, dest: BucketDest, opts: S3Options, state_dir: Path):
        self.dest, self.opts = dest, opts
        self.bucket: Bucket | None = None
        self.pool = ThreadPoolExecutor(opts.concurrency, thread_name_prefix="hs-ship-s3")
        self.manifest_lock = threading.Lock()
        self.journal_path = Path(state_dir) / UPLOADS
        self.raced_at: dict[str, float] = {}  # object key -> when this shipper first lost a race for it (monotonic)
        self.journal = JsonLog(self.journal_path)
        self.src_dir = Path(".")

    # ------------------------------------------------------------------ the shipper's Link interface

    def alive(self) -> bool:
        return self.bucket is not None

    def reopen(self) -> None:
        """A client, the bucket checked (refused: wrong credentials, no such bucket), leftovers aborted."""
        bucket = Bucket(self.dest, self.opts)
        bucket.check_bucket()
        self.bucket = bucket
        self.abort_leftovers()

    def __exit__(self, *exc: Any) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def send(self, src_dir: Path, names: list[str], *, recheck: bool = False) -> tuple[int, str]:
        """Nothing to do before the commit: it reads, sends and verifies each file itself."""
        self.src_dir = src_dir
        return 0, ""

    def start_commit(self, files: list[dict[str, Any]]) -> BucketCommit:
        return BucketCommit(lambda c: self.ship(files, c))

    def check_destination(self, deep: bool = False) -> dict[str, Any]:
        """As :meth:`Link.check_destination`: each object the manifest lists against the listing (size, and
        the ETag recorded when it was verified), or with ``deep`` its digest computed from a GET; a damaged
        one's line is dropped from the manifest (the object stays until the sample is shipped again)."""
        b = self.need()
        entries, _ = b.read_manifest()
        listing = b.list_samples()
        ours = [e for e in entries.values() if type(e.get("bytes")) is int and isinstance(e.get("sha256"), str)]
        whys = list(self.pool.map(lambda e: self.damage(e, listing, deep), ours))
        damaged = [{"key": e["key"], "file": e.get("file"), "why": why} for e, why in zip(ours, whys) if why]
        if damaged:
            gone = {d["key"]: entries[d["key"]] for d in damaged}

            def drop(current: dict[str, dict[str, Any]]) -> bool:
                keys = [k for k, e in gone.items() if current.get(k) == e]  # unless rewritten meanwhile
                for k in keys:
                    del current[k]
                return bool(keys)
            with self.manifest_lock:
                b.update_manifest(drop)
        fields = ("key", "file", "bytes", "sha256", "sample_id", "line_sha256")  # as at_destination's listing
        left = [{k: e.get(k) for k in fields} for k, e in entries.items() if k not in {d["key"] for d in damaged}]
        return {"entries": left, "damaged": damaged, "checked": len(ours)}

    # ------------------------------------------------------------------ one batch

    def need(self) -> Bucket:
        if self.bucket is None:
            self.reopen()
        assert self.bucket is not None
        return self.bucket

    def ship(self, files: list[dict[str, Any]], commit: BucketCommit) -> list[dict[str, Any]]:
        try:
            return self.round(files, commit)
        except LinkError:
            self.bucket = None  # reopened after the outage: the bucket checked again, cut uploads aborted
            raise

    def round(self, files: list[dict[str, Any]], commit: BucketCommit) -> list[dict[str, Any]]:
        b = self.need()
        stored, _ = b.read_manifest()
        results = [{"file": f["file"], "status": "", "bytes": f["bytes"], "sha256": f["sha256"]} for f in files]
        # 1. what the store holds already (and the condition an upload over it is sent with)
        for res, held in zip(results, self.pool.map(lambda f: self.held(b, f, stored), files)):
            res.update(held)
        # 2. the rest sent, every part of every file in flight at once
        todo = [(res, f) for res, f in zip(results, files) if not res["status"]]
        uploads: list[Callable[[], dict[str, Any]]] = []
        try:
            for res, f in todo:
                uploads.append(self.upload(b, f, commit, res.pop("cond")))
        except BaseException:
            for finish in uploads:  # those started end (and close their files) before the failure is raised
                try:
                    finish()
                except BaseException:
                    pass
            raise
        finish_all([res for res, _ in todo], uploads)
        # 3. a HEAD of each sent: size and checksum as the manifest line says
        sent = [(res, f) for res, f in zip(results, files) if res["status"] == "sent"]
        for (res, f), h in zip(sent, self.pool.map(lambda rf: b.head(self.object(rf[1])), sent)):
            res.update(self.after_upload(h, f, res.get("etag")))
        # 4. the manifest, written last, with the verified ones
        self.list_verified(b, [(res, f) for res, f in zip(results, files) if res["status"] == "ok"])
        now = time.monotonic()
        for res, f in zip(results, files):
            if res["status"] == "raced":
                self.raced_at.setdefault(self.object(f), now)
            elif res["status"] in ("ok", "kept"):
                self.raced_at.pop(self.object(f), None)
        for res in results:
            res.pop("etag", None)
            res.pop("cond", None)
        return results

    @staticmethod
    def after_upload(h: dict[str, Any] | None, f: dict[str, Any], etag: str | None) -> dict[str, Any]:
        """What the HEAD after an upload says: the object verified (``ok``), replaced by another shipper since
        (``raced``: another ETag than the upload's, decided again later), or not what was sent."""
        if head_holds(h, f["bytes"], f["sha256"]):
            return {"status": "ok", "etag": h["ETag"]}
        if h is not None and etag and h.get("ETag") != etag:
            return {"status": "raced", "why": "another shipper replaced it at the store right after the upload"}
        return {"status": "mismatch", "why": "the store's HEAD after the upload gave another size or checksum "
                "(does it keep SHA256 checksums?)"}

    def list_verified(self, b: Bucket, done: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
        """Add the verified samples to the manifest. Each write first checks, with a HEAD, that the object is
        still the one verified (its ETag): another shipper of this prefix (a reassigned shard and its host
        back) may have replaced it since, and then lists its own. So whoever writes the manifest last
        lists what the store holds. A sample replaced so is ``raced``: decided again in a later round."""
        now = round(time.time(), 3)
        adds = {f["entry"]["key"]: (res, dict(f["entry"], op="add", file=f"{SAMPLES}/{f['file']}", shipped=now,
                                              etag=res["etag"])) for res, f in done}

        def add(entries: dict[str, dict[str, Any]]) -> bool:
            new = [(k, rec) for k, (_, rec) in adds.items()
                   if any(entries.get(k, {}).get(f) != rec.get(f) for f in ("sha256", "file", "etag"))]
            heads = self.pool.map(lambda kr: b.head(self.dest.key(kr[1]["file"])), new)
            changed = False
            for (k, rec), h in zip(new, heads):
                if h is None or h.get("ETag") != rec["etag"]:
                    adds[k][0].update(status="raced", why="another shipper replaced it at the store meanwhile")
                    continue
                adds[k][0].update(status="ok")
                entries[k] = rec
                changed = True
            return changed
        if adds:
            with self.manifest_lock:
                b.update_manifest(add)

    def object(self, f: dict[str, Any]) -> str:
        return self.dest.sample_key(f["file"])

    def held(self, b: Bucket, f: dict[str, Any], stored: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """``ok`` (with its ETag) if the store holds this very sample verified; ``kept`` (the store's version)
        if it holds another version its manifest lists and verifies; else to be sent, with the condition
        that keeps it from replacing what another shipper writes meanwhile (If-None-Match: * where there was
        nothing, If-Match: the ETag of what was there)."""
        h = b.head(self.object(f))
        if h is None:
            return {"status": "", "cond": {"IfNoneMatch": "*"}}
        old = stored.get(f["entry"]["key"])
        if head_holds(h, f["bytes"], f["sha256"]):
            return {"status": "ok", "etag": h["ETag"]}
        if old is not None and old.get("file") == f"{SAMPLES}/{f['file']}" and isinstance(old.get("bytes"), int) \
                and isinstance(old.get("sha256"), str) and head_holds(h, old["bytes"], old["sha256"]):
            return {"status": "kept", "bytes": old["bytes"], "sha256": old["sha256"], "run": old.get("run"),
                    "host": old.get("host")}
        since = self.raced_at.get(self.object(f))
        if since is not None and time.monotonic() - since < YIELD_SECONDS:
            return {"status": "raced", "why": "another shipper wrote it and has not listed it yet: its manifest "
                    "line awaited"}
        return {"status": "", "cond": {"IfMatch": h["ETag"]}}

    def upload(self, b: Bucket, f: dict[str, Any], commit: BucketCommit,
               cond: dict[str, str]) -> Callable[[], dict[str, Any]]:
        """Start sending one file; returns what waits for it: {"status": "sent"} or a failure with why."""
        path, size, sha = self.src_dir / f["file"], f["bytes"], f["sha256"]
        key = self.object(f)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return lambda: {"status": "missing", "why": f"{path} is gone here"}
        try:
            if os.fstat(fd).st_size != size:
                os.close(fd)
                return lambda: {"status": "mismatch", "why": f"{path} has {os.path.getsize(path)} bytes here, "
                                f"its manifest line {size}: damaged here, not sent"}
            if sha.startswith(RANGED) and size > RANGE:
                return self.multipart(b, fd, key, size, sha, commit, cond)
            job = self.pool.submit(self.put_one, b, fd, key, size, sha, commit, cond)
        except BaseException:
            os.close(fd)
            raise

        def finish() -> dict[str, Any]:
            try:
                return job.result()
            finally:
                os.close(fd)
        return finish

    def put_one(self, b: Bucket, fd: int, key: str, size: int, sha: str, commit: BucketCommit,
                cond: dict[str, str]) -> dict[str, Any]:
        commit.check()
        if size > RANGE and not sha.startswith(RANGED):  # a plain digest is of the whole: one PUT, streamed
            if size > SINGLE_PUT_MAX:
                return {"status": "mismatch", "why": f"{size} bytes with a plain sha256 (a sample from before ranged "
                        "digests): over S3's 5 GiB for one PUT; ship it over rsync"}
            got = file_sha256(f"/proc/self/fd/{fd}")
            body: Any = os.fdopen(os.dup(fd), "rb")
            digest = bytes.fromhex(got[1])
        else:
            body = read_range(fd, 0, size)
            digest = hashlib.sha256(body).digest()
            got = (len(body), ranged([digest]) if sha.startswith(RANGED) else digest.hex())
        try:
            if got != (size, sha):
                return {"status": "mismatch", "why": f"the file here no longer matches its manifest line "
                        f"({got[1][:20]}...): damaged here, not sent"}
            r = b.call(f"PUT {key}", b.s3.put_object, Bucket=b.dest.bucket, Key=key, Body=body,
                       ChecksumSHA256=b64(digest), ContentLength=size, **cond)
        except DigestRefused as e:
            return {"status": "mismatch", "why": f"{e}: the bytes that arrived were not those hashed here"}
        except Raced as e:
            return {"status": "raced", "why": f"{e}: another shipper wrote it meanwhile"}
        finally:
            if hasattr(body, "close"):
                body.close()
        return {"status": "sent", "etag": r.get("ETag")}

    def multipart(self, b: Bucket, fd: int, key: str, size: int, sha: str, commit: BucketCommit,
                  cond: dict[str, str]) -> Callable[[], dict[str, Any]]:
        """64 MiB parts, each with its SHA256, all in flight on the pool; completed only if the parts'
        digests make the manifest's ranged digest (the store then checks that composite itself)."""
        mpu = b.call(f"starting the upload of {key}", b.s3.create_multipart_upload, Bucket=b.dest.bucket, Key=key,
                     ChecksumAlgorithm="SHA256")
        upload_id = mpu["UploadId"]
        self.journal.append({"op": "start", "key": key, "upload_id": upload_id, "t": round(time.time(), 3)})

        def part(n: int, start: int) -> tuple[bytes, str]:
            commit.check()
            data = read_range(fd, start, min(RANGE, size - start))
            digest = hashlib.sha256(data).digest()
            r = b.call(f"PUT {key} part {n}", b.s3.upload_part, Bucket=b.dest.bucket, Key=key, UploadId=upload_id,
                       PartNumber=n, Body=data, ChecksumSHA256=b64(digest), ContentLength=len(data))
            return digest, r["ETag"]
        jobs: list[Future[tuple[bytes, str]]] = [self.pool.submit(part, n, start)
                                                 for n, start in enumerate(range(0, size, RANGE), 1)]

        def finish() -> dict[str, Any]:
            try:
                for j in jobs:
                    j.exception()  # every part ended, whatever the first failure
                parts = [j.result() for j in jobs]
                if ranged([d for d, _ in parts]) != sha:
                    self.abort(b, key, upload_id)
                    return {"status": "mismatch", "why": "the file here no longer matches its manifest line: damaged "
                            "here, not sent"}
                r = b.call(f"completing the upload of {key}", b.s3.complete_multipart_upload, Bucket=b.dest.bucket,
                           Key=key, UploadId=upload_id, MultipartUpload={"Parts": [
                               {"PartNumber": n, "ETag": etag, "ChecksumSHA256": b64(d)}
                               for n, (d, etag) in enumerate(parts, 1)]}, **cond)
                self.journal.append({"op": "end", "upload_id": upload_id, "t": round(time.time(), 3)})
                return {"status": "sent", "etag": r.get("ETag")}
            except DigestRefused as e:
                self.abort(b, key, upload_id)
                return {"status": "mismatch", "why": f"{e}: the bytes that arrived were not those hashed here"}
            except Raced as e:
                self.abort(b, key, upload_id)
                return {"status": "raced", "why": f"{e}: another shipper wrote it meanwhile"}
            except BaseException:
                self.abort(b, key, upload_id)  # an outage or a stop: sent again whole later
                raise
            finally:
                os.close(fd)
        return finish

    def abort(self, b: Bucket, key: str, upload_id: str) -> None:
        """Drop an upload's parts at the store; if the store cannot be reached, the journal keeps it for later."""
        try:
            b.s3.abort_multipart_upload(Bucket=b.dest.bucket, Key=key, UploadId=upload_id)
        except Exception as e:  # NoSuchUpload: gone already; anything else: aborted at the next open
            if error_code(e)[0] not in ("NoSuchUpload", "404"):
                return
        self.journal.append({"op": "end", "upload_id": upload_id, "t": round(time.time(), 3)})

    def abort_leftovers(self) -> None:
        """Abort the uploads this state dir's shippers started and never ended (killed, or cut off)."""
        started: dict[str, str] = {}
        for rec in read_jsonl(self.journal_path) if self.journal_path.exists() else []:
            if rec.get("op") == "start":
                started[rec["upload_id"]] = rec["key"]
            elif rec.get("op") == "end":
                started.pop(rec.get("upload_id"), None)
        assert self.bucket is not None
        for upload_id, key in started.items():
            self.abort(self.bucket, key, upload_id)
        if self.journal_path.exists() and not started:
            write_text_atomic(self.journal_path, "", fsync=True)  # all ended: no need to keep the history

    # ------------------------------------------------------------------ the start's check

    def damage(self, e: dict[str, Any], listing: dict[str, dict[str, Any]], deep: bool) -> str | None:
        o = listing.get(self.dest.key(e.get("file") or ""))
        if o is None:
            return "missing"
        if o.get("Size") != e["bytes"]:
            return f"size {o.get('Size')}, verified with {e['bytes']} (truncated or replaced)"
        if e.get("etag") and o.get("ETag") != e["etag"]:
            return f"replaced since it was verified (ETag {o.get('ETag')}, verified as {e['etag']})"
        if not deep:
            return None
        got = self.need().read_back(self.dest.key(e["file"]), e["sha256"])
        if isinstance(got, str):
            return got
        return None if got == (e["bytes"], e["sha256"]) else "its content no longer has the verified digest"


def read_range(fd: int, start: int, length: int) -> bytes:
    """``length`` bytes of ``fd`` from ``start`` (fewer only if the file is shorter: the digest then differs)."""
    parts = []
    while length > 0:
        data = os.pread(fd, length, start)
        if not data:
            break
        parts.append(data)
        start, length = start + len(data), length - len(data)
    return parts[0] if len(parts) == 1 else b"".join(parts)
