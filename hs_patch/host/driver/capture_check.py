"""The driver's start-up check that the server captures its requests into ``--capture-dir``.

Before any dataset sample is sent, the driver prefills one short probe of its own (a
unique text, a request id of the same form as every capture request: ``hs-<run>-...``)
and waits for its raw sample in ``--capture-dir``. So a run never starts against a
server that writes elsewhere, has capture off, or skips the driver's requests
(``HS_CAPTURE_SKIP_RID_PREFIX`` matching ``hs-``); it is refused with what to set,
within seconds instead of after ``--raw-timeout`` per sample. The probe's sample is
removed at once, before the first dataset sample is sent, so it is never confused with
one (and SGLang's own ``/health`` probe of ``input_ids [0]`` is a different sequence).

The hook's ``hook_status.json`` (written into the directory the hook writes to, at start
and after its passes) tells the cases apart: absent (nothing captures into this
directory), not written since the probe (stale: the capturing server writes elsewhere),
fresh with nothing queued yet no sample (the hook skipped the request). When the status
names the hook's ``skip_rid_prefix`` or ``directory``, they are checked directly.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Optional

from hs_patch.host.driver.chat import encode_text
from hs_patch.host.driver.client import ClientError, SGLangClient
from hs_patch.host.driver.runstate import RunError
from hs_patch.samples import reader, store
from hs_patch.server import fingerprint

HOOK_STATUS = "hook_status.json"
NO_STATUS_GRACE = 5.0    # s after the answer: a hook writing here has written its status at start
STALE_GRACE = 10.0       # s after the answer: a hook writing here has written its status after a pass
RESEND_AFTER = 2.5       # s: a second probe makes the hook rewrite its status (it does so at most every 2 s)


class CaptureCheckFailed(RunError):
    """The server does not capture the driver's requests into --capture-dir; the message says what to set."""


