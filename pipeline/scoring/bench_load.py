"""What `quantize bench` sends and how it measures it (pipeline/stages/bench.py is the stage): the two workloads (fixed
lengths of real text; the held-out conversations' real lengths), a closed-loop level at a concurrency and an
open-loop level at a Poisson request rate, their latency metrics and goodput against the SLOs, and a server
engine's requests timed over HTTP with streamed `/v1/completions`."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.engines import Timing
from pipeline.errors import UserError

log = logging.getLogger(__name__)
HAYSTACK = Path(__file__).resolve().parents[2] / "evals" / "long_context" / "alice29.txt"
STATS = ("mean", "median", "p90", "p99")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_tokens: list[int]

    def take(self, n: int) -> tuple[list[list[int]], list[int]]:
        """n requests, cycling through the workload's prompts."""
        picks = [i % len(self.prompts) for i in range(n)]
        return [self.prompts[i] for i in picks], [self.output_tokens[i] for i in picks]


def fixed_workload(encode, input_len: int, output_len: int, n: int = 64) -> Workload:
    """n different windows of real text, each exactly input_len tokens."""
    tokens = encode(HAYSTACK.read_text(encoding="utf-8"))
    if len(tokens) < input_len + n:
        raise UserError(f"{HAYSTACK}: too short for {input_len}-token prompts")
    stride = max(1, (len(tokens) - input_len) // n)
    return Workload("fixed", [tokens[i * stride:i * stride + input_len] for i in range(n)], [output_len] * n)


def holdout_workload(engine, holdout: Path, max_output: int, context: int | None, max_prompts: int = 64) -> Workload:
    """The held-out prompts (conversations ending with the user's turn, pipeline/formats/holdout.py),
    each answered with as many tokens as the real reply (`reference`) had, capped at max_output;
    conversations without a reply (the log ended on the user's turn) or longer than the context are
    left out."""
    from pipeline.formats.holdout import read_holdout

    prompts, lengths = [], []
    for record in read_holdout(holdout, limit=max_prompts, purpose="held-out conversations"):
        if not record.get("reference"):
            continue  # the log ended on the user's turn: no real reply to take the length from
        prompt = engine.encode(engine.apply_chat_template(record["messages"]))
        length = max(2, min(max_output, len(engine.encode(record["reference"]))))
        if context is None or len(prompt) + length <= context:
            prompts.append(prompt)
            lengths.append(length)
    if not prompts:
        raise UserError(f"{holdout}: no held-out conversation with a real reply fits the model's {context}-token "
                        "context; set bench.holdout: false")
    return Workload("holdout", prompts, lengths)


def distribution(values: list[float]) -> dict | None:
    """Mean, median, p90 and p99 (numpy's linear interpolation, as vLLM's bench computes them)."""
    import numpy as np

    if not values:
        return None
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), "median": float(np.percentile(array, 50)),
            "p90": float(np.percentile(array, 90)), "p99": float(np.percentile(array, 99))}


def meets_slo(timing: Timing, slo: dict) -> bool:
    checks = {"ttft_ms": timing.ttft * 1000, "tpot_ms": (timing.tpot or 0.0) * 1000, "e2el_ms": timing.seconds * 1000}
    return all(checks[name] <= limit for name, limit in slo.items() if limit is not None)


def level_metrics(timings: list[Timing], wall: float, slo: dict | None = None, **label) -> dict:
    """The figures of one level (a concurrency or a request rate) from its requests' timings."""
    good = [t for t in timings if t.error is None]
    if not good:
        raise UserError(f"every request failed at {label}: {timings[0].error}")
    ms = lambda values: distribution([1000 * v for v in values])  # noqa: E731
    ttft, tpot = ms([t.ttft for t in good]), ms([t.tpot for t in good if t.tpot is not None])
    generated = sum(t.n_tokens for t in good)
    slo = {k: v for k, v in (slo or {}).items() if v is not None}
    return {
        **label, "requests": len(timings), "failed": len(timings) - len(good),
        "input_tokens_mean": sum(t.input_tokens for t in good) / len(good),
        "output_tokens_mean": generated / len(good),
        "ttft_ms": ttft, "tpot_ms_stats": tpot, "itl_ms": ms([gap for t in good for gap in t.itl]),
        "e2el_ms": ms([t.seconds for t in good]),
        # the figures the speed table and the verdict read
        "ttft_p50_ms": ttft["median"], "ttft_p90_ms": ttft["p90"], "tpot_ms": tpot["mean"] if tpot else None,
        "output_tokens_per_s": generated / wall, "requests_per_s": len(good) / wall,
        "goodput_requests_per_s": sum(meets_slo(t, slo) for t in good) / wall if slo else None,
        "slo": slo or None, "wall_s": wall,
    }


def sweep_level(engine, workload: Workload, concurrency: int, requests: int, slo: dict | None = None) -> dict:
    """Closed loop: `requests` requests, at most `concurrency` in flight."""
    from pipeline.console import progress

    prompts, outputs = workload.take(requests)
    with progress(f"bench {workload.name} c={concurrency}", requests, "requests") as advance:
        engine.progress = advance  # each engine reports finished requests (hf: finished batches)
        started = time.perf_counter()
        timings = engine.timed_generate(prompts, outputs, concurrency)
        wall = time.perf_counter() - started
        engine.progress = None
    level = level_metrics(timings, wall, slo, concurrency=concurrency)
    level["memory_bytes"] = engine.device_memory_used()
    return level


