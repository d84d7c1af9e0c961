"""HTTP client for the SGLang server's native API: ``/generate``, ``/health``,
``/health_generate``, ``/get_server_info``.

Transient failures (connection refused or reset, timeouts, HTTP 5xx, 429) are retried
with exponential backoff and full jitter; every retry is reported to ``on_retry`` so
the driver records it. Other HTTP errors (400: the server refuses this input) raise
:class:`ServerRejected` at once. One ``requests.Session`` per thread (keep-alive).

Note: on SGLang, ``/health`` and ``/health_generate`` run a one-token prefill of
``input_ids=[0]`` when the server is idle (``/health`` too unless
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0), and a capturing server writes it as a
sample: the driver removes that probe sample (:data:`HEALTH_PROBE_IDS`).
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import requests

HEALTH_PROBE_IDS = [0]   # what SGLang's health checks prefill
API_KEY_ENV = "SGLANG_API_KEY"


def read_api_key(path: str | None) -> Optional[str]:
    """The server's API key: the first line of ``path`` (hs-extract drive --api-key-file), else
    ``$SGLANG_API_KEY``, else None. Never taken from a command line, never logged."""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline().strip()
        except OSError as e:
            raise ClientError(f"cannot read the server's API key from --api-key-file {path}: {e.strerror} "
                              "(the services role writes it, readable by the service user only)") from None
        if not key:
            raise ClientError(f"--api-key-file {path} is empty: re-run the services role to write the key")
        return key
    return os.environ.get(API_KEY_ENV) or None
RETRY_STATUS = {429, 500, 502, 503, 504}


class ClientError(RuntimeError):
    """The server could not be reached or kept failing after all retries."""


class ServerRejected(ClientError):
    """The server answered with a non-retryable HTTP error (e.g. 400 for an input it refuses)."""

    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass
class RetryPolicy:
    retries: int = 6            # attempts after the first
    backoff: float = 1.0        # first delay (s); doubles each retry
    backoff_max: float = 60.0   # cap of one delay

    def delay(self, attempt: int) -> float:
        """Full jitter: uniform in [0.5, 1] x the capped exponential delay of retry ``attempt`` (1-based)."""
        return min(self.backoff_max, self.backoff * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)


class SGLangClient:
    def __init__(self, base_url: str, *, policy: Optional[RetryPolicy] = None, timeout: float = 600.0,
                 connect_timeout: float = 10.0,
                 on_retry: Optional[Callable[[dict[str, Any]], None]] = None,
                 should_stop: Callable[[], bool] = lambda: False, api_key: Optional[str] = None):
        self.base_url = base_url.rstrip("/")
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.policy = policy or RetryPolicy()
        self.timeout = (connect_timeout, timeout)
        self.on_retry = on_retry
        self.should_stop = should_stop
        self._local = threading.local()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.headers.update(self._auth)  # SGLang --api-key: every endpoint but /health* and /metrics
        return s

    def _request(self, method: str, path: str, *, json: Any = None, retry: bool = True,
                 context: Optional[dict[str, Any]] = None) -> requests.Response:
        url = self.base_url + path
        attempt = 0
        while True:
            try:
                r = self._session().request(method, url, json=json, timeout=self.timeout)
                if r.status_code < 400:
                    return r
                if r.status_code in (401, 403):
                    raise ServerRejected(r.status_code, f"{path}: the server refused the API key ("
                                         f"{'none sent' if not self._auth else 'wrong key'}): give the server's key "
                                         f"with --api-key-file FILE (fab passes hs_server_api_key_file) or "
                                         f"${API_KEY_ENV}")
                if r.status_code not in RETRY_STATUS:
                    raise ServerRejected(r.status_code, _error_message(r))
                error = f"HTTP {r.status_code}: {_error_message(r)}"
            except requests.RequestException as e:
                self._local.session = None  # a broken keep-alive connection: start afresh
                error = f"{type(e).__name__}: {e}"
            attempt += 1
            if not retry or attempt > self.policy.retries or self.should_stop():
                raise ClientError(f"{method} {url} failed after {attempt} attempt(s): {error}")
            delay = self.policy.delay(attempt)
            if self.on_retry is not None:
                self.on_retry({"path": path, "attempt": attempt, "error": error, "delay": round(delay, 3),
                               **(context or {})})
            time.sleep(delay)

    # ------------------------------------------------------------------ endpoints
    def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str,
                 context: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Native ``/generate`` with token ids, so the server sees exactly these tokens."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid, "stream": False}
        out = self._request("POST", "/generate", json=body, context=context).json()
        if not isinstance(out, dict) or "meta_info" not in out:
            raise ClientError(f"/generate answered without meta_info: {str(out)[:200]}")
        return out

    def health(self) -> bool:
        """True if ``/health`` answers 200 now (no retries)."""
        try:
            return self._request("GET", "/health", retry=False).status_code == 200
        except ClientError:
            return False

    def health_generate(self) -> bool:
        try:
            return self._request("GET", "/health_generate", retry=False).status_code == 200
        except ClientError:
            return False

    def server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info").json()

    def wait_healthy(self, timeout: float, poll: float = 2.0) -> None:
        """Block until ``/health`` answers 200; raise ClientError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() >= deadline or self.should_stop():
                raise ClientError(f"the SGLang server at {self.base_url} is not healthy after {timeout:.0f}s: "
                                  "is it running (and done loading the model)? Check its log, or --server")
            time.sleep(poll)


def _error_message(r: requests.Response) -> str:
    try:
        body = r.json()
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return str(body["error"].get("message", body))
        return str(body)[:300]
    except ValueError:
        return r.text[:300]
