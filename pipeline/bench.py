"""`quantize bench MODEL_DIR [--engine vllm|lmdeploy|hf|openai]`: serving speed, beside the accuracy.

Two workloads: `fixed` (every request has the same prompt and output length: real text from
evals/long_context, cut to length) and `holdout` (the held-out conversations' real prompts, each
answered with as many tokens as its real reply had). Two kinds of load, as `vllm bench serve` offers:
a closed-loop sweep over max concurrency (default 1, 4, 16, 64 requests in flight) and, for server
engines, a sweep over request rates with Poisson arrivals (on the fixed workload). Per level, as vLLM's bench reports them:
TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99), output tokens/s, requests/s,
goodput (requests/s that meet every SLO in `bench.slo`) and device memory.

Server engines (`vllm`: `vllm serve` started and stopped by the stage, its log kept beside the
results; `openai`: a server already running) are timed over HTTP with streamed `/v1/completions`,
token-id prompts and, on vLLM, `ignore_eos` so each request decodes exactly its output length.
In-process engines (`hf`, `lmdeploy`) time requests with their own clocks (`timed_generate`).

Beside batch 1 stands its roofline: decoding one token reads every weight once plus the KV cache
so far, so tokens/s can be at most (memory bandwidth) / (bytes per token). The bandwidth is
measured on this device with a large copy, before the engine starts.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints.sizes import kv_bytes_per_token
from pipeline.engines import Timing, capability
from pipeline.errors import UserError
from pipeline.outputs import Stopwatch, write_json
from pipeline.params import BenchParams, EngineParams, sections_with_overrides

log = logging.getLogger(__name__)
HAYSTACK = Path(__file__).resolve().parent.parent / "evals" / "long_context" / "alice29.txt"
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

    def _one(self, client, prompt: list[int], output_len: int) -> Timing:
        """One streamed request, timed chunk by chunk; a chunk that is not what the API specifies
        (pipeline/engines/replies.py: stream_chunk) makes it a failed request, with the reason."""
        from pipeline.engines.http import FatalError, Limits, RetryableError, stream_events
        from pipeline.engines.replies import BadReply, stream_chunk

        limits = Limits(deadline=max(600.0, self.engine.limits.deadline if hasattr(self.engine, "limits") else 600.0),
                        max_bytes=256 << 20)
        started = time.perf_counter()
        first = last = None
        itl, n_tokens, usage = [], 0, None
        url = self.engine.base_url + "/completions"
        try:
            for arrived, event in stream_events(client, url, self._body(prompt, output_len), self.engine.headers,
                                                limits):
                count, total = stream_chunk(event, output_len)
                usage = total if total is not None else usage
                if not count:
                    continue
                if first is None:
                    first = arrived
                else:
                    itl.append(arrived - last)
                last = arrived
                n_tokens += count
                if self.vllm_extras and n_tokens > output_len:  # counted by id: never more than asked
                    raise BadReply("choices[0].token_ids", f"{output_len} tokens in all", n_tokens)
        except (RetryableError, FatalError) as exc:
            done = time.perf_counter()
            return Timing(ttft=done - started, seconds=done - started, n_tokens=0, input_tokens=len(prompt),
                          error=str(exc))
        done = time.perf_counter()
        if self.progress:
            self.progress(1)
        if usage and not self.vllm_extras:
            n_tokens = usage
        return Timing(ttft=(first or done) - started, seconds=done - started, n_tokens=n_tokens,
                      input_tokens=len(prompt), itl=itl)

    def timed_generate(self, prompts: list[list[int]], output_tokens: list[int], concurrency: int | None,
                       rate: float | None = None, seed: int = 0) -> list[Timing]:
        import httpx

        jobs = list(zip(prompts, output_tokens))
        limits = httpx.Limits(max_connections=len(jobs) + 4, max_keepalive_connections=len(jobs) + 4)
        with httpx.Client(limits=limits) as client:
            if rate is None:
                with ThreadPoolExecutor(max(1, concurrency)) as pool:
                    return list(pool.map(lambda job: self._one(client, *job), jobs))
            # Poisson arrivals: exponential gaps; every request gets its own thread when it arrives
            rng = random.Random(seed)
            results: list[Timing | None] = [None] * len(jobs)
            threads = []
            start = time.perf_counter()
            due = 0.0
            for index, job in enumerate(jobs):
                if index:
                    due += rng.expovariate(rate)
                delay = start + due - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                thread = threading.Thread(target=lambda i=index, j=job: results.__setitem__(i, self._one(client, *j)))
                thread.start()
                threads.append(thread)
            for thread in threads:
                thread.join()
            return results


def measure_bandwidth(device: str, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second of a large copy (each byte read once and written once)."""
    import torch

    n = int(gib * 2**30) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync()
    rate = 2 * src.numel() * 4 * repeats / (time.perf_counter() - started)
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()  # hand the memory back: a server engine starts next and sizes its KV pool by it
    return rate