def rate_level(engine, workload: Workload, rate: float, requests: int, slo: dict | None = None,
               seed: int = 0) -> dict:
    """Open loop: `requests` requests arriving as a Poisson process of `rate` per second."""
    from pipeline.console import progress

    prompts, outputs = workload.take(requests)
    with progress(f"bench {workload.name} {rate:g} req/s", requests, "requests") as advance:
        engine.progress = advance
        started = time.perf_counter()
        timings = engine.timed_generate(prompts, outputs, None, rate=rate, seed=seed)
        wall = time.perf_counter() - started
        engine.progress = None
    level = level_metrics(timings, wall, slo, request_rate=rate)
    level["memory_bytes"] = engine.device_memory_used()
    return level


class HttpTiming:
    """`timed_generate` for a server engine: streamed /v1/completions with token-id prompts, each
    chunk timed on arrival. Wraps the engine (vllm or openai) and adds nothing between the clock
    and the socket but JSON parsing of each event."""

    def __init__(self, engine, vllm_extras: bool):
        self.engine, self.vllm_extras = engine, vllm_extras
        self.progress = None  # callable(n) told of each finished request

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _body(self, prompt: list[int], output_len: int) -> dict:
        body = {"model": self.engine.served_model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        if self.vllm_extras:  # exactly output_len tokens each, counted by id
            body |= {"ignore_eos": True, "min_tokens": output_len, "return_token_ids": True}
        return body

    async def _one(self, http, prompt: list[int], output_len: int) -> Timing:
        """One streamed request, timed chunk by chunk, the whole of it within one wall-clock deadline; a chunk
        that is not what the API specifies (pipeline/engines/replies.py: stream_chunk) makes it a failed request,
        with the reason."""
        from pipeline.engines.http import FatalError, Limits, RetryableError, within

        limits = Limits(deadline=max(600.0, self.engine.limits.deadline if hasattr(self.engine, "limits") else 600.0),
                        max_bytes=256 << 20)
        started = time.perf_counter()
        seen = {"first": None, "last": None, "itl": [], "n": 0, "usage": None}
        try:
            await within(limits, self._consume(http, prompt, output_len, limits, seen), "stream not finished")
        except (RetryableError, FatalError) as exc:
            done = time.perf_counter()
            return Timing(ttft=done - started, seconds=done - started, n_tokens=0, input_tokens=len(prompt),
                          error=str(exc))
        done = time.perf_counter()
        if self.progress:
            self.progress(1)
        n_tokens = seen["usage"] if seen["usage"] and not self.vllm_extras else seen["n"]
        return Timing(ttft=(seen["first"] or done) - started, seconds=done - started, n_tokens=n_tokens,
                      input_tokens=len(prompt), itl=seen["itl"])

    async def _consume(self, http, prompt: list[int], output_len: int, limits, seen: dict) -> None:
        from pipeline.engines.http import stream_events
        from pipeline.engines.replies import BadReply, stream_chunk

        url = self.engine.base_url + "/completions"
        async for arrived, event in stream_events(http, url, self._body(prompt, output_len), self.engine.headers,
                                                  limits):
            count, total = stream_chunk(event, output_len)
            seen["usage"] = total if total is not None else seen["usage"]
            if not count:
                continue
            if seen["first"] is None:
                seen["first"] = arrived
            else:
                seen["itl"].append(arrived - seen["last"])
            seen["last"] = arrived
            seen["n"] += count
            if self.vllm_extras and seen["n"] > output_len:  # counted by id: never more than asked
                raise BadReply("choices[0].token_ids", f"{output_len} tokens in all", seen["n"])

    def timed_generate(self, prompts: list[list[int]], output_tokens: list[int], concurrency: int | None,
                       rate: float | None = None, seed: int = 0) -> list[Timing]:
        """Closed loop (`concurrency` in flight, the next sent as one finishes) or open loop (Poisson arrivals of
        `rate` per second, each sent when it arrives, however many are in flight): one event loop, a connection of
        its own for every request in flight (pipeline/engines/http.py: client)."""
        import asyncio

        jobs = list(zip(prompts, output_tokens))
        return asyncio.run(self._timed(jobs, concurrency, rate, seed))

    async def _timed(self, jobs: list[tuple[list[int], int]], concurrency: int | None, rate: float | None,
                     seed: int) -> list[Timing]:
        import asyncio

        from pipeline.engines.http import client

        width = len(jobs) if rate is not None else max(1, concurrency or 1)
        gate = asyncio.Semaphore(width)
        due = _arrivals(len(jobs), rate, seed) if rate is not None else [0.0] * len(jobs)
        async with client(width + 4) as http:
            start = time.perf_counter()

            async def one(job: tuple[list[int], int], at: float) -> Timing:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                async with gate:
                    return await self._one(http, *job)

            return list(await asyncio.gather(*(one(job, at) for job, at in zip(jobs, due))))


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of n requests arrives: a Poisson process of `rate` per second."""
    rng = random.Random(seed)
    due, at = [], 0.0
    for index in range(n):
        if index:
            at += rng.expovariate(rate)
        due.append(at)
    return due
