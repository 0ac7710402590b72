"""HTTP to OpenAI-compatible servers, bounded: one wall-clock deadline per attempt and a cap on bytes.

Idle timeouts (httpx's, aiohttp's sock_read) are not deadlines: a server that sends one byte a second, of its
headers or of its body, keeps a request alive forever under `timeout=2`. Here every attempt runs on an asyncio event
loop under one wall-clock deadline, from connecting through the response headers to the last byte (`within`: the
attempt is cancelled when it passes), and a response larger than `max_bytes` is dropped unread. Both raise
`RetryableError`, like a lost connection or a 5xx; a redirect and a 4xx other than 408/409/429 raise `FatalError`
(asking again will not help: a redirect names where the server moved, the setting to change). The caller decides
about retries.

`post_json` returns one JSON body; `stream_events` yields server-sent events (`data: {...}` lines) with the
time each arrived, which is what `quantize bench` times TTFT and inter-token latency by. Both are coroutines on
an aiohttp session made by `client(n)`, whose connector holds n connections: a caller never has more requests in
flight than connections (pipeline/engines/inflight.py). aiohttp, not httpx's AsyncClient: at 256 requests in
flight httpx's pool took ~10x longer per request than aiohttp's connector on the same server
(benchmarks/client_inflight.py; its O(requests x connections) bookkeeping), and a thread pool over httpx's sync
client holds at most its pool's connections in flight and can hang a request until its timeout
(encode/httpcore#1110).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable, TypeVar

T = TypeVar("T")


class RetryableError(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class FatalError(Exception):
    """A client error (4xx other than 408, 409, 429) or a redirect: not retried."""


@dataclass(frozen=True)
class Limits:
    deadline: float = 120.0  # seconds for one whole attempt: connect, send, headers, every byte of the answer
    max_bytes: int = 8 << 20  # a larger answer is dropped (a runaway or hostile server)


def client(connections: int):
    """An aiohttp session whose connector keeps `connections` connections alive between requests; no redirect is
    followed (post_json reports it, FatalError, with where it points). Use it as `async with client(n) as http`."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=max(1, int(connections)), limit_per_host=0, ttl_dns_cache=None)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                 auto_decompress=True, skip_auto_headers=("User-Agent",))


async def within(limits: Limits, attempt: Awaitable[T], what: str = "no complete answer") -> T:
    """The attempt, cancelled at the wall-clock deadline (RetryableError), whatever stage it is in: connecting,
    waiting for or reading the headers, reading the body."""
    try:
        return await asyncio.wait_for(attempt, limits.deadline)
    except asyncio.TimeoutError:
        raise RetryableError(f"{what} within {limits.deadline:g} s") from None


def _check_status(response, body: bytes) -> None:
    code = response.status
    if code == 429:
        raise RetryableError("HTTP 429 (rate limited)", _retry_after(response.headers.get("Retry-After")))
    if 300 <= code < 400:
        where = response.headers.get("Location")
        if where:
            raise FatalError(f"HTTP {code} redirect to {_quoted(where)}: the server moved; point the base URL at that "
                             "address")
        raise FatalError(f"HTTP {code} redirect without a Location header: check the base URL")
    if code >= 500 or code in (408, 409):
        raise RetryableError(f"HTTP {code}: {body[:200].decode('utf-8', 'replace')}")
    if code >= 400:
        raise FatalError(f"HTTP {code}: {body[:200].decode('utf-8', 'replace')}")


async def _read_capped(response, limits: Limits) -> bytes:
    chunks, total = [], 0
    async for chunk in response.content.iter_chunked(1 << 16):
        total += len(chunk)
        if total > limits.max_bytes:
            raise RetryableError(f"answer larger than {limits.max_bytes} bytes; dropped")
        chunks.append(chunk)
    return b"".join(chunks)


def _connection_failed(exc: Exception) -> RetryableError:
    return RetryableError(f"connection failed: {type(exc).__name__}: {exc}")


async def post_json(http, url: str, body: dict, headers: dict, limits: Limits,
                    on_headers: Callable[[], None] | None = None) -> dict:
    """POST `body`, return the parsed JSON answer (HTTP 200) or raise Retryable/FatalError; the whole attempt
    within limits.deadline. on_headers() is called when the response's headers have arrived (the server is
    answering: pipeline/engines/inflight.py tells a request being answered from one the server lost)."""
    import aiohttp

    async def attempt() -> tuple[object, bytes]:
        async with http.post(url, json=body, headers=headers, allow_redirects=False) as response:
            if on_headers is not None:
                on_headers()
            return response, await _read_capped(response, limits)

    try:
        response, raw = await within(limits, attempt())
    except (aiohttp.ClientError, OSError) as exc:
        raise _connection_failed(exc) from None
    _check_status(response, raw)
    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested 100,000 deep
        raise RetryableError(f"malformed response ({type(exc).__name__}): {raw[:200]!r}") from None
    return data


async def _lines(response, limits: Limits) -> AsyncIterator[tuple[float, str]]:
    """The body's lines as they arrive (any length), with the time each was complete; over max_bytes: dropped."""
    pending, total = b"", 0
    async for chunk in response.content.iter_any():
        arrived = time.perf_counter()
        total += len(chunk)
        if total > limits.max_bytes:
            raise RetryableError(f"stream larger than {limits.max_bytes} bytes; dropped")
        *complete, pending = (pending + chunk).split(b"\n")
        for line in complete:
            yield arrived, line.rstrip(b"\r").decode("utf-8", "replace")
    if pending:
        yield time.perf_counter(), pending.decode("utf-8", "replace")


async def stream_events(http, url: str, body: dict, headers: dict, limits: Limits) -> AsyncIterator[tuple[float, dict]]:
    """POST with `stream: true`; yields (perf_counter at arrival, event) for each `data:` JSON event until
    `data: [DONE]`. Raises Retryable/FatalError like post_json. The caller holds the deadline: it consumes the
    whole stream inside `within` (a deadline checked between events would let dribbled headers through)."""
    import aiohttp

    try:
        async with http.post(url, json=body, headers=headers, allow_redirects=False) as response:
            if response.status != 200:
                _check_status(response, await _read_capped(response, limits))
            async for arrived, line in _lines(response, limits):
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
    except (aiohttp.ClientError, OSError) as exc:
        raise _connection_failed(exc) from None


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
    """A server's own text, quoted in ours: cut, and writable as UTF-8 (a lone surrogate replaced)."""
    text = (value if isinstance(value, str) else repr(value))[:limit]
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in text)
