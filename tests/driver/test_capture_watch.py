"""The driver's watch of the capture manifest reads every line as it finally stands (issue #25, part 2).

An append can be cut: on a full disk the writer's short write is cut back to where its line
began and the next append writes there; a writer killed mid-line leaves a torn line that the
next append cuts off (``hs_patch.samples.files.append_line``). The watcher may have read the cut bytes
meanwhile. Before #25 it kept them and glued them to what came next: the next sample's ``add``
was lost (it timed out although its file was there) or a record mixed two samples.
"""

from __future__ import annotations

import json
import os

from hs_patch.host.driver.capture_dir import CaptureWatcher
from hs_patch.samples import files, store


def add_line(key: str, sha: str) -> bytes:
    rec = {"op": "add", "key": key, "file": f"{key}.safetensors", "bytes": 10, "sha256": sha}
    return (json.dumps(rec, separators=(",", ":"), sort_keys=True) + "\n").encode()


def test_a_cut_append_rewritten_after_the_watcher_read_it_is_read_whole(tmp_path):
    path = tmp_path / store.MANIFEST
    files.append_line(path, add_line("a" * 32, "1" * 64))
    w = CaptureWatcher(tmp_path, poll=3600)  # read by hand below
    try:
        size = path.stat().st_size
        cut = add_line("b" * 32, "2" * 64)
        with open(path, "ab") as f:  # a short write on a full disk: part of b's line is on disk
            f.write(cut[:40])
        w.read_new()                 # ... and the watcher reads it
        os.truncate(path, size)      # the writer cuts the failed append back
        files.append_line(path, add_line("c" * 32, "3" * 64))  # the next sample's line lands there
        files.append_line(path, add_line("d" * 32, "4" * 64))
        w.read_new()
        assert {k: (r["file"], r["sha256"]) for k, r in w.live.items()} == {
            k: (f"{k}.safetensors", sha) for k, sha in (("a" * 32, "1" * 64), ("c" * 32, "3" * 64), ("d" * 32, "4" * 64))}
    finally:
        w.close()


def test_a_torn_line_of_a_killed_writer_is_not_glued_to_the_next_append(tmp_path):
    path = tmp_path / store.MANIFEST
    files.append_line(path, add_line("a" * 32, "1" * 64))
    w = CaptureWatcher(tmp_path, poll=3600)
    try:
        with open(path, "ab") as f:  # SIGKILL mid-append: a torn line without its end
            f.write(add_line("e" * 32, "5" * 64)[:-30])
        w.read_new()
        files.append_line(path, add_line("f" * 32, "6" * 64))  # the next writer cuts it off first
        w.read_new()
        assert sorted(w.live) == ["a" * 32, "f" * 32] and w.live["f" * 32]["sha256"] == "6" * 64
        assert w.wait("f" * 32, 1, timeout=1)["file"] == f"{'f' * 32}.safetensors"
    finally:
        w.close()
