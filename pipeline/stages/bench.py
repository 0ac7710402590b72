"""`quantize bench MODEL_DIR [--engine vllm|lmdeploy|hf|openai]`: serving speed, beside the accuracy.

Two workloads: `fixed` (every request has the same prompt and output length: real text from
the long text a suite declares for the bench, metadata.suite.bench.text: the
long-context book, cut to length) and `holdout` (the held-out conversations' real prompts, each
answered with as many tokens as its real reply had). For a model with a vision tower, on an engine that takes
images, one more per count in `bench.images` (`1-image`, `4-images`): the fixed workload's text with that many of
the visual suites' images (their items in turn, each at the size its suite scored it at, or scaled to
`bench.image_size`) and a question, in the chat format vLLM serves (pipeline/scoring/bench_load.py: image_workload);
each states its image tokens per image (the model's processor's rule; per suite its sizes and tokens), its prompt
and KV tokens per request (the server's own prompt count where it reports one), and the capacity counts how many
requests of each load the KV pool holds. Two kinds of load, as `vllm bench serve` offers:
a closed-loop sweep over max concurrency (default 1, 4, 16, 64 requests in flight) and, for server
engines, a sweep over request rates with Poisson arrivals (on the fixed workload). Per level, as vLLM's bench reports them:
TTFT, TPOT, ITL and end-to-end latency (mean, median, p90, p99), output tokens/s, requests/s,
goodput (requests/s that meet every SLO in `bench.slo`) and device memory.

Server engines (`vllm`: `vllm serve` started and stopped by the stage, its log kept beside the
results; `openai`: a server already running) are timed over HTTP with streamed `/v1/completions`,
token-id prompts (requests with images: streamed `/v1/chat/completions`) and, on vLLM, `ignore_eos` so each
request decodes exactly its output length.
In-process engines (`hf`, `lmdeploy`) time requests with their own clocks (`timed_generate`).

Beside batch 1 stands its roofline: decoding one token reads every weight once plus the KV cache
so far, so tokens/s can be at most (memory bandwidth) / (bytes per token). The bandwidth is
measured on this device with a large copy, before the engine starts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.scoring.bench_load import (  # noqa: F401  (the workloads and levels: the stage's and its callers')
    HttpTiming, Workload, check_image_requests, distribution, fixed_workload, holdout_workload, image_workload,
    kv_tokens, level_metrics, meets_slo, rate_level, sweep_level,
)
from pipeline.checkpoints import checkpoint
from pipeline.checkpoints.sizes import kv_bytes_per_token
from pipeline.engines import EngineSettings, capability
from pipeline.engines.gpu_memory import GIB
from pipeline.errors import UserError
from pipeline.outputs import Stopwatch, write_json
from pipeline.settings import suites as registry
from pipeline.settings.params import BenchParams, sections_with_overrides

log = logging.getLogger(__name__)
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


PROBE_GIB = 1.0  # the bandwidth probe's copy on a GPU (two tensors of it: source and destination)


def _probe_gib(device: str, model_dir: Path) -> float:
    """The probe's size: on a GPU, PROBE_GIB once the run's GPU memory has made room for its two tensors and the CUDA
    context (pipeline/engines/gpu_room.py: idle servers of other models go first, this model's last), else what is
    free (a smaller copy measures the same bandwidth less steadily); 0.25 GiB on a CPU."""
    if device != "cuda":
        return 0.25
    from pipeline.engines import gpu_memory, gpu_room

    need = int((2 * PROBE_GIB + 0.5) * GIB)
    gpu_room.make_room("bench's bandwidth probe", need, last=model_dir)
    free = gpu_memory.device_memory_free_bytes()
    return PROBE_GIB if free is None or free >= need else max(0.0625, (free - GIB // 2) / 2 / GIB)


def roofline(engine, model_dir: Path, batch1: dict, bandwidth: float, kv_dtype_bytes: int) -> dict:
    context = batch1["input_tokens_mean"] + batch1["output_tokens_mean"] / 2
    weights = engine.weight_bytes_per_token()
    per_token = weights + kv_bytes_per_token(checkpoint.open(model_dir).kv_cache_shape, kv_dtype_bytes) * context
    bound = bandwidth / per_token
    achieved = 1000 / batch1["tpot_ms"] if batch1.get("tpot_ms") else None
    return {"bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": weights, "bytes_per_token": per_token,
            "mean_context": context, "bound_tokens_per_s": bound, "achieved_tokens_per_s": achieved,
            "fraction_of_bound": achieved / bound if achieved else None}


@dataclass
class BenchResult:
    path: Path
    figures: dict  # what the stage's JSON summary holds
    seconds: float

    def summary(self) -> str:
        fixed = self.figures["workloads"].get("fixed") or next(iter(self.figures["workloads"].values()))
        by_c = ", ".join(f"c{l['concurrency']} {l['output_tokens_per_s']:.0f}" for l in fixed["levels"])
        r = self.figures.get("roofline") or {}
        bound = f"; batch 1 at {r['fraction_of_bound']:.0%} of its roofline" if r.get("fraction_of_bound") else ""
        images = [w for w in self.figures["workloads"].values() if w.get("images_per_request")]
        with_images = "".join(f"; {w['label']} ({w['image_tokens_per_image']} tokens each): TTFT p50 "
                              f"{w['levels'][0]['ttft_p50_ms']:.0f} ms at c{w['levels'][0]['concurrency']}" for w in images)
        return (f"bench: wrote {self.path} ({self.figures['engine']}, {fixed['name']} workload, output tok/s "
                f"{by_c}{bound}{with_images}) in {self.seconds:.0f} s")


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
        engine_settings: EngineSettings | None = None, *, engine: str | None = None, holdout: Path | None = None,
        suites: dict | None = None, **overrides) -> BenchResult:
    """settings: params.yaml `bench`; engine_settings: params.yaml `engine` (an engine's section, pipeline/engines/);
    `overrides` (e.g. concurrency=[1, 2], input_len=16, batch_size=64) replace the field of that name in
    the bench section, else in the engine section, and are validated again. engine: the engine's name
    (default: bench.engine, else engine.name). holdout: held-out conversations for the real-length
    workload (None: the fixed workload only). suites: params.yaml `suites`, whose declared bench items the
    workloads take (pipeline/settings/suites.py bench_suites; None: the shipped suites'). requests_per_level:
    requests per level as a multiple of the concurrency (at least 4 in all)."""
    from pipeline.engines import STARTS, default_settings, engine_spec, engine_start_seconds, make_engine, settings_for

    starts_before, watch = len(STARTS), Stopwatch()
    b, e = sections_with_overrides(settings or BenchParams, engine_settings or default_settings(engine), **overrides)
    engine = engine or b.engine or e.name
    model_dir, out = Path(model_dir), Path(out)
    spec = engine_spec(engine)
    chosen = settings_for(e, engine)  # a missing setting (openai: engine.model) stops before any work
    context = _checked(model_dir, b, spec, engine)
    images, no_images = _image_counts(model_dir, b, spec, engine)
    configured = registry.configured(suites or {})
    check_image_requests(model_dir, images, b.image_size, b.input_len, b.output_len, context, configured)
    chosen = chosen.model_copy(update={"batch_size": max(max(b.concurrency), chosen.batch_size)})
    options = chosen.model_dump()
    stage = {"log_path": out.with_name(out.stem + ".vllm.log")} if spec.starts_server else {}
    device = "cuda" if _cuda() else "cpu"
    # measured before the engine starts: a server takes most of the GPU's memory for its KV pool
    bandwidth = measure_bandwidth(device, _probe_gib(device, model_dir)) if spec.local_weights else None
    lm = make_engine(engine, model_dir, chosen, **stage)
    try:
        quiet_wait = _quiet_gpu(lm) if spec.starts_server else 0.0
        timer = HttpTiming(lm, vllm_extras=spec.starts_server) if spec.timing == "http" else lm
        workloads = _sweep(timer, b, holdout, context, model_dir, images, configured)
        summary = _summary(lm, model_dir, engine, spec, options, b, workloads, bandwidth)
        if no_images:
            summary["images_not_measured"] = no_images
        summary["capacity"] = engine_capacity(lm, model_dir, summary, workloads, b.slo.model_dump(), context, options)
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
    from pipeline.checkpoints import checkpoint

    headers.check(model_dir, weights=spec.local_weights)  # openai: a running server holds the weights
    if b.request_rates and spec.timing != "http":
        raise UserError(f"bench.request_rates: request-rate sweeps need a server engine "
                        f"({engine_names(where=lambda s: s.timing == 'http')}), "
                        f"not {engine}; set bench.request_rates: [] or --engine vllm")
    context = checkpoint.open(model_dir).max_positions
    if context is not None and b.input_len + b.output_len > context:
        raise UserError(f"--input-len {b.input_len} + --output-len {b.output_len} exceed {model_dir}'s "
                        f"{context}-token context; choose shorter lengths")
    return context


def _image_counts(model_dir: Path, b: BenchParams, spec, engine: str) -> tuple[list[int], str | None]:
    """The image workloads' images per request (bench.images) for a model with a vision tower on an engine that
    takes images, and why there are none when such a model's engine takes no images (None otherwise: a text-only
    model's bench says nothing of images)."""
    from pipeline.engines import engine_names
    from pipeline.engines.vision import is_multimodal

    if not b.images or not is_multimodal(model_dir):
        return [], None
    if not spec.images:
        return [], (f"{engine} takes no images; requests with images are measured on "
                    f"{engine_names(where=lambda s: s.images)} (--engine)")
    return list(b.images), None


def _sweep(timer, b: BenchParams, holdout: Path | None, context: int | None, model_dir: Path | None = None,
           images: list[int] = (), configured=()) -> dict:
    """Each workload (fixed lengths; the held-out prompts' real lengths; the fixed text with `images` images per
    request, one workload per count) at every concurrency, and the fixed one at every request rate."""
    slo = b.slo.model_dump()
    fixed = fixed_workload(timer.encode, b.input_len, b.output_len, configured=configured)
    loads = [fixed]
    if holdout is not None:
        loads.append(holdout_workload(timer, Path(holdout), b.output_len, context))
    loads += [image_workload(timer, model_dir, fixed, count, b.image_size, context, configured) for count in images]
    workloads = {}
    for load in loads:
        # warm-up on this workload's own shapes: kernels autotune on the first new size (seen:
        # a 4 s first request of AWQ on lmdeploy with 800-token prompts after a 128-token warm-up)
        timer.timed_generate(*load.take(1), 1, **load.images_of(1))
        levels, rates = [], []
        for c in b.concurrency:
            levels.append(sweep_level(timer, load, c, max(4, b.requests_per_level * c), slo))
            log.info(f"  {load.name} c={c}: {levels[-1]['output_tokens_per_s']:.1f} tok/s, "
                     f"TTFT p50 {levels[-1]['ttft_p50_ms']:.0f} ms")
        for rate in b.request_rates if load.name == "fixed" else ():  # open loop on the fixed lengths only
            rates.append(rate_level(timer, load, rate, max(8, round(rate * b.rate_seconds)), slo))
            log.info(f"  {load.name} {rate:g} req/s: {rates[-1]['output_tokens_per_s']:.1f} tok/s, "
                     f"TTFT p50 {rates[-1]['ttft_p50_ms']:.0f} ms")
        workloads[load.name] = {"name": load.name, "prompts": len(load.prompts), **load.facts, "levels": levels,
                                "rates": rates}
        if images:  # a model measured with images: what each load's request holds in the KV cache, text-only too
            tokens, counted_by_server = kv_tokens(workloads[load.name])
            workloads[load.name]["kv_tokens_per_request"] = tokens
            workloads[load.name]["kv_tokens_source"] = "prompt + output, the prompt " + (
                "as the server counted it (usage.prompt_tokens)" if counted_by_server else
                "as counted here (image tokens: the model's image processor)" if load.images else "as sent")
    if images:
        workloads["fixed"]["label"] = "text only"
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


def engine_capacity(lm, model_dir: Path, summary: dict, workloads: dict, slo: dict, context: int | None,
                    options: dict) -> dict:
    """What the variant buys (pipeline/engines/capacity.py): KV-cache tokens at the configured memory
    fraction, the longest context one request can have, weight memory (from the engine's own start-up
    figures where it reports them: vLLM), and output tokens/s per GPU of the requests that met bench.slo; measured
    with images, per load (text only, 1 image, ...) the requests the KV pool holds and their goodput."""
    from pipeline.checkpoints.sizes import checkpoint_weight_bytes
    from pipeline.engines.capacity import capacity

    figures = lm.capacity() if hasattr(lm, "capacity") else {}
    tp = int((summary.get("engine_info") or {}).get("tensor_parallel_size") or 1)
    try:
        weights = checkpoint_weight_bytes(model_dir)
    except (OSError, ValueError, KeyError):
        weights = None
    from pipeline.engines.gpu_memory import device_memory_bytes

    device_bytes = device_memory_bytes(options.get("device_memory_gib"))  # nvidia-smi (or engine.device_memory_gib): no CUDA context here
    if device_bytes is None and not capability(lm.name, "starts_server") and _cuda():
        import torch

        device_bytes = torch.cuda.get_device_properties(0).total_memory
    fixed = workloads["fixed"]
    loads = {name: w for name, w in workloads.items() if "label" in w}  # measured with images: the loads by name
    plan = lm.server_plan() if hasattr(lm, "server_plan") else None
    if plan:  # a fitted server: its own share of the GPU, not the run's (engine.kv_cache_memory: fitted)
        options = {**options, "gpu_memory_utilization": plan["server"]["gpu_memory_utilization"]}
    found = capacity(figures, levels=fixed["levels"] + fixed["rates"], slo=slo, tensor_parallel_size=tp,
                     model_window=context, checkpoint_weight_bytes=weights, settings=options, device_bytes=device_bytes,
                     loads=loads)
    return {**found, "plan": plan} if plan else found


def _quiet_gpu(lm) -> float:
    """A server engine's server up, no other server of the run still starting (a start's compilation and CUDA-graph
    capture load the GPU the timings are taken on: pipeline/engines/shared.py), no job of the run scoring ahead of
    its stage (pipeline/scoring/ahead.py). Seconds waited."""
    from pipeline.scoring import ahead
    from pipeline.engines import shared

    lm.start()
    return shared.wait_until_started() + ahead.wait_quiet()  # and no evaluation or judging working ahead


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _engine_dtype_bytes(lm) -> int:
    model = getattr(lm, "model", None)
    return next(model.parameters()).element_size() if model is not None else 2
