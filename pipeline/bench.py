"""`quantize bench MODEL_DIR [--engine lmdeploy]`: serving speed, beside the accuracy.

A closed-loop concurrency sweep (default 1, 4, 16, 64 requests in flight) over two workloads:
`fixed` (every request has the same prompt and output length: real text from evals/long_context,
cut to length) and `holdout` (the held-out conversations' real prompts, each answered with as many
tokens as its real reply had). Per level: TTFT, TPOT, output tokens/s, requests/s, peak memory.

Beside batch 1 stands its roofline: decoding one token reads every weight once plus the KV cache
so far, so tokens/s can be at most (memory bandwidth) / (bytes per token). The bandwidth is
measured here, on this device, with a large copy.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import UserError
from pipeline.outputs import Stopwatch, write_json

HAYSTACK = Path(__file__).resolve().parent.parent / "evals" / "long_context" / "alice29.txt"


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
    """The held-out prompts (conversations ending with the user's turn, as `quantize calib` writes
    them), each answered with as many tokens as the real reply (`reference`) had, capped at
    max_output; prompts longer than the context are left out."""
    if not holdout.exists():
        raise UserError(f"{holdout}: no held-out conversations; run `quantize calib` first")
    prompts, lengths = [], []
    for number, line in enumerate(holdout.read_text(encoding="utf-8").splitlines()[:max_prompts], start=1):
        record = json.loads(line)
        if not record.get("messages") or not record.get("reference"):
            raise UserError(f"{holdout}:{number}: needs 'messages' and 'reference' (the real reply); "
                            "rebuild it with `quantize calib`")
        prompt = engine.encode(engine.apply_chat_template(record["messages"]))
        length = max(2, min(max_output, len(engine.encode(record["reference"]))))
        if context is None or len(prompt) + length <= context:
            prompts.append(prompt)
            lengths.append(length)
    if not prompts:
        raise UserError(f"{holdout}: no held-out conversation fits the model's {context}-token context; "
                        "set bench.holdout: false")
    return Workload("holdout", prompts, lengths)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def sweep_level(engine, workload: Workload, concurrency: int, requests: int) -> dict:
    prompts, outputs = workload.take(requests)
    started = time.perf_counter()
    timings = engine.timed_generate(prompts, outputs, concurrency)
    wall = time.perf_counter() - started
    good = [t for t in timings if t.error is None]
    if not good:
        raise UserError(f"every request failed at concurrency {concurrency}: {timings[0].error}")
    tpots = [t.tpot for t in good if t.tpot is not None]
    generated = sum(t.n_tokens for t in good)
    return {
        "concurrency": concurrency, "requests": len(timings), "failed": len(timings) - len(good),
        "input_tokens_mean": statistics.fmean(t.input_tokens for t in good),
        "output_tokens_mean": statistics.fmean(t.n_tokens for t in good),
        "ttft_p50_ms": 1000 * _percentile([t.ttft for t in good], 0.5),
        "ttft_p90_ms": 1000 * _percentile([t.ttft for t in good], 0.9),
        "tpot_ms": 1000 * statistics.fmean(tpots) if tpots else None,
        "output_tokens_per_s": generated / wall,
        "requests_per_s": len(good) / wall,
        "wall_s": wall,
        "memory_bytes": engine.device_memory_used(),
    }


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
    return 2 * src.numel() * 4 * repeats / (time.perf_counter() - started)


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    """KV cache bytes one token of context adds: 2 (K and V) x layers x KV heads x head dim."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or config
    layers = text.get("num_hidden_layers") or text.get("num_layers")
    heads = text.get("num_attention_heads")
    kv_heads = text.get("num_key_value_heads") or text.get("multi_query_group_num") or heads
    head_dim = text.get("head_dim") or text.get("kv_channels") or text["hidden_size"] // heads
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def checkpoint_weight_bytes(model_dir: Path) -> int:
    """Tensor bytes of a checkpoint, less its input embedding table (a decode step reads one row)
    unless the config ties it to the output layer."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    tied = (config.get("text_config") or config).get("tie_word_embeddings", False)
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            for name in handle.keys():
                meta = handle.get_slice(name)
                is_embedding = "embed_tokens" in name or "word_embeddings" in name
                if not is_embedding or tied:
                    if meta.get_dtype() not in _DTYPE_BYTES:
                        raise UserError(f"{path}: {name} has dtype {meta.get_dtype()}, which the roofline "
                                        "does not know the size of")
                    total += math.prod(meta.get_shape()) * _DTYPE_BYTES[meta.get_dtype()]
    return total


_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "BOOL": 1}


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
        r = self.summary["roofline"]
        bound = f"; batch 1 at {r['fraction_of_bound']:.0%} of its roofline" if r.get("fraction_of_bound") else ""
        return (f"bench: wrote {self.path} ({self.summary['engine']}, {fixed['name']} workload, output tok/s "
                f"{by_c}{bound}) in {self.seconds:.0f} s")


def versions() -> dict:
    from importlib import metadata

    found = {}
    for name in ("torch", "transformers", "lmdeploy"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def device_name() -> str:
    import platform

    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    import os

    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


def run(model_dir: Path | str, out: Path | str, *, engine: str = "hf", concurrency: list[int] = (1, 4, 16, 64),
        input_len: int = 128, output_len: int = 256, requests_per_level: int = 2, holdout: Path | None = None,
        engine_options: dict | None = None, progress=print) -> BenchResult:
    """requests_per_level: requests per level as a multiple of the concurrency (at least 4 in all)."""
    from pipeline.engines import make_engine

    watch = Stopwatch()
    model_dir, out = Path(model_dir), Path(out)
    if not (model_dir / "config.json").exists():
        raise UserError(f"{model_dir}: no config.json; pass a checkpoint directory (models/base or models/<variant>)")
    from pipeline.long_context import context_length

    context = context_length(model_dir)
    if context is not None and input_len + output_len > context:
        raise UserError(f"--input-len {input_len} + --output-len {output_len} exceed {model_dir}'s "
                        f"{context}-token context; choose shorter lengths")
    options = dict(engine_options or {})
    options["batch_size"] = max(max(concurrency), options.get("batch_size", 1))
    lm = make_engine(engine, model_dir, **options)
    try:
        loads = [fixed_workload(lm.encode, input_len, output_len)]
        if holdout is not None:
            loads.append(holdout_workload(lm, Path(holdout), output_len, context))
        workloads = {}
        for load in loads:
            # warm-up on this workload's own shapes: kernels autotune on the first new size (seen:
            # a 4 s first request of AWQ on lmdeploy with 800-token prompts after a 128-token warm-up)
            lm.timed_generate(*load.take(1), 1)
            levels = []
            for c in concurrency:
                levels.append(sweep_level(lm, load, c, max(4, requests_per_level * c)))
                progress(f"  {load.name} c={c}: {levels[-1]['output_tokens_per_s']:.1f} tok/s, "
                         f"TTFT p50 {levels[-1]['ttft_p50_ms']:.0f} ms")
            workloads[load.name] = {"name": load.name, "prompts": len(load.prompts), "levels": levels}
        device = "cuda" if _cuda() else "cpu"
        kv_bytes = 2 if engine == "lmdeploy" else _engine_dtype_bytes(lm)
        batch1 = next(l for l in workloads["fixed"]["levels"] if l["concurrency"] == min(concurrency))
        summary = {
            "model_dir": str(model_dir), "engine": engine, "device": device_name(), "versions": versions(),
            # how the model is split over devices (engines without tensor parallelism: one device)
            "parallel": getattr(lm, "parallel", None) or {"tensor_parallel_size": 1},
            "date": time.strftime("%Y-%m-%d"), "input_len": input_len, "output_len": output_len,
            "workloads": workloads,
            # tensor parallel: each of the GPUs reads its share of the weights, so the bandwidth adds up
            "roofline": roofline(lm, model_dir, batch1, measure_bandwidth(device, 1.0 if device == "cuda" else 0.25)
                                 * (getattr(lm, "parallel", None) or {}).get("tensor_parallel_size", 1), kv_bytes),
        }
    finally:
        lm.close()
    summary["seconds"] = round(watch.seconds, 2)
    write_json(out, summary)
    return BenchResult(out, summary, watch.seconds)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _engine_dtype_bytes(lm) -> int:
    model = getattr(lm, "model", None)
    return next(model.parameters()).element_size() if model is not None else 2


def speed_row(summary: dict) -> dict:
    """The figures the report's speed table shows, from one bench.json."""
    fixed = summary["workloads"]["fixed"]
    batch1 = fixed["levels"][0]
    return {
        "engine": summary["engine"], "device": summary["device"], "date": summary.get("date"),
        "input_len": summary["input_len"], "output_len": summary["output_len"],
        "batch1_concurrency": batch1["concurrency"],
        "batch1_tokens_per_s": 1000 / batch1["tpot_ms"] if batch1.get("tpot_ms") else None,
        "batch1_ttft_ms": batch1["ttft_p50_ms"],
        "tokens_per_s": {str(l["concurrency"]): l["output_tokens_per_s"] for l in fixed["levels"]},
        "memory_bytes": max((l["memory_bytes"] or 0) for l in fixed["levels"]) or None,
        "roofline_fraction": summary["roofline"].get("fraction_of_bound"),
        "roofline_tokens_per_s": summary["roofline"].get("bound_tokens_per_s"),
    }


def compare_speed(base: dict | None, variant: dict, tolerance: float) -> dict:
    """Batch-1 decode rate of the variant against the base's, when both were measured alike."""
    comparable = base is not None and all(base[k] == variant[k] for k in
                                          ("engine", "device", "input_len", "output_len", "batch1_concurrency"))
    if base is None:
        why = "no base bench"
    elif not comparable:
        why = "base and variant were benched differently (engine, device or lengths)"
    elif not base["batch1_tokens_per_s"] or not variant["batch1_tokens_per_s"]:
        why = "no batch-1 decode rate (a single output token per request leaves no time per output token)"
    else:
        why = None
    if why:
        return {"comparable": False, "reason": why, "ratio": None, "slower": None}
    ratio = variant["batch1_tokens_per_s"] / base["batch1_tokens_per_s"]
    return {"comparable": True, "ratio": ratio, "slower": ratio < 1 - tolerance,
            "reason": f"batch-1 decode {variant['batch1_tokens_per_s']:.1f} vs base {base['batch1_tokens_per_s']:.1f} "
                      f"tokens/s ({ratio:.2f}x) on {variant['engine']}, {variant['device']}"}
