"""Requests in flight as configured, no request lost, every deadline wall-clock (issues 42 and 46).

Against tests/openai_server.py, a real HTTP/1.1 server with keep-alive connections (as vLLM's uvicorn keeps
them) and vLLM's /metrics gauges, with faults on cue: a reply dropped after it was computed, a request accepted
and never read, a kept-alive connection closed under a request, headers or body sent a byte at a time. What
was seen on the H200 (2026-12-02): a client over one `httpx.Client()` and 256 threads held at most ~100
requests at the server, and a request the server no longer held kept a stage waiting for its whole deadline
(10 minutes) twice.
"""

import time

import pytest

from openai_server import CompletionsServer
from pipeline.engines import GenRequest
from pipeline.engines import STALLS
from pipeline.engines.inflight import vllm_load


def engine_for(model_dir, server, **options):
    from clients import openai_client

    engine = openai_client(model_dir, base_url=server.base_url, model="served", prompt_format="tokens",
                          params_section="engine", **options)
    engine.load = vllm_load(server.base_url.removesuffix("/v1"))
    engine.lost_after, engine.poll = 1.0, 0.1  # seconds: the watchdog of the GPU runs, shrunk for a test
    return engine


def requests_for(engine, n, max_new_tokens=2):
    prompt = engine.apply_chat_template([{"role": "user", "content": "Where is my order?"}])
    return [GenRequest(prompt + " " * (i % 3), max_new_tokens) for i in range(n)]


def test_every_request_the_engine_may_hold_is_in_flight_at_the_server(tiny_llama):
    """150 in flight: the server itself counts >= 90 % of them running at once (a shared httpx.Client's default
    pool held 100; benchmarks/client_inflight.py measures the clients side by side)."""
    with CompletionsServer(str(tiny_llama), "served") as server:
        server.latency = 1.0
        engine = engine_for(tiny_llama, server, concurrency=150, timeout=60)
        answers = engine.generate(requests_for(engine, 150))
    assert not [a.error for a in answers if a.error]
    assert server.max_running >= 135, server.max_running
    assert engine.peak_in_flight == 150


@pytest.mark.parametrize("fault", ["drop", "never"])
def test_a_request_the_server_lost_is_asked_again_within_seconds(tiny_llama, fault):
    """The server holds nothing (its /metrics: 0 running, 0 waiting) while requests wait: they are asked again on
    new connections, the answers are the answers, and the wait is recorded; the 60 s deadline never comes."""
    with CompletionsServer(str(tiny_llama), "served") as server:
        engine = engine_for(tiny_llama, server, concurrency=8, timeout=60)
        requests = requests_for(engine, 8)
        expected = [c.text for c in engine.generate(requests)]
        server.faults[:] = [fault, fault]
        before = len(STALLS)
        started = time.perf_counter()
        got = engine.generate(requests)
        seconds = time.perf_counter() - started
    assert [c.error for c in got] == [None] * 8
    assert [c.text for c in got] == expected
    assert seconds < 30, seconds  # the deadline is 60 s; the watchdog asks again after 1 s of an idle server
    stalls = STALLS[before:]
    assert stalls and sum(s["requests"] for s in stalls) == 2
    assert all(s["idle_s"] < 5 for s in stalls)


def test_a_request_lost_every_time_fails_alone_with_the_reason(tiny_llama):
    with CompletionsServer(str(tiny_llama), "served") as server:
        engine = engine_for(tiny_llama, server, concurrency=1, timeout=60)
        server.faults[:] = ["drop"] * 4  # the first request and its three re-asks; the others are answered
        got = engine.generate(requests_for(engine, 1) + requests_for(engine, 3))
    assert "the server lost this request 4 times" in got[0].error
    assert [c.error for c in got[1:]] == [None] * 3


def test_a_kept_alive_connection_closed_under_a_request_is_asked_again_at_once(tiny_llama):
    with CompletionsServer(str(tiny_llama), "served") as server:
        engine = engine_for(tiny_llama, server, concurrency=2, timeout=60, retries=1, backoff=0.01)
        engine.load = None  # no watchdog: the closed connection itself says the request is gone
        requests = requests_for(engine, 4)
        engine.generate(requests)  # the pool's connections are up and kept alive
        server.faults[:] = ["close", "close"]
        started = time.perf_counter()
        got = engine.generate(requests)
    assert [c.error for c in got] == [None] * 4
    assert time.perf_counter() - started < 30  # asked again at once, not after the 60 s deadline


def test_a_server_without_metrics_gets_no_watchdog_and_the_deadline_still_holds(tiny_llama):
    with CompletionsServer(str(tiny_llama), "served") as server:
        engine = engine_for(tiny_llama, server, concurrency=2, timeout=1.5, retries=0)
        engine.load = vllm_load("http://127.0.0.1:9")  # nothing answers there: load unknown, no watchdog
        server.faults[:] = ["never"]
        started = time.perf_counter()
        got = engine.generate(requests_for(engine, 1))
    assert "no complete answer within 1.5 s" in got[0].error
    assert time.perf_counter() - started < 15  # the request is never answered: only the deadline ends it


@pytest.mark.parametrize("fault", [("dribble_headers", 0.2), ("drip", 0.05)], ids=["headers", "body"])
def test_the_deadline_is_wall_clock_from_connect_to_the_last_byte(tiny_llama, fault):
    """One byte every 0.2 s of the headers (httpx's idle timeouts never fire, and a deadline checked between
    body chunks never runs): the attempt ends at its 1.5 s deadline, each retry too."""
    with CompletionsServer(str(tiny_llama), "served") as server:
        server.fault = fault
        engine = engine_for(tiny_llama, server, concurrency=1, timeout=1.5, retries=1, backoff=0.01)
        engine.load = None
        started = time.perf_counter()
        [answer] = engine.generate(requests_for(engine, 1))
        seconds = time.perf_counter() - started
    assert "no complete answer within 1.5 s" in answer.error
    assert 3.0 <= seconds < 15, seconds  # two attempts of 1.5 s; the whole answer, dribbled, takes over 20 s


def test_a_redirect_is_reported_as_a_redirect_with_where_it_points():
    from chat_server import ChatServer
    from clients import openai_client

    with ChatServer() as server:
        server.script = [("redirect", "https://api.example.com/v2/chat/completions")]
        engine = openai_client(base_url=server.base_url, model="m", timeout=5, retries=3, backoff=0.01)
        [answer] = engine.generate([GenRequest("hi", 4)])
    assert answer.error.startswith("HTTP 307 redirect to https://api.example.com/v2/chat/completions")
    assert len(server.requests) == 1  # not retried, not followed


def test_the_load_probe_reads_vllm_metrics_and_says_unknown_otherwise(tiny_llama):
    import asyncio

    from pipeline.engines.http import client

    async def probe(url):
        async with client(1) as http:
            return await vllm_load(url)(http)

    with CompletionsServer(str(tiny_llama), "served") as server:
        root = server.base_url.removesuffix("/v1")
        assert asyncio.run(probe(root)) == 0
        server.running, server.waiting = 3, 2
        assert asyncio.run(probe(root)) == 5
        server.running = server.waiting = 0
    from chat_server import ChatServer

    with ChatServer() as other:  # no /metrics page: 404
        assert asyncio.run(probe(other.base_url.removesuffix("/v1"))) is None
