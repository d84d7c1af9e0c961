"""One S3 batch's round in a thread of its own (:mod:`hs_patch.host.shipping.bucket_link` does the work): the
shipper's batch loop sends the next batch meanwhile and waits for this one's per-file results, or for what
ended it (an outage, a refusal), when it records the batch."""

from __future__ import annotations

import threading
from typing import Any, Callable

from hs_patch.host.shipping.link import LinkError


class Cancelled(Exception):
    """The shipper is stopping: the batch's remaining work is dropped (a later start does it)."""


def finish_all(results: list[dict[str, Any]], uploads: list[Callable[[], dict[str, Any]]]) -> None:
    """Each upload's end into its result; every upload ends (and closes its file) even when an earlier one failed,
    then the first failure is raised (one upload cut by an outage left the others' files open: a batch's RAM in
    /dev/shm held by deleted samples, and file descriptors, for each cut)."""
    failure: BaseException | None = None
    for res, finish in zip(results, uploads, strict=True):
        try:
            res.update(finish())
        except BaseException as e:  # noqa: BLE001 - raised once all have ended
            failure = failure or e
    if failure is not None:
        raise failure


class BucketCommit:
    """One batch's round (see the module doc) in a thread of its own; ``wait`` gives the per-file results
    or raises what ended it (an outage, a refusal)."""

    def __init__(self, work: Callable[[BucketCommit], list[dict[str, Any]]]):
        self._cancelled = threading.Event()
        self._done = threading.Event()
        self._result: list[dict[str, Any]] = []
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._result = work(self)
            except BaseException as e:  # handed to wait()
                self._error = e
            finally:
                self._done.set()
        self._thread = threading.Thread(target=run, name="hs-ship-s3-batch", daemon=True)
        self._thread.start()

    def check(self) -> None:
        if self._cancelled.is_set():
            raise Cancelled("the shipper is stopping")

    def wait(self, answer: str | None = "results") -> list[dict[str, Any]]:
        self._done.wait()
        if self._error is not None:
            if isinstance(self._error, Cancelled):
                raise LinkError("the batch was cancelled")
            raise self._error
        return self._result

    def kill(self) -> None:
        self._cancelled.set()
        self._done.wait()
