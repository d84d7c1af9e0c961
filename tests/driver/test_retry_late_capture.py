"""A retried request is prefilled twice; when the first capture was adopted before the retry's was
written (a writer behind under load), the retry's sample is published and listed again: the
server's duplicate rule only holds while the first file is still in the capture dir. Such a later
capture of a sample already adopted is removed while the run goes on (it is RAM on /dev/shm),
not only by the sweep at the run's end."""

from __future__ import annotations

import time

from hs_patch.host.driver import sample_steps
from hs_patch.host.driver.run import EXIT_OK
from hs_patch.samples import store
from lab.drive_runs import drive
from lab.runcheck import write_chats


def test_a_late_second_capture_of_an_adopted_sample_is_removed_during_the_run(standin, tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    capture = standin.engine.capture.directory
    real_adopt = sample_steps.adopt
    late: list[str] = []

    def adopt(watcher, entry, samples_dir, **kw):
        if late:  # the next sample: the run goes on a while (status ticks every 0.2 s)
            time.sleep(1.0)
            return real_adopt(watcher, entry, samples_dir, **kw)
        # the retry's capture lands just after the first was adopted: a copy of the same sample, listed
        data = (watcher.directory / entry["file"]).read_bytes()
        out = real_adopt(watcher, entry, samples_dir, **kw)
        key = entry["key"]
        tmp = store.temp_path(capture, key)
        tmp.write_bytes(data)
        final = store.publish(store.Written(key, tmp, len(data), entry["sha256"]), capture)
        store.Manifest(capture).add(final, tokens=entry["tokens"], rid=entry.get("rid", ""), parts=1)
        late.append(key)
        return out

    monkeypatch.setattr(sample_steps, "adopt", adopt)
    data = tmp_path / "d.jsonl"
    write_chats(data, 2)
    assert drive(standin, tiny_model_dir, tmp_path, [data], concurrency=1).exit_code == EXIT_OK
    removes = [r for r in store.manifest_records(capture) if r["op"] == "remove" and r["key"] == late[0]]
    assert [r["reason"] for r in removes][-1].startswith("a later capture of a sample already adopted"), removes
