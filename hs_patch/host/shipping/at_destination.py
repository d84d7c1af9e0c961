"""Verify-and-commit step of the shipper, run ON the destination host.

The shipper sends this file's source as ``python3 -c SOURCE`` over SSH (nothing of ours
is installed on training storage) with a JSON request on stdin, and reads a JSON answer
on stdout. Standard library only, Python >= 3.6.

Request: ``{"root": PATH, "files": [{"file": NAME, "bytes": N, "sha256": HEX, "mtime_ns": T, "entry": {...}}],
"seconds": S}`` (``mtime_ns``: the file's mtime on the GPU host, which rsync ``--times`` gives the copy it lands;
``seconds``: how long the shipper waits for the answer; the step ends itself soon after).

For each file, rsync has left it in ``ROOT/.incoming/`` (or an interrupted run already
moved it to ``ROOT/samples/``). Its sha256 is computed here, on the destination, and its
data fsynced; a match is moved into ``ROOT/samples/``; a staged copy that does not match
is deleted so it is sent again. Then ``ROOT/manifest.jsonl`` is rewritten (temp file,
fsync, rename: a reader never sees a partial manifest) with one ``op: add`` line per
sample, ``file`` relative to ROOT. A lock file serialises shippers sharing one ROOT.

Answer: ``{"results": [{"file", "status", "bytes", "sha256"}], "manifest": N}`` where
status is ``ok`` (in samples/, durable, in the manifest), ``kept`` (the destination already
holds this sample, verified, with other bytes: a redo after the GPU host lost its local
state, or the copy of a host whose shard was reassigned while it was cut off; the destination's
copy stays, its ``sha256``/``bytes`` and the ``run``/``host`` that shipped it are answered, the
arrival is deleted), ``mismatch`` (the copy that arrived was wrong and is deleted), ``raced`` (the
file at rsync's name has another mtime: another shipper of this ROOT landed its own copy of the sample
there since; it is left for that shipper's step, and this one sends again later) or ``missing``
(nothing arrived).

With ``"list": true`` the answer also has ``"entries"``: key, file, bytes, sha256 and
sample_id of every sample in the destination's manifest (the shipper's start-up sync, so
that samples already shipped count as done even when the GPU host forgot them).

``"check": "cheap"`` or ``"deep"`` (with ``list``, every start of the shipper) first checks what
the manifest lists: cheap, each file's size and mtime against those recorded when it was
verified (``mtime_ns``; a write to the file moves its mtime; a line from before this field has
its size checked only); deep, its digest computed again. A file that fails is moved to
``ROOT/.damaged/`` and its line dropped from the manifest; the answer's ``"damaged"`` lists
key, file and why, so the shipper can have the sample extracted again.
"""
import errno
import fcntl
import hashlib
import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

INCOMING = ".incoming"
SAMPLES = "samples"
MANIFEST = "manifest.jsonl"
LOCK = ".manifest.lock"
GRACE_SECONDS = 2   # beyond the request's "seconds", the shipper's own limit on the step
DAMAGED = ".damaged"
VERIFYING = ".hs-verifying."  # in INCOMING: a file this step took from rsync's name before hashing it
RANGE, RANGED = 64 << 20, "sha256r64m:"  # hs_patch.samples.files' ranged digest


def sha256_and_sync(path, like=""):
    """(size, digest) of a file, of the kind of ``like`` (the digest the GPU host recorded: a plain
    sha256, or RANGED + the sha256 of its 64 MiB ranges' sha256 digests, the capture writer's since
    issue #22), and its data made durable (hs_patch.samples.files.file_digest is not importable here)."""
    ranges = like.startswith(RANGED)
    h, digests = hashlib.sha256(), []
    size = 0
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view[:min(len(buf), RANGE - size % RANGE)])  # never across a range's end
            if not n:
                break
            size += n
            h.update(view[:n])
            if ranges and size % RANGE == 0:
                digests.append(h.digest())
                h = hashlib.sha256()
        os.fsync(f.fileno())
    if not ranges:
        return size, h.hexdigest()
    if size % RANGE:
        digests.append(h.digest())
    return size, RANGED + hashlib.sha256(b"".join(digests)).hexdigest()


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_entries(path):
    """Live entries by key, in the order they were first added."""
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        return entries_of(f)


class ManifestError(ValueError):
    """A manifest line that is not JSON (edited or damaged by hand: ours are replaced whole, never torn)."""


