"""What a variant buys in capacity, as the serving engine itself reports it at start.

vLLM logs, while starting (the format strings of vLLM 0.24's worker and KV-cache code; earlier and later
releases word the first one slightly differently, both are read):

    Model loading took 17.56 GiB memory and 9.14 seconds         (gpu_model_runner: weights per GPU)
    Model loading took 17.5600 GiB and 9.140000 seconds          (older wording)
    Available KV cache memory: 98.12 GiB                         (gpu_worker: the KV pool per GPU)
    GPU KV cache size: 2,512,384 tokens                          (kv_cache_utils: tokens the pool holds)
    Maximum concurrency for 4,096 tokens per request: 613.38x

(newer releases print the last two on one line; each is matched anywhere in a line, after vLLM's
prefix). Under tensor parallelism the first two appear once per GPU; the token count is the engine's.
`capacity()` turns them into the figures `quantize bench` writes as `capacity` in bench.json; for a model benched
with images, per load (text only, 1 image, 4 images) the requests of that load the KV pool holds at once: its
tokens over the KV tokens one request takes (prompt, image tokens included, + output), as vLLM's own "Maximum
concurrency for N tokens per request" divides them.
"""

from __future__ import annotations

import re
from pathlib import Path

GIB = 1 << 30
# a number as vLLM prints one (a line that holds anything else, "1.2.3" or 5,000 digits, matches nothing)
DECIMAL = r"([0-9]{1,15}(?:\.[0-9]{1,15})?)"
COUNT = r"([0-9]{1,3}(?:,[0-9]{3}){1,5}|[0-9]{1,18})"
WEIGHTS = re.compile(rf"Model loading took {DECIMAL} GiB(?: memory)? and {DECIMAL} s(?:econds)?")
KV_MEMORY = re.compile(rf"Available KV cache memory: {DECIMAL} GiB")
KV_TOKENS = re.compile(rf"GPU KV cache size: {COUNT} tokens")
CONCURRENCY = re.compile(rf"Maximum concurrency for {COUNT} tokens per request: {DECIMAL}x")
MAX_LOG_BYTES = 64 << 20  # a server log is read from its start; the start-up lines come first


def parse_vllm_log(text: str) -> dict:
    """The start-up figures of the last server start in `text` (a log may hold several starts)."""
    start = max(text.rfind("\n$ "), 0)  # pipeline/engines/server.py and shared.py write "$ COMMAND" per start
    text = text[start:]
    found: dict = {}
    weights = [float(m.group(1)) for m in WEIGHTS.finditer(text)]
    if weights:
        found["weight_bytes"] = int(max(weights) * GIB)  # per GPU (one line per rank)
        found["weight_load_seconds"] = max(float(m.group(2)) for m in WEIGHTS.finditer(text))
    memory = [float(m.group(1)) for m in KV_MEMORY.finditer(text)]
    if memory:
        found["kv_cache_bytes"] = int(min(memory) * GIB)  # per GPU
    tokens = [int(m.group(1).replace(",", "")) for m in KV_TOKENS.finditer(text)]
    if tokens:
        found["kv_cache_tokens"] = min(tokens)
    concurrency = list(CONCURRENCY.finditer(text))
    if concurrency:
        found["max_model_len"] = int(concurrency[-1].group(1).replace(",", ""))
        found["max_concurrency_at_max_model_len"] = float(concurrency[-1].group(2))
    return found


def planned_kv_figures(command: list[str]) -> dict:
    """A server started with a planned KV pool (`--kv-cache-memory-bytes`, engine.kv_cache_memory: planned)
    logs no "Available KV cache memory": the pool is the size its command line gave."""
    if "--kv-cache-memory-bytes" not in command:
        return {}
    at = command.index("--kv-cache-memory-bytes") + 1
    try:
        return {"kv_cache_bytes": int(command[at]), "kv_cache_bytes_source": "planned"}
    except (IndexError, ValueError):
        return {}


