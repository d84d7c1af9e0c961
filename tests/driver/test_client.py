"""The SGLang client: retries with backoff on transient errors, none on refusals."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from hs_patch.host.driver.client import ClientError, RetryPolicy, ServerRejected, SGLangClient


class Flaky(BaseHTTPRequestHandler):
    """Answers /generate with the statuses queued in ``plan``, then 200."""

    plan: list[int] = []
    seen: list[dict] = []

    def log_message(self, *a):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Flaky.seen.append(body)
        status = Flaky.plan.pop(0) if Flaky.plan else 200
        out = {"text": "x", "output_ids": [1], "meta_info": {"id": body["rid"]}} if status == 200 else \
            {"error": {"message": f"status {status}"}}
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def flaky():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    Flaky.plan, Flaky.seen = [], []
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_transient_errors_are_retried_and_reported(flaky):
    retries = []
    c = SGLangClient(flaky, policy=RetryPolicy(retries=3, backoff=0.01, backoff_max=0.02), on_retry=retries.append)
    Flaky.plan = [503, 500]
    out = c.generate([1, 2, 3], {"max_new_tokens": 1}, "rid-1", context={"sample_id": "s:1"})
    assert out["meta_info"]["id"] == "rid-1"
    assert [r["attempt"] for r in retries] == [1, 2] and "HTTP 503" in retries[0]["error"]
    assert retries[0]["sample_id"] == "s:1"
    assert Flaky.seen[0] == {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}, "rid": "rid-1",
                             "stream": False}


def test_refusals_are_not_retried(flaky):
    c = SGLangClient(flaky, policy=RetryPolicy(retries=3, backoff=0.01))
    Flaky.plan = [400]
    with pytest.raises(ServerRejected, match="HTTP 400: status 400"):
        c.generate([1], {}, "r")
    assert len(Flaky.seen) == 1


def test_unreachable_server_gives_up_after_the_retries():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    retries = []
    c = SGLangClient(f"http://127.0.0.1:{port}", policy=RetryPolicy(retries=2, backoff=0.01), on_retry=retries.append)
    with pytest.raises(ClientError, match="after 3 attempt"):
        c.generate([1], {}, "r")
    assert len(retries) == 2 and not c.health()
    with pytest.raises(ClientError, match="not healthy"):
        c.wait_healthy(0.1, poll=0.05)


def test_backoff_doubles_with_jitter_and_a_cap():
    p = RetryPolicy(retries=10, backoff=1.0, backoff_max=5.0)
    for attempt, full in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (9, 5.0)):
        d = p.delay(attempt)
        assert full * 0.5 <= d <= full


@pytest.fixture
def hung():
    """A server that accepts connections and never answers (a hung SGLang)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    srv.close()


def test_server_wait_is_honoured_when_the_server_hangs(hung):
    import time

    c = SGLangClient(hung, timeout=600.0)  # the /generate timeout must not stretch the wait
    t0 = time.monotonic()
    with pytest.raises(ClientError, match=r"not healthy after 2s \(--server-wait\)"):
        c.wait_healthy(2.0, poll=0.2)
    assert time.monotonic() - t0 < 4.0
    t0 = time.monotonic()
    with pytest.raises(ClientError):
        c.server_info(timeout=1.0)
    assert time.monotonic() - t0 < 3.0


class Recorder(BaseHTTPRequestHandler):
    seen: list[tuple[str, str]] = []

    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        Recorder.seen.append((self.path, self.headers.get("Authorization", "")))
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()


def test_credentials_in_the_url_are_sent_but_never_shown():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    Recorder.seen = []
    try:
        url = f"http://alice:s3cr%40t@127.0.0.1:{srv.server_address[1]}/?token=tok-123"
        c = SGLangClient(url, policy=RetryPolicy(retries=1, backoff=0.01))
        with pytest.raises(ClientError) as e:
            c.server_info()
    finally:
        srv.shutdown()
        srv.server_close()
    import base64

    assert Recorder.seen[0] == ("/server_info?token=tok-123", "Basic " + base64.b64encode(b"alice:s3cr@t").decode())
    for text in (str(e.value), c.display_url):
        assert "s3cr" not in text and "tok-123" not in text and "alice" not in text
    assert c.display_url == f"http://***@127.0.0.1:{srv.server_address[1]}?token=***"


def test_secrets_in_request_errors_are_scrubbed():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = SGLangClient(f"http://u:hunter2@127.0.0.1:{port}?key=abcdef", policy=RetryPolicy(retries=0))
    with pytest.raises(ClientError) as e:
        c.generate([1], {}, "r")
    assert "abcdef" not in str(e.value) and "hunter2" not in str(e.value) and "key=***" in str(e.value)


@pytest.mark.parametrize("url", ["localhost:30000", "127.0.0.1:30000", "ftp://127.0.0.1:30000", "http://"])
def test_a_server_given_without_http_is_refused_at_once_saying_how_to_write_it(url):
    """"localhost:30000" parses as scheme "localhost": it used to be retried for 20 s, then fail with
    requests' InvalidSchema."""
    t = time.monotonic()
    with pytest.raises(ClientError, match="give it as http://HOST:PORT"):
        SGLangClient(url)
    assert time.monotonic() - t < 1


class OneInfoPath(BaseHTTPRequestHandler):
    """Serves the server info on ``path`` alone (404 elsewhere), as a release that has only that name."""

    path_served = "/server_info"
    seen: list[str] = []

    def log_message(self, *a):
        pass

    def do_GET(self):  # noqa: N802
        OneInfoPath.seen.append(self.path)
        ok = self.path == OneInfoPath.path_served
        data = json.dumps({"version": "x", "served_from": self.path} if ok else {"detail": "Not Found"}).encode()
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.mark.parametrize("served, asked", [("/server_info", ["/server_info"]),
                                           ("/get_server_info", ["/server_info", "/get_server_info"])])
def test_server_info_reads_server_info_and_falls_back_to_the_older_name(served, asked):
    """SGLang 0.5.9-0.5.23 serve both names and warn on every /get_server_info call (deprecated, to be
    removed): /server_info is read first; a server without it (404) is read at /get_server_info; other
    refusals are not retried under the other name."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), OneInfoPath)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    OneInfoPath.path_served, OneInfoPath.seen = served, []
    try:
        c = SGLangClient(f"http://127.0.0.1:{srv.server_address[1]}", policy=RetryPolicy(retries=0))
        assert c.server_info()["served_from"] == served
        assert OneInfoPath.seen == asked
        OneInfoPath.path_served, OneInfoPath.seen = "/nowhere", []
        with pytest.raises(ServerRejected, match="404"):
            c.server_info()
        assert OneInfoPath.seen == ["/server_info", "/get_server_info"]
    finally:
        srv.shutdown()
        srv.server_close()