def entries_of(lines):
    """Live entries by key of a manifest's lines (bytes), in the order they were first added; ManifestError
    for a line that is not JSON (rewriting the manifest without it would drop a sample's line unseen)."""
    entries = {}
    for n, raw in enumerate(lines, 1):
        if raw.strip():
            try:
                rec = json.loads(raw)
            except ValueError:
                raise ManifestError("line %d is not JSON (%.60r)" % (n, bytes(raw[:40]))) from None
            if not isinstance(rec, dict) or not isinstance(rec.get("key"), str):
                continue  # not a line of ours (hs-patch inspect reports it)
            if rec.get("op") == "add":
                entries[rec["key"]] = rec
            elif rec.get("op") == "remove":
                entries.pop(rec["key"], None)
    return entries


def manifest_bytes(entries):
    """The manifest holding ``entries``: one JSON line each, keys sorted (the bucket's too)."""
    return b"".join((json.dumps(rec, separators=(",", ":"), sort_keys=True) + "\n").encode()
                    for rec in entries.values())


def write_entries(root, entries):
    tmp = os.path.join(root, ".%s.%d.tmp" % (MANIFEST, os.getpid()))
    try:
        with open(tmp, "wb") as f:
            f.write(manifest_bytes(entries))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(root, MANIFEST))
    except BaseException:
        # a full disk: the partial copy must not hold the space the next try needs
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(root)


def remove_leftovers(root):
    """What a killed step left (the lock is held, so no step of another shipper is running)."""
    for name in os.listdir(root):
        if name.startswith("." + MANIFEST + ".") and name.endswith(".tmp"):
            os.unlink(os.path.join(root, name))
    for name in os.listdir(os.path.join(root, INCOMING)):
        if name.startswith(VERIFYING):
            os.unlink(os.path.join(root, INCOMING, name))


def landed_by_sender(path, f):
    """Whether the file at rsync's name has the sender's mtime (``mtime_ns`` of the request; rsync
    ``--times``), or that mtime truncated by a filesystem that keeps coarser times (less than 1 s
    older). A request without it (an older shipper) is taken as the sender's."""
    sent = f.get("mtime_ns")
    return not isinstance(sent, int) or 0 <= sent - os.stat(path).st_mtime_ns < 10 ** 9


def verify(root, f, entries):
    """Check one file where rsync or an interrupted run left it; move it into samples/ unless
    the destination already holds a verified other version of the same sample."""
    name = f["file"]
    if os.path.basename(name) != name or name.startswith("."):
        raise ValueError("refusing file name %r: not a plain sample file name" % name)
    staged, final = os.path.join(root, INCOMING, name), os.path.join(root, SAMPLES, name)
    want = (f["bytes"], f["sha256"])
    old = entries.get(f["entry"]["key"])
    if old is not None and old.get("sha256") != f["sha256"] and old.get("file") == SAMPLES + "/" + name \
            and os.path.isfile(final) \
            and sha256_and_sync(final, old.get("sha256") or "") == (old.get("bytes"), old.get("sha256")):
        if os.path.isfile(staged):
            os.unlink(staged)
        return "kept"
    status = "missing"
    if os.path.isfile(staged) and not landed_by_sender(staged, f):
        # another shipper's rsync (a reassigned shard's host, or the dead host back) landed its copy of this
        # sample at rsync's name since this shipper's: hashing it here would delete that shipper's arrival
        # as a mismatch, and its own step would then find nothing (both counting failed transfers)
        return "raced"
    if os.path.isfile(staged):
        # hashed and moved under a name of its own: another shipper's rsync (a reassigned shard's
        # host) may land its own NAME at rsync's name meanwhile, and that is not the file hashed
        mine = os.path.join(root, INCOMING, VERIFYING + name)
        os.replace(staged, mine)
        if sha256_and_sync(mine, f["sha256"]) == want:
            os.replace(mine, final)
            return "ok"
        os.unlink(mine)
        status = "mismatch"
    if os.path.isfile(final) and sha256_and_sync(final, f["sha256"]) == want:  # moved there by an interrupted run
        return "ok"
    return status


def commit(root, files):
    remove_leftovers(root)
    entries = read_entries(os.path.join(root, MANIFEST))
    # files are hashed in parallel (hashlib and file reads release the GIL)
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        statuses = list(pool.map(lambda f: verify(root, f, entries), files))
    results, arrived = [], []
    for f, status in zip(files, statuses):
        res = {"file": f["file"], "status": status, "bytes": f["bytes"], "sha256": f["sha256"]}
        if status == "kept":
            old = entries[f["entry"]["key"]]
            res.update(bytes=old["bytes"], sha256=old["sha256"], run=old.get("run"), host=old.get("host"))
        results.append(res)
        if status == "ok":
            arrived.append(f)
    changed = False
    for f in arrived:
        rec = dict(f["entry"], op="add", file=SAMPLES + "/" + f["file"])
        rec["mtime_ns"] = os.stat(os.path.join(root, rec["file"])).st_mtime_ns  # what the next start's check compares
        old = entries.get(rec["key"])
        if old is None or any(old.get(k) != rec[k] for k in ("sha256", "file", "mtime_ns")):
            rec["shipped"] = round(time.time(), 3)
            entries[rec["key"]] = rec
            changed = True
    if arrived:  # the renames into samples/ durable before the shipper deletes its copies, listed or not
        fsync_dir(os.path.join(root, SAMPLES))
    if changed:
        write_entries(root, entries)
    return {"results": results, "manifest": len(entries)}


