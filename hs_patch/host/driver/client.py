"""HTTP client for the SGLang server's native API: ``/generate``, ``/health``,
``/health_generate``, ``/server_info`` (``/get_server_info`` where a server has no ``/server_info``).

Transient failures (connection refused or reset, timeouts, HTTP 5xx, 429) are retried
with exponential backoff and full jitter; every retry is reported to ``on_retry`` so
the driver records it. Other HTTP errors (400: the server refuses this input) raise
:class:`ServerRejected` at once. One ``requests.Session`` per thread (keep-alive).

Note: on SGLang, ``/health`` and ``/health_generate`` run a one-token prefill of
``input_ids=[0]`` when the server is idle (``/health`` too unless
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0), and a capturing server writes it as a
sample: the driver removes that probe sample (:data:`HEALTH_PROBE_IDS`), never while a
dataset sample of the same tokens is in flight.

Credentials in the server URL (``http://user:pass@host:port``, ``?token=...``) are sent
(basic auth, query parameters on every request) but never shown: messages and
:attr:`SGLangClient.display_url` carry :func:`redact_url`'s form. Every request of
:meth:`SGLangClient.wait_healthy` is bounded by the time left of its wait.
"""

from __future__ import annotations

import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

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


def _split(url: str) -> tuple[str, Optional[tuple[str, str]], list[tuple[str, str]], list[str]]:
    """(base URL without credentials or query, basic auth, query parameters, the secrets in them)."""
    u = urlsplit(url)
    host = u.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{u.port}" if u.port else "")
    auth = (unquote(u.username or ""), unquote(u.password or "")) if u.username or u.password else None
    params = parse_qsl(u.query, keep_blank_values=True)
    secrets = [x for x in ((auth or ("", ""))[1], *(v for _, v in params)) if len(x) >= 3]  # shorter: no scrubbing
    secrets += [quote(x, safe="") for x in secrets]
    base = urlunsplit((u.scheme, netloc, u.path.rstrip("/"), "", ""))
    return base, auth, params, sorted(set(secrets), key=len, reverse=True)


def redact_url(url: str) -> str:
    """The URL with its user, password and query values replaced by ``***`` (for ledgers and logs)."""
    base, auth, params, _ = _split(url)
    if auth:
        scheme, rest = base.split("://", 1) if "://" in base else ("", base)
        base = f"{scheme}://***@{rest}" if scheme else f"***@{rest}"
    return base + ("?" + "&".join(f"{k}=***" for k, _ in params) if params else "")


def redact(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


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
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:  # "localhost:30000" parses as scheme "localhost"
            raise ClientError(f"{redact_url(base_url)!r} is not a server URL: give it as http://HOST:PORT")
        self.base_url, self._auth, self._params, self._secrets = _split(base_url.rstrip("/"))
        self.display_url = redact_url(base_url.rstrip("/"))
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if api_key:
            self._secrets = [*self._secrets, api_key]  # never shown in an error message
        self.policy = policy or RetryPolicy()
        self.timeout = (connect_timeout, timeout)
        self.on_retry = on_retry
        self.should_stop = should_stop
        self._local = threading.local()

    def _session(self) -> requests.Session:
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = requests.Session()
            s.headers.update(self._headers)  # SGLang --api-key: every endpoint but /health* and /metrics
        return s

    def _request(self, method: str, path: str, *, json: Any = None, retry: bool = True,
                 context: Optional[dict[str, Any]] = None, timeout: Optional[float] = None) -> requests.Response:
        """One request with its retries; ``timeout`` bounds them all together (each attempt gets the time left)."""
        url = self.base_url + path
        deadline = None if timeout is None else time.monotonic() + timeout
        attempt = 0
        while True:
            left = None if deadline is None else max(0.05, deadline - time.monotonic())
            limits = self.timeout if left is None else (min(self.timeout[0], left), min(self.timeout[1], left))
            try:
                r = self._session().request(method, url, json=json, params=self._params or None, auth=self._auth,
                                            timeout=limits)
                if r.status_code < 400:
                    return r
                if r.status_code in (401, 403):
                    raise ServerRejected(r.status_code, f"{path}: the server refused the API key ("
                                         f"{'none sent' if not self._headers else 'wrong key'}): give the server's key "
                                         f"with --api-key-file FILE (fab passes hs_server_api_key_file) or "
                                         f"${API_KEY_ENV}")
                if r.status_code not in RETRY_STATUS:
                    raise ServerRejected(r.status_code, redact(_error_message(r), self._secrets))
                error = f"HTTP {r.status_code}: {_error_message(r)}"
            except requests.RequestException as e:
                self._local.session = None  # a broken keep-alive connection: start afresh
                error = f"{type(e).__name__}: {e}"
            error = redact(error, self._secrets)
            attempt += 1
            delay = self.policy.delay(attempt)
            out_of_time = deadline is not None and time.monotonic() + delay >= deadline
            if not retry or attempt > self.policy.retries or self.should_stop() or out_of_time:
                raise ClientError(f"{method} {self.display_url}{path} failed after {attempt} attempt(s): {error}")
            if self.on_retry is not None:
                self.on_retry({"path": path, "attempt": attempt, "error": error, "delay": round(delay, 3),
                               **(context or {})})
            time.sleep(delay)

    # ------------------------------------------------------------------ endpoints
    def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str,
                 context: Optional[dict[str, Any]] = None, *, return_logprob: bool = False,
                 logprob_start_len: Optional[int] = None, top_logprobs_num: int = 0) -> dict[str, Any]:
        """Native ``/generate`` with token ids, so the server sees exactly these tokens.

        ``return_logprob`` with ``logprob_start_len`` S and ``top_logprobs_num`` K makes
        SGLang return, from the same pass, its top-K at every position from S on
        (:func:`server_top1` reads them).
        """
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid,
                                "stream": False}
        if return_logprob:
            body.update(return_logprob=True, top_logprobs_num=top_logprobs_num,
                        logprob_start_len=-1 if logprob_start_len is None else logprob_start_len)
        out = self._request("POST", "/generate", json=body, context=context).json()
        if not isinstance(out, dict) or "meta_info" not in out:
            raise ClientError(f"/generate answered without meta_info: {str(out)[:200]}")
        return out

    def health(self, timeout: Optional[float] = None) -> bool:
        """True if ``/health`` answers 200 now (no retries; at most ``timeout`` seconds)."""
        try:
            return self._request("GET", "/health", retry=False, timeout=timeout).status_code == 200
        except ClientError:
            return False

    def health_generate(self) -> bool:
        try:
            return self._request("GET", "/health_generate", retry=False).status_code == 200
        except ClientError:
            return False

    def server_info(self, timeout: Optional[float] = None) -> dict[str, Any]:
        """``/server_info``; on a 404, ``/get_server_info``. Every release from 0.5.9 to 0.5.23 serves both
        (the same JSON) and logs a deprecation warning for each call of ``/get_server_info``, which a
        later release may remove; a server that has only the older name is still read."""
        try:
            return self._request("GET", "/server_info", timeout=timeout).json()
        except ServerRejected as e:
            if e.status != 404:
                raise
        return self._request("GET", "/get_server_info", timeout=timeout).json()

    def wait_healthy(self, timeout: float, poll: float = 2.0) -> None:
        """Block until ``/health`` answers 200; raise ClientError after ``timeout`` seconds, also when
        the server accepts connections and never answers (each request gets the time left)."""
        deadline = time.monotonic() + timeout
        while not self.health(timeout=max(0.05, deadline - time.monotonic())):
            if time.monotonic() >= deadline or self.should_stop():
                raise ClientError(f"the SGLang server at {self.display_url} is not healthy after {timeout:.0f}s "
                                  "(--server-wait): is it running (and done loading the model)? Check its log, "
                                  "or --server")
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))