def roofline(engine, model_dir: Path, batch1: dict, bandwidth: float, kv_dtype_bytes: int) -> dict:
    context = batch1["input_tokens_mean"] + batch1["output_tokens_mean"] / 2
    weights = engine.weight_bytes_per_token()
    per_token = weights + kv_bytes_per_token(model_dir, kv_dtype_bytes) * context
    bound = bandwidth / per_token
    achieved = 1000 / batch1["tpot_ms"] if batch1.get("tpot_ms") else None
    return {"bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": weights, "bytes_per_token": per_token,
            "mean_context": context, "bound_tokens_per_s": bound, "achieved_tokens_per_s": achieved,
            "fraction_of_bound": achieved / bound if achieved else None}


@dataclass
class BenchResult:
    path: Path
    summary: dict
    seconds: float

    def summary_line(self) -> str:
        fixed = self.summary["workloads"].get("fixed") or next(iter(self.summary["workloads"].values()))
        by_c = ", ".join(f"c{l['concurrency']} {l['output_tokens_per_s']:.0f}" for l in fixed["levels"])
        r = self.summary.get("roofline") or {}
        bound = f"; batch 1 at {r['fraction_of_bound']:.0%} of its roofline" if r.get("fraction_of_bound") else ""
        return (f"bench: wrote {self.path} ({self.summary['engine']}, {fixed['name']} workload, output tok/s "
                f"{by_c}{bound}) in {self.seconds:.0f} s")


def versions() -> dict:
    """torch's, transformers' and every registered engine's package's version (None: not installed)."""
    from importlib import metadata

    from pipeline.engines import ENGINES

    found = {}
    packages = {spec.package for spec in ENGINES.values() if spec.package} - {"torch", "transformers"}
    for name in ("torch", "transformers", *sorted(packages)):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        return torch.cuda.get_device_name(0) + (f" x{count}" if count > 1 else "")
    import os

    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def describe_engine(lm, name: str, options: dict) -> dict:
    """Engine, version and the settings it ran with, as the report names them."""
    if hasattr(lm, "describe"):
        return lm.describe()
    from pipeline.engines import ENGINES

    version = versions().get(ENGINES[name].package) if name in ENGINES else None
    keep = ("batch_size", "dtype", "tensor_parallel_size", "prompt_format", "base_url", "model")
    return {"engine": name, "version": version, "settings": {k: options[k] for k in keep if k in options},
            "tensor_parallel_size": int(options.get("tensor_parallel_size") or 1)}