def from_vllm_log(path: Path | str) -> dict:
    try:
        with open(path, "rb") as handle:
            text = handle.read(MAX_LOG_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return {}
    return parse_vllm_log(text)


def goodput_tokens_per_s(levels: list[dict]) -> float | None:
    """Output tokens/s of the requests that met every SLO, at the best level (a concurrency or a request
    rate): goodput in requests/s x output tokens per request. None without an SLO."""
    best = None
    for level in levels:
        if level.get("goodput_requests_per_s") is None:
            continue
        value = level["goodput_requests_per_s"] * (level.get("output_tokens_mean") or 0.0)
        best = value if best is None else max(best, value)
    return best


def tokens_at_fraction(engine_figures: dict, fraction: float, configured: float | None,
                       device_bytes: int | None) -> int | None:
    """KV-cache tokens the same server would hold at another memory fraction, from its own figures: bytes per
    token = KV pool / tokens, and everything that is not the pool (weights, activations, CUDA graphs) stays.
    For a server that shares the GPU with others (the GPU profile's 0.22), what it would hold alone at 0.9."""
    pool, tokens = engine_figures.get("kv_cache_bytes"), engine_figures.get("kv_cache_tokens")
    if not (pool and tokens and configured and device_bytes):
        return None
    not_pool = configured * device_bytes - pool
    return max(0, round((fraction * device_bytes - not_pool) * tokens / pool))


def requests_in_pool(kv_cache_tokens: int | None, kv_tokens_per_request: float | None) -> int | None:
    """Requests of kv_tokens_per_request tokens each that a pool of kv_cache_tokens holds at once; None when either
    is unknown."""
    if not kv_cache_tokens or not kv_tokens_per_request:
        return None
    return int(kv_cache_tokens // kv_tokens_per_request)


def by_load(loads: dict[str, dict], kv_cache_tokens: int | None, tensor_parallel_size: int) -> dict:
    """Per load of a bench with images ({name: its bench.json workload, with `label` and `kv_tokens_per_request`}):
    what one request holds in the KV cache, how many the pool holds at once, and the load's goodput per GPU."""
    found = {}
    for name, load in loads.items():
        goodput = goodput_tokens_per_s(load["levels"] + (load.get("rates") or []))
        found[name] = {"label": load["label"], "kv_tokens_per_request": load.get("kv_tokens_per_request"),
                       "requests_in_kv_pool": requests_in_pool(kv_cache_tokens, load.get("kv_tokens_per_request")),
                       "goodput_tok_s_per_gpu": goodput / max(1, tensor_parallel_size) if goodput is not None else None}
    return found


def capacity(engine_figures: dict, *, levels: list[dict], slo: dict | None, tensor_parallel_size: int,
             model_window: int | None, checkpoint_weight_bytes: int | None, settings: dict | None = None,
             device_bytes: int | None = None, alone_fraction: float = 0.9, loads: dict[str, dict] | None = None) -> dict:
    """The `capacity` object of bench.json: KV-cache tokens at the configured memory fraction, the longest
    context one request can have (the KV pool and the model's window, whichever is smaller), weight memory
    and goodput per GPU at the SLO; with `loads` (a bench with images), the same per load (`by_load`). Figures the
    engine did not report are None, and `source` says where each came from."""
    tokens = engine_figures.get("kv_cache_tokens")
    fits = [n for n in (tokens, model_window) if n]
    goodput = goodput_tokens_per_s(levels)
    weight = engine_figures.get("weight_bytes")
    settings = settings or {}
    return {
        "kv_cache_tokens": tokens,
        "max_context_batch1": min(fits) if tokens and fits else None,
        "weight_bytes": weight if weight is not None else checkpoint_weight_bytes,
        "goodput_tok_s_per_gpu": goodput / max(1, tensor_parallel_size) if goodput is not None else None,
        "slo": {k: v for k, v in (slo or {}).items() if v is not None} or None,
        "kv_cache_bytes": engine_figures.get("kv_cache_bytes"),
        "max_model_len": engine_figures.get("max_model_len") or settings.get("max_model_len"),
        "model_window": model_window,
        "gpu_memory_utilization": settings.get("gpu_memory_utilization"),
        "tensor_parallel_size": tensor_parallel_size,
        "device_bytes": device_bytes,
        # derived, not measured: the same server's figures scaled to the GPU alone (tokens_at_fraction)
        "kv_cache_tokens_alone": {"gpu_memory_utilization": alone_fraction, "tokens": tokens_at_fraction(
            engine_figures, alone_fraction, settings.get("gpu_memory_utilization"), device_bytes)},
        **({"by_load": by_load(loads, tokens, tensor_parallel_size)} if loads else {}),
        "source": {"kv_cache_tokens": "engine log" if tokens else None,
                   # planned: the pool engine.kv_cache_memory: planned gave the server (vllm.planned_kv_cache_bytes)
                   "kv_cache_bytes": engine_figures.get("kv_cache_bytes_source") or (
                       "engine log" if engine_figures.get("kv_cache_bytes") else None),
                   "weight_bytes": "engine log" if weight is not None else
                   ("checkpoint size" if checkpoint_weight_bytes else None)},
    }