def _error_message(r: requests.Response) -> str:
    try:
        body = r.json()
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return str(body["error"].get("message", body))
        return str(body)[:300]
    except ValueError:
        return r.text[:300]


def generated_token(out: dict[str, Any]) -> int:
    """The first token the server generated (``output_ids``; else ``meta_info.output_token_logprobs``)."""
    ids = out.get("output_ids")
    if ids:
        return int(ids[0])
    lp = (out.get("meta_info") or {}).get("output_token_logprobs")
    if lp:
        return int(lp[0][1])
    raise ClientError(f"/generate answered without a generated token: {str(out)[:200]}")


def server_top1(out: dict[str, Any], num_tokens: int, start: int) -> dict[int, int]:
    """Position -> the server's top-1 next token there, for positions ``start .. num_tokens-1``.

    SGLang's shape (tokenizer_manager.add_logprob_to_meta_info, logprob_result_processor):
    ``meta_info.input_top_logprobs`` has one entry per input position from
    ``logprob_start_len`` on, the first ``None`` and entry j (j >= 1) the top-K of the
    distribution computed at position ``start + j - 1``, each a list of
    ``[logprob, token_id, text]`` best first; the last position's is
    ``output_top_logprobs[0]``.
    """
    return {pos: found[0][1] for pos, found in server_top(out, num_tokens, start).items()}


def server_top(out: dict[str, Any], num_tokens: int, start: int) -> dict[int, list[tuple[float, int]]]:
    """Position -> the server's top-K next tokens there as (logprob, token id), best first, for positions
    ``start .. num_tokens-1`` (the shape :func:`server_top1` reads)."""
    meta = out.get("meta_info") or {}
    inp, outp = meta.get("input_top_logprobs"), meta.get("output_top_logprobs")
    if inp is None or not outp or not outp[0]:
        raise ClientError("/generate answered without input_top_logprobs/output_top_logprobs: send it with "
                          "return_logprob, logprob_start_len and top_logprobs_num >= 1")
    if len(inp) != num_tokens - start:
        raise ClientError(f"{len(inp)} input_top_logprobs for positions {start}..{num_tokens - 1}: expected "
                          f"{num_tokens - start} (was logprob_start_len {start} sent?)")

    def pairs(entry: Any) -> list[tuple[float, int]]:
        return [(float(e[0]), int(e[1])) for e in entry]

    top = {start + j - 1: pairs(entry) for j, entry in enumerate(inp) if j >= 1 and entry}
    top[num_tokens - 1] = pairs(outp[0])
    return top