def run(model_dir: Path | str, out: Path | str, settings: BenchParams | None = None,
        engine_settings: EngineParams | None = None, *, engine: str | None = None, holdout: Path | None = None,
        **overrides) -> BenchResult:
    """settings: params.yaml `bench`; engine_settings: params.yaml `engine` (defaults in params.py);
    `overrides` (e.g. concurrency=[1, 2], input_len=16, batch_size=64) replace the field of that name in
    the bench section, else in the engine section, and are validated again. engine: the engine's name
    (default: bench.engine, else engine.name). holdout: held-out conversations for the real-length
    workload (None: the fixed workload only). requests_per_level: requests per level as a multiple of
    the concurrency (at least 4 in all)."""
    from pipeline.engines import STARTS, engine_spec, engine_start_seconds, make_engine

    starts_before, watch = len(STARTS), Stopwatch()
    b, e = sections_with_overrides(settings or BenchParams, engine_settings or EngineParams, **overrides)
    engine = engine or b.engine or e.name
    model_dir, out = Path(model_dir), Path(out)
    spec = engine_spec(engine)
    options = e.options(engine)  # a missing setting (openai: engine.model) stops before any work
    context = _checked(model_dir, b, spec, engine)
    options["batch_size"] = max(max(b.concurrency), options.get("batch_size", 1))
    if spec.starts_server:
        options.setdefault("log_path", out.with_name(out.stem + ".vllm.log"))
    device = "cuda" if _cuda() else "cpu"
    # measured before the engine starts: a server takes most of the GPU's memory for its KV pool
    bandwidth = measure_bandwidth(device, 1.0 if device == "cuda" else 0.25) if spec.local_weights else None
    lm = make_engine(engine, model_dir, **options)
    try:
        quiet_wait = _quiet_gpu(lm) if spec.starts_server else 0.0
        timer = HttpTiming(lm, vllm_extras=spec.starts_server) if spec.timing == "http" else lm
        workloads = _sweep(timer, b, holdout, context)
        summary = _summary(lm, model_dir, engine, spec, options, b, workloads, bandwidth)
        summary["capacity"] = engine_capacity(lm, model_dir, summary, workloads["fixed"], b.slo.model_dump(), context,
                                              options)
        summary["engine_start_s"] = engine_start_seconds(starts_before)
        summary["waited_for_other_starts_s"] = round(quiet_wait, 2)
    finally:
        lm.close()
    summary["seconds"] = round(watch.seconds, 2)
    write_json(out, summary)
    return BenchResult(out, summary, watch.seconds)


def _checked(model_dir: Path, b: BenchParams, spec, engine: str) -> int | None:
    """Refused before any work: a checkpoint no engine could load, a request-rate sweep on an in-process engine,
    a workload longer than the model's context. Returns the context length."""
    from pipeline.checkpoints import headers
    from pipeline.engines import engine_names
    from pipeline.long_context import context_length

    headers.check(model_dir, weights=spec.local_weights)  # openai: a running server holds the weights
    if b.request_rates and spec.timing != "http":
        raise UserError(f"bench.request_rates: request-rate sweeps need a server engine "
                        f"({engine_names(where=lambda s: s.timing == 'http')}), "
                        f"not {engine}; set bench.request_rates: [] or --engine vllm")
    context = context_length(model_dir)
    if context is not None and b.input_len + b.output_len > context:
        raise UserError(f"--input-len {b.input_len} + --output-len {b.output_len} exceed {model_dir}'s "
                        f"{context}-token context; choose shorter lengths")
    return context


def _sweep(timer, b: BenchParams, holdout: Path | None, context: int | None) -> dict:
    """Each workload (fixed lengths; the held-out prompts' real lengths) at every concurrency, and the fixed one
    at every request rate."""
    slo = b.slo.model_dump()
    loads = [fixed_workload(timer.encode, b.input_len, b.output_len)]
    if holdout is not None:
        loads.append(holdout_workload(timer, Path(holdout), b.output_len, context))
    workloads = {}
    for load in loads:
        # warm-up on this workload's own shapes: kernels autotune on the first new size (seen:
        # a 4 s first request of AWQ on lmdeploy with 800-token prompts after a 128-token warm-up)
        timer.timed_generate(*load.take(1), 1)
        levels, rates = [], []
        for c in b.concurrency:
            levels.append(sweep_level(timer, load, c, max(4, b.requests_per_level * c), slo))
            log.info(f"  {load.name} c={c}: {levels[-1]['output_tokens_per_s']:.1f} tok/s, "
                     f"TTFT p50 {levels[-1]['ttft_p50_ms']:.0f} ms")
        for rate in b.request_rates if load.name == "fixed" else ():  # open loop on the fixed lengths only
            rates.append(rate_level(timer, load, rate, max(8, round(rate * b.rate_seconds)), slo))
            log.info(f"  {load.name} {rate:g} req/s: {rates[-1]['output_tokens_per_s']:.1f} tok/s, "
                     f"TTFT p50 {rates[-1]['ttft_p50_ms']:.0f} ms")
        workloads[load.name] = {"name": load.name, "prompts": len(load.prompts), "levels": levels, "rates": rates}
    return workloads


