#!/usr/bin/env python3
"""A local stand-in for the Hugging Face hub's download API, serving one directory as a model repository.

It answers what huggingface_hub's ``snapshot_download`` and ``HfApi.list_repo_tree`` ask (read from
huggingface_hub 2.4.0's sources, and the older clients' ``/revision/`` call too), with the hub's own
headers, so ``HF_ENDPOINT`` (or ``endpoint=``) pointed at it downloads for real:

- ``GET /api/models/{repo}/revision/{rev}``: ``sha``, ``siblings`` (with ``?blobs=true``: sizes, blob
  ids, LFS sha256);
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=true``: every file with ``oid`` (the git blob
  id), ``size`` and, for LFS files (``*.safetensors``, ``*.bin``), ``lfs: {oid: sha256, size, pointerSize}``;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: ``X-Repo-Commit``, ``ETag`` (the git blob id, or for an
  LFS file ``X-Linked-Etag``: its sha256, and ``X-Linked-Size``), byte ranges (206);
- ``GET /mirror/{path}``: the same directory as a plain HTTP mirror (byte ranges), for ``hs-model``'s
  ``http`` source.

``rev`` is the commit the server was made with (40 hex characters) or ``main``; anything else is a
404 with ``X-Error-Code: RevisionNotFound``. With ``token``, every request needs ``Authorization:
Bearer <token>`` (401 otherwise). Faults for the tests: ``cut[path] = n`` sends the first ``n`` bytes of
the next GET of that file and drops the connection (``cut_times`` times); ``damaged`` paths are served
with one byte flipped, at their right size. ``log`` keeps ``(method, path, Range header)`` of each request.

    python3 tests/lab/fake_hub.py DIR --repo org/tiny --bind 127.0.0.1 --port 8999
"""

from __future__ import annotations

import argparse
import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS_SUFFIXES = (".safetensors", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


class FakeHub:
    """The server, started on a thread; ``url`` is its endpoint. ``close()`` stops it."""

    def __init__(self, root: str | Path, repo: str = "hs-test/tiny", *, bind: str = "127.0.0.1", port: int = 0,
                 commit: str = COMMIT, token: str | None = None):
        self.root, self.repo, self.commit, self.token = Path(root), repo, commit, token
        self.cut: dict[str, int] = {}
        self.cut_times = 1
        self.damaged: set[str] = set()
        self.log: list[tuple[str, str, str]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer((bind, port), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://{bind}:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def content(self, path: str) -> bytes:
        data = (self.root / path).read_bytes()
        if path in self.damaged and data:
            mid = len(data) // 2
            data = data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]
        return data

    def entry(self, path: str) -> dict:
        data = (self.root / path).read_bytes()  # what the repository holds (damage happens in transit)
        e = {"type": "file", "path": path, "size": len(data)}
        if path.endswith(LFS_SUFFIXES):
            pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
                       f"size {len(data)}\n").encode()
            e.update(oid=git_blob_id(pointer), lfs={"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                                                   "pointerSize": len(pointer)})
        else:
            e["oid"] = git_blob_id(data)
        return e

    def requests_for(self, path: str, method: str = "GET") -> list[str]:
        """The Range header ("" for none) of each ``method`` request of ``path`` (hub or mirror)."""
        with self.lock:
            return [r for m, p, r in self.log if m == method and (p.endswith("/" + path))]


def _handler(hub: FakeHub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def _json(self, status: int, body, headers: dict | None = None) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)

        def _allowed(self) -> bool:
            if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                self._json(401, {"error": "Invalid credentials in Authorization header"},
                           {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Invalid credentials"})
                return False
            return True

        def do_HEAD(self):
            self._route(head=True)

        def do_GET(self):
            self._route(head=False)

        def _route(self, head: bool) -> None:
            url = urlsplit(self.path)
            path = unquote(url.path)
            with hub.lock:
                hub.log.append(("HEAD" if head else "GET", path, self.headers.get("Range", "")))
            if not self._allowed():
                return
            api = f"/api/models/{hub.repo}/"
            resolve = f"/{hub.repo}/resolve/"
            if path.startswith("/mirror/"):
                return self._file(path[len("/mirror/"):], head, hub_headers=False)
            if path.startswith(api + "revision/"):
                rev = path[len(api + "revision/"):]
                if not self._revision(rev):
                    return
                blobs = parse_qs(url.query).get("blobs", ["false"])[0] == "true"
                siblings = [({"rfilename": e["path"], "size": e["size"], "blobId": e["oid"],
                              **({"lfs": e["lfs"]} if "lfs" in e else {})} if blobs else {"rfilename": e["path"]})
                            for e in map(hub.entry, hub.files())]
                return self._json(200, {"id": hub.repo, "modelId": hub.repo, "sha": hub.commit, "private": False,
                                        "gated": False, "siblings": siblings})
            if path.startswith(api + "tree/"):
                rev, _, sub = path[len(api + "tree/"):].partition("/")
                if not self._revision(rev):
                    return
                return self._json(200, [hub.entry(p) for p in hub.files() if not sub or p.startswith(sub + "/")])
            if path.startswith(resolve):
                rev, _, file = path[len(resolve):].partition("/")
                if not self._revision(rev):
                    return
                return self._file(file, head, hub_headers=True)
            self._json(404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})

        def _revision(self, rev: str) -> bool:
            if rev in (hub.commit, "main"):
                return True
            self._json(404, {"error": f"Invalid rev id: {rev}"}, {"X-Error-Code": "RevisionNotFound"})
            return False

        def _file(self, file: str, head: bool, hub_headers: bool) -> None:
            if file not in hub.files():
                return self._json(404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            data, entry = hub.content(file), hub.entry(file)
            start = 0
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes=") and rng.endswith("-"):
                start = min(int(rng[6:-1]), len(data))
            self.send_response(206 if start else 200)
            if hub_headers:
                self.send_header("X-Repo-Commit", hub.commit)
                if "lfs" in entry:
                    self.send_header("X-Linked-Etag", f'"{entry["lfs"]["oid"]}"')
                    self.send_header("X-Linked-Size", str(entry["size"]))
                self.send_header("ETag", f'"{entry["oid"]}"')
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if head:
                return
            body = data[start:]
            with hub.lock:
                cut = hub.cut.get(file)
                if cut is not None:
                    hub.cut_times -= 1
                    if hub.cut_times <= 0:
                        del hub.cut[file]
            if cut is not None and cut < len(body):
                self.wfile.write(body[:cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)  # the peer sees the body end early
                return
            self.wfile.write(body)

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("--repo", default="hs-test/tiny")
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8999)
    a = ap.parse_args(argv)
    hub = FakeHub(a.dir, a.repo, bind=a.bind, port=a.port)
    print(f"serving {a.dir} as {a.repo}@{hub.commit} at {hub.url}", flush=True)
    hub.thread.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