def _status(capture_dir: Path) -> Optional[dict[str, Any]]:
    try:
        doc = json.loads((capture_dir / HOOK_STATUS).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _advertised(status: dict[str, Any], name: str) -> Any:
    for where in (status, status.get("config") or {}, status.get("capture") or {}):
        if isinstance(where, dict) and name in where:
            return where[name]
    return None


def skip_prefix_problem(status: Optional[dict[str, Any]], rid_prefix: str, capture_dir: Path) -> Optional[str]:
    """What the hook's status says is wrong before any request: a skip prefix that matches
    the driver's request ids, or another directory."""
    if not status:
        return None
    prefix = _advertised(status, "skip_rid_prefix")
    if isinstance(prefix, str) and prefix and rid_prefix.startswith(prefix):
        return (f"the server's HS_CAPTURE_SKIP_RID_PREFIX={prefix!r} matches the driver's request ids "
                f"({rid_prefix}...): the hook would skip every capture. Set it to a prefix the driver uses only "
                "for requests it must not capture (the default, nocap-) and restart the server")
    directory = _advertised(status, "directory")
    if isinstance(directory, str) and directory and os.path.realpath(directory) != os.path.realpath(capture_dir):
        return (f"the hook whose status is in {capture_dir} says it writes into {directory}: give --capture-dir "
                f"{directory}")
    return None


def _find(capture_dir: Path, key: str, offset: int) -> tuple[Optional[dict[str, Any]], int]:
    """The ``add`` record of ``key`` appended to the capture manifest after ``offset``."""
    path = capture_dir / store.MANIFEST
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return None, offset
    complete = data[: data.rfind(b"\n") + 1]
    for raw in complete.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("op") == "add" and rec.get("key") == key and "file" in rec:
            return rec, offset + len(complete)
    return None, offset + len(complete)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def check(client: SGLangClient, capture_dir: Path, tokenizer: Any, rid_prefix: str, *, timeout: float,
          release: str = "", poll: float = 0.05, fingerprints: bool = False) -> dict[str, Any]:
    """Send the probe, wait for its sample, remove it; raise CaptureCheckFailed saying what is wrong.
    ``fingerprints``: the probe's sample must carry the fingerprints the fidelity check reads."""
    ids = encode_text(tokenizer, f"hs-patch capture check {uuid.uuid4().hex[:12]}")
    problem = skip_prefix_problem(_status(capture_dir), rid_prefix, capture_dir)
    if problem:
        raise CaptureCheckFailed(problem)
    key = store.sample_key(ids)
    offset = _size(capture_dir / store.MANIFEST)
    rids: list[str] = []

    def send() -> float:
        rid = f"{rid_prefix}check-{uuid.uuid4().hex[:12]}"
        rids.append(rid)
        try:
            client.generate(ids, {"max_new_tokens": 1, "temperature": 0.0}, rid, context={"sample_id": "capture-check"})
        except ClientError as e:
            raise CaptureCheckFailed(f"the capture check request failed: {e}") from None
        return time.time()

    t0 = time.monotonic()
    answered = send()
    last_sent = answered
    deadline = time.monotonic() + timeout
    while True:
        rec, offset = _find(capture_dir, key, offset)
        if rec is not None:
            try:
                meta = reader.read_header(capture_dir / rec["file"]).metadata
            except store.SampleError as e:
                meta = {"error": str(e)}
            finally:
                (capture_dir / rec["file"]).unlink(missing_ok=True)
                store.Manifest(capture_dir).remove(key, reason="driver capture check")
            if fingerprints and fingerprint.META not in meta:
                raise CaptureCheckFailed(
                    f"the capture hook writing into {capture_dir} stores no fingerprints (sample format "
                    f"{meta.get('format')!r}): the hs_patch inside the server is older than this driver's, so the "
                    "fidelity check cannot check its planes. Run hs-patch apply with this version and restart the "
                    "server (or --no-fidelity-check: then nothing checks the samples)")
            return {"key": key, "rids": rids, "seconds": round(time.monotonic() - t0, 3),
                    "format": meta.get("format"), "dtype": meta.get("dtype"),
                    "fingerprints": fingerprint.META in meta}
        st = _status(capture_dir)
        final = time.monotonic() >= deadline
        waited = float("inf") if final else time.time() - answered
        why = _diagnose(st, capture_dir, rid_prefix, release, waited, last_sent)
        if why is None and final:
            why = (f"no sample of the capture check appeared in {capture_dir} within {timeout:.0f}s (--raw-timeout) "
                   "although the hook writing there is alive: is its writer stuck or far behind? See "
                   "hook_status.json and errors.jsonl there, and the server log")
        if why is not None:
            raise CaptureCheckFailed(why)
        if len(rids) == 1 and RESEND_AFTER <= waited < float("inf"):
            last_sent = send()
        time.sleep(poll)


def _diagnose(st: Optional[dict[str, Any]], capture_dir: Path, rid_prefix: str, release: str, waited: float,
              last_sent: float) -> Optional[str]:
    fix = (f"start the server with HS_CAPTURE=1 and HS_CAPTURE_DIR={capture_dir}, or give --capture-dir the "
           "server's HS_CAPTURE_DIR (sglang.service's Environment=)")
    if not release.startswith("0.5.9"):  # later releases skip requests by id; a hook skipping all writes nothing
        fix += (f"; or the server's HS_CAPTURE_SKIP_RID_PREFIX matches the driver's request ids '{rid_prefix}...' "
                "(it must not: its default, nocap-, is right)")
    if st is None:
        if waited < NO_STATUS_GRACE:
            return None
        return (f"the server answered the capture check but no capture hook wrote into --capture-dir {capture_dir} "
                f"(no {HOOK_STATUS} there): {fix}")
    if st.get("error"):
        return f"the capture hook's writer has failed ({capture_dir}/{HOOK_STATUS}): {st['error']}; fix it and " \
               "restart the server"
    problem = skip_prefix_problem(st, rid_prefix, capture_dir)
    if problem:
        return problem
    written = float(st.get("time") or 0)
    if written < last_sent - 3:
        if waited < STALE_GRACE:
            return None
        return (f"{capture_dir}/{HOOK_STATUS} was last written {time.time() - written:.0f}s ago (pid {st.get('pid')}) "
                "and not since the driver's capture check: the server that answers does not capture into this "
                f"directory: {fix}")
    if written >= last_sent and not st.get("queued") and waited >= RESEND_AFTER + 5:
        if release.startswith("0.5.9"):
            return (f"the capture hook writing into {capture_dir} ran the capture check but wrote no sample of it; "
                    f"see {capture_dir}/errors.jsonl and the server log")
        return (f"the capture hook writing into {capture_dir} ran the capture check (request id {rid_prefix}...) but "
                "skipped it: the server's HS_CAPTURE_SKIP_RID_PREFIX must not be a prefix of the driver's request ids "
                f"'{rid_prefix}...' (its default, nocap-, is right); fix it in sglang.service and restart the server")
    return None