def damage(root, rec, deep):
    """Why the file of a manifest line no longer is what was verified (None if it is)."""
    path = os.path.join(root, rec.get("file") or "")
    try:
        st = os.stat(path)
    except OSError as e:
        return "missing (%s)" % (e.strerror or e)
    if st.st_size != rec.get("bytes"):
        return "size %d, verified with %s (truncated or rewritten)" % (st.st_size, rec.get("bytes"))
    if isinstance(rec.get("mtime_ns"), int) and st.st_mtime_ns != rec["mtime_ns"]:
        # rewritten, or only touched or copied without its times (cp -r, a restore): its digest tells
        if sha256_and_sync(path, rec.get("sha256") or "") != (rec.get("bytes"), rec.get("sha256")):
            return "written since it was verified (mtime %d, verified at %d; its digest differs)" % (
                st.st_mtime_ns, rec["mtime_ns"])
        rec["mtime_ns"] = st.st_mtime_ns  # the same bytes: the new time is recorded (check writes the manifest)
        return None
    if deep and sha256_and_sync(path, rec.get("sha256") or "") != (rec.get("bytes"), rec.get("sha256")):
        return "its content no longer has the verified digest"
    return None


def check(root, deep):
    """Check every listed file (see the module doc); move the damaged aside and drop their lines."""
    entries = read_entries(os.path.join(root, MANIFEST))
    # a line without bytes or sha256 is not one this step wrote: left alone (the shipper names it)
    ours = [rec for rec in entries.values() if type(rec.get("bytes")) is int and isinstance(rec.get("sha256"), str)]
    times = [rec.get("mtime_ns") for rec in ours]
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1))) as pool:
        whys = list(pool.map(lambda rec: damage(root, rec, deep), ours))
    refreshed = any(rec.get("mtime_ns") != t for rec, t in zip(ours, times))
    damaged = []
    for rec, why in zip(ours, whys):
        if why is None:
            continue
        path = os.path.join(root, rec["file"])
        if os.path.isfile(path):
            os.makedirs(os.path.join(root, DAMAGED), exist_ok=True)
            os.replace(path, os.path.join(root, DAMAGED, "%s.%d" % (os.path.basename(path), int(time.time() * 1e6))))
        del entries[rec["key"]]
        damaged.append({"key": rec["key"], "file": rec["file"], "why": why})
    if damaged or refreshed:
        write_entries(root, entries)
    return {"checked": len(whys), "damaged": damaged}


def main():
    os.umask(0o077)  # samples and manifest at the destination are readable by the shipping account only
    req = json.load(sys.stdin)
    if req.get("seconds"):
        # the shipper stops waiting after this and kills its ssh, which does not end this step: a step nobody
        # waits for must not go on holding the lock (the next step removes what a killed one left)
        signal.alarm(int(req["seconds"]) + GRACE_SECONDS)
    root = os.path.expanduser(req["root"])
    try:
        for d in (os.path.join(root, INCOMING), os.path.join(root, SAMPLES)):
            os.makedirs(d, exist_ok=True)
        with open(os.path.join(root, LOCK), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            checked = check(root, req["check"] == "deep") if req.get("check") else {}
            answer = commit(root, req["files"])
            answer.update(checked)
            if req.get("list"):
                fields = ("key", "file", "bytes", "sha256", "sample_id", "line_sha256")
                answer["entries"] = [{k: e.get(k) for k in fields}
                                     for e in read_entries(os.path.join(root, MANIFEST)).values()]
    except ManifestError as e:  # waiting does not cure it (the shipper stops: link.PERMANENT)
        sys.stderr.write("hs-verify: refused: %s: %s: repair or remove that line there (the trainers and "
                         "hs-extract fetch read it too); nothing is shipped into it until then\n"
                         % (os.path.join(root, MANIFEST), e))
        sys.exit(1)
    except OSError as e:  # one line the shipper shows, not a traceback
        full = " (the destination is full: free space there; the shipper retries by itself)" \
            if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        sys.stderr.write("verify step at %s: %s%s\n" % (root, e, full))
        sys.exit(1)
    json.dump(answer, sys.stdout)


if __name__ == "__main__":
    main()
