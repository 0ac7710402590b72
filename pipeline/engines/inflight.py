"""Many requests to one server with a fixed number in flight, on one asyncio event loop; a request the server
lost is noticed within seconds and asked again.

Why an event loop and not a thread pool over one `httpx.Client()`: that client's pool keeps at most 100
connections (httpx's default), so 256 threads had at most ~100 requests in flight (vLLM's own log on the H200:
`Running: 100-102 reqs` at engine.batch_size 256), and a thread queued for a connection can hang until its read
timeout when the pool closes a connection it has already handed to it (encode/httpcore#1110: several threads
per connection, surplus keep-alive connections closed). Here one loop runs every request of a call, a semaphore
holds `concurrency` of them in flight, and an aiohttp connector keeps exactly that many connections alive
(pipeline/engines/http.py: client), so every request has a connection of its own from send to last byte, and
the next request goes out the moment one finishes (no waves). vLLM's own `vllm bench serve` client and lm-eval's
`local-completions` keep their requests in flight the same way (asyncio and aiohttp); the clients side by side:
benchmarks/client_inflight.py.

Lost requests. A request whose reply the server dropped, whose connection the server accepted and never read,
or that fell between a closing keep-alive connection and the next request waits, without this, for its whole
deadline (engine.timeout, 600 s on the GPU profile) on a server that holds nothing: seen on the H200, two
10-minute calls spent on `Running: 0 reqs, Waiting: 0 reqs`. While requests are out, a watchdog asks the server
every `poll` seconds how many requests it holds (`load`: vLLM's /metrics, vllm:num_requests_running +
vllm:num_requests_waiting). When it has held none for `lost_after` seconds, no reply arrived meanwhile, and
requests sent before then have no reply started, those requests are lost: each is cancelled and asked again on a
fresh connection, at most `max_lost` times, and the wait is recorded in STALLS (what the stage log and the GPU
run's results report). A connection the server closed fails at once (httpx's transport error) and is retried by
the caller's own retries. A server that reports no load (an OpenAI API) has no watchdog: each attempt's
wall-clock deadline bounds the wait.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Generic, TypeVar

from pipeline.engines.records import PEAK_IN_FLIGHT, STALLS

I, R = TypeVar("I"), TypeVar("R")

LOST_AFTER_S = 10.0  # seconds of an idle server (and no reply) before its outstanding requests count as lost
POLL_S = 1.0
MAX_LOST = 3  # times one request is asked again after the server lost it


@dataclass(eq=False)  # held in a set by identity
class Tracker:
    """One attempt at one request, as the watchdog sees it: when it was (last) sent, whether the server has
    started answering it (its response headers arrived), whether the watchdog took it for lost."""

    sent_at: float | None = None
    answering: bool = False
    lost: bool = False
    task: asyncio.Task | None = field(default=None, repr=False)

    def sending(self) -> None:
        self.sent_at, self.answering = time.monotonic(), False

    def answered(self) -> None:
        self.answering = True


LoadProbe = Callable[[object], Awaitable[int | None]]  # (probe client) -> requests the server holds, None unknown


@dataclass
class Runner(Generic[I, R]):
    """attempt(http, item, tracker) -> result for one item (it calls tracker.sending() before each send and passes
    tracker.answered to post_json as on_headers); lost(item, why) -> the result of an item lost max_lost + 1
    times. Failures are results (the caller's Completion with `error`); an exception from an attempt stops the
    whole call (every other request cancelled) and is raised."""

    attempt: Callable[[object, I, Tracker], Awaitable[R]]
    lost: Callable[[I, str], R]
    concurrency: int
    load: LoadProbe | None = None
    server: str = ""
    lost_after: float = LOST_AFTER_S
    poll: float = POLL_S
    max_lost: int = MAX_LOST
    out: set = field(default_factory=set, repr=False)
    last_reply: float = field(default=0.0, repr=False)
    peak: int = 0  # most requests in flight at once, this call

    def run(self, items: list[I], on_done: Callable[[int, R], None] | None = None) -> list[R]:
        """Every item's result, in order; on_done(index, result) is called in this thread as each arrives."""
        if not items:
            return []
        return asyncio.run(self._all(items, on_done))

    async def _all(self, items: list[I], on_done) -> list[R]:
        from pipeline.engines.http import client

        results: list[R | None] = [None] * len(items)
        gate = asyncio.Semaphore(max(1, self.concurrency))

        async def one(index: int) -> None:
            async with gate:
                results[index] = await self._ask(http, items[index])
            if on_done is not None:
                on_done(index, results[index])

        async with client(self.concurrency) as http:
            guard = asyncio.create_task(self._guard()) if self.load is not None else None
            tasks = [asyncio.create_task(one(i)) for i in range(len(items))]
            try:
                await asyncio.gather(*tasks)
            except BaseException:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise
            finally:
                if guard is not None:
                    guard.cancel()
                    await asyncio.gather(guard, return_exceptions=True)
        return results

    async def _ask(self, http, item: I) -> R:
        for _ in range(self.max_lost + 1):
            tracker = Tracker()
            tracker.task = asyncio.create_task(self.attempt(http, item, tracker))
            self.out.add(tracker)
            self.peak = max(self.peak, len(self.out))
            PEAK_IN_FLIGHT[self.server] = max(PEAK_IN_FLIGHT.get(self.server, 0), self.peak)
            try:
                result = await tracker.task
                self.last_reply = time.monotonic()
                return result
            except asyncio.CancelledError:
                if not tracker.lost:  # cancelled from outside (the call is stopping): not ours to retry
                    raise
            finally:
                self.out.discard(tracker)
        return self.lost(item, f"the server lost this request {self.max_lost + 1} times (it reported nothing running "
                               f"or waiting for {self.lost_after:g} s while the request had no reply)")

    async def _guard(self) -> None:
        """The watchdog: cancels (for _ask to send again) the requests a server that holds nothing has lost."""
        from pipeline.engines.http import client

        idle_since = None  # when the server was first seen holding nothing, with requests of ours unanswered
        async with client(1) as probe_http:  # its own connection: the requests' pool is busy
            while True:
                await asyncio.sleep(self.poll)
                waiting = [t for t in self.out if t.sent_at is not None and not t.answering]
                held = await self.load(probe_http) if waiting else None
                now = time.monotonic()
                if held != 0:  # nothing out, the server busy, or its load unknown
                    idle_since = None
                elif idle_since is None or self.last_reply > idle_since:  # idle from now (a reply came meanwhile)
                    idle_since = now
                elif now - idle_since >= self.lost_after:
                    self._cancel_lost([t for t in waiting if t.sent_at <= idle_since], now - idle_since)
                    idle_since = None

    def _cancel_lost(self, lost: list[Tracker], idle: float) -> None:
        for tracker in lost:
            tracker.lost = True
            tracker.task.cancel()
        if lost:
            STALLS.append({"server": self.server, "idle_s": round(idle + self.poll, 1), "requests": len(lost),
                           "at": round(time.time(), 1)})


METRIC = re.compile(r"^vllm:num_requests_(running|waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.MULTILINE)


def vllm_load(base_url: str) -> LoadProbe:
    """The requests a vLLM server holds (running + waiting), from its Prometheus /metrics; None when the page does
    not answer in time or carries neither gauge (not a vLLM server: no watchdog then)."""
    url = base_url.rstrip("/") + "/metrics"

    async def probe(http) -> int | None:
        import aiohttp

        try:
            async with http.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as response:
                if response.status != 200:
                    return None
                text = await response.text()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, UnicodeDecodeError):
            return None
        found = METRIC.findall(text)
        if not found:
            return None
        try:
            return int(sum(float(value) for _, value in found))
        except ValueError:
            return None

    return probe