def _summary(lm, model_dir: Path, engine: str, spec, options: dict, b: BenchParams, workloads: dict,
             bandwidth: float | None) -> dict:
    batch1 = next(level for level in workloads["fixed"]["levels"] if level["concurrency"] == min(b.concurrency))
    kv_bytes = lm.kv_dtype_bytes() if hasattr(lm, "kv_dtype_bytes") else _engine_dtype_bytes(lm)
    parallel = getattr(lm, "parallel", None) or {"tensor_parallel_size": 1}  # engines without tensor parallelism
    return {
        "model_dir": str(model_dir), "engine": engine, "engine_info": describe_engine(lm, engine, options),
        "device": device_name() if spec.local_weights else f"served at {options.get('base_url')}",
        "parallel": parallel, "versions": versions(), "date": time.strftime("%Y-%m-%d"), "input_len": b.input_len,
        "output_len": b.output_len, "slo": b.slo.model_dump() or None, "workloads": workloads,
        # tensor parallel: each of the GPUs reads its share of the weights, so the bandwidth adds up
        "roofline": roofline(lm, model_dir, batch1, bandwidth * parallel.get("tensor_parallel_size", 1), kv_bytes)
        if bandwidth else None,
    }


def engine_capacity(lm, model_dir: Path, summary: dict, fixed: dict, slo: dict, context: int | None,
                    options: dict) -> dict:
    """What the variant buys (pipeline/engines/capacity.py): KV-cache tokens at the configured memory
    fraction, the longest context one request can have, weight memory (from the engine's own start-up
    figures where it reports them: vLLM), and output tokens/s per GPU of the requests that met bench.slo."""
    from pipeline.checkpoints.sizes import checkpoint_weight_bytes
    from pipeline.engines.capacity import capacity

    figures = lm.capacity() if hasattr(lm, "capacity") else {}
    tp = int((summary.get("engine_info") or {}).get("tensor_parallel_size") or 1)
    try:
        weights = checkpoint_weight_bytes(model_dir)
    except (OSError, ValueError, KeyError):
        weights = None
    from pipeline.engines.gpu_memory import device_memory_bytes

    device_bytes = device_memory_bytes(options)  # nvidia-smi (or engine.device_memory_gib): no CUDA context here
    if device_bytes is None and not capability(lm.name, "starts_server") and _cuda():
        import torch

        device_bytes = torch.cuda.get_device_properties(0).total_memory
    return capacity(figures, levels=fixed["levels"] + fixed["rates"], slo=slo, tensor_parallel_size=tp,
                    model_window=context, checkpoint_weight_bytes=weights, settings=options, device_bytes=device_bytes)


def _quiet_gpu(lm) -> float:
    """A server engine's server up, and no other server of the run still starting: a start's compilation and
    CUDA-graph capture load the GPU the timings are taken on (pipeline/engines/shared.py). Seconds waited."""
    from pipeline.engines import shared

    lm.start()
    return shared.wait_until_started()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _engine_dtype_bytes(lm) -> int:
    model = getattr(lm, "model", None)
    return next(model.parameters()).element_size() if model is not None else 2
