"""HTTP to OpenAI-compatible servers, bounded: one total deadline per attempt and a cap on bytes.

httpx's timeouts are idle timeouts: a server that sends one byte a second keeps a request alive
forever under `timeout=2`. Here every attempt has a wall-clock deadline checked between chunks (and
each read waits at most until that deadline), and a response larger than `max_bytes` is dropped
unread. Both raise `RetryableError`, like a timeout or a 5xx; a 4xx other than 408/409/429 raises
`FatalError` (asking again will not help). The caller decides about retries.

`post_json` returns one JSON body; `stream_events` yields server-sent events (`data: {...}` lines)
with the time each arrived, which is what `quantize bench` times TTFT and inter-token latency by.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Iterator


class RetryableError(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class FatalError(Exception):
    """A client error (4xx other than 408, 409, 429): not retried."""


@dataclass(frozen=True)
class Limits:
    deadline: float = 120.0  # seconds for one whole attempt: connect, send, every byte of the answer
    max_bytes: int = 8 << 20  # a larger answer is dropped (a runaway or hostile server)


def _timeout(remaining: float):
    import httpx

    remaining = max(0.001, remaining)
    return httpx.Timeout(remaining, connect=min(remaining, 30.0))


def _check_status(response, body: bytes) -> None:
    if response.status_code == 429:
        raise RetryableError("HTTP 429 (rate limited)", _retry_after(response.headers.get("retry-after")))
    if response.status_code >= 500 or response.status_code in (408, 409):
        raise RetryableError(f"HTTP {response.status_code}: {body[:200].decode('utf-8', 'replace')}")
    if response.status_code >= 400:
        raise FatalError(f"HTTP {response.status_code}: {body[:200].decode('utf-8', 'replace')}")


def _read_capped(response, started: float, limits: Limits) -> bytes:
    chunks, total = [], 0
    for chunk in response.iter_bytes():
        total += len(chunk)
        if total > limits.max_bytes:
            raise RetryableError(f"answer larger than {limits.max_bytes} bytes; dropped")
        chunks.append(chunk)
        if time.monotonic() - started > limits.deadline:
            raise RetryableError(f"no complete answer within {limits.deadline:g} s")
    return b"".join(chunks)


def post_json(client, url: str, body: dict, headers: dict, limits: Limits) -> dict:
    """POST `body`, return the parsed JSON answer (HTTP 200) or raise Retryable/FatalError."""
    import httpx

    started = time.monotonic()
    try:
        with client.stream("POST", url, json=body, headers=headers, timeout=_timeout(limits.deadline)) as response:
            raw = _read_capped(response, started, limits)
    except httpx.TimeoutException:
        raise RetryableError(f"no complete answer within {limits.deadline:g} s") from None
    except httpx.TransportError as exc:
        raise RetryableError(f"connection failed: {type(exc).__name__}: {exc}") from None
    _check_status(response, raw)
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested 100,000 deep
        raise RetryableError(f"malformed response ({type(exc).__name__}): {raw[:200]!r}") from None
    return data


def stream_events(client, url: str, body: dict, headers: dict, limits: Limits) -> Iterator[tuple[float, dict]]:
    """POST with `stream: true`; yields (perf_counter at arrival, event) for each `data:` JSON event
    until `data: [DONE]`. Raises Retryable/FatalError like post_json."""
    import httpx

    started = time.monotonic()
    total = 0
    try:
        with client.stream("POST", url, json=body, headers=headers, timeout=_timeout(limits.deadline)) as response:
            if response.status_code != 200:
                _check_status(response, _read_capped(response, started, limits))
            for line in response.iter_lines():
                arrived = time.perf_counter()
                total += len(line) + 1
                if total > limits.max_bytes:
                    raise RetryableError(f"stream larger than {limits.max_bytes} bytes; dropped")
                if time.monotonic() - started > limits.deadline:
                    raise RetryableError(f"stream not finished within {limits.deadline:g} s")
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                try:
                    event = json.loads(payload)
                    if not isinstance(event, dict):
                        raise ValueError("not a JSON object")
                except (ValueError, RecursionError):
                    raise RetryableError(f"malformed event: {payload[:200]!r}") from None
                if event.get("error"):
                    raise RetryableError(f"server error in stream: {_quoted(event['error'])}")
                yield arrived, event
    except httpx.TimeoutException:
        raise RetryableError(f"stream not finished within {limits.deadline:g} s") from None
    except httpx.TransportError as exc:
        raise RetryableError(f"connection failed: {type(exc).__name__}: {exc}") from None


def get_ok(url: str, timeout: float = 2.0) -> bool:
    """True when GET url answers 200 (a health check)."""
    import httpx

    try:
        return httpx.get(url, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


def _retry_after(value: str | None) -> float | None:
    try:
        seconds = float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP-date: fall back to our own backoff
    return max(0.0, seconds) if seconds is not None and math.isfinite(seconds) else None


def _quoted(value, limit: int = 200) -> str:
    """A server's own error message, quoted in ours: cut, and writable as UTF-8 (a lone surrogate replaced)."""
    text = (value if isinstance(value, str) else repr(value))[:limit]
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
