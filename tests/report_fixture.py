"""A results/ and models/ tree shaped like the demo's (four perplexity suites that decide, two right/wrong
suites at the floor run by the base and AWQ only, VQA not applicable, a judge that judged nothing, KL,
quant.json with sizes and serving in each of its three states, a bench.json with capacity for two models),
with hostile text in it: what the report's first-screen tests render."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

XSS = '<script>alert(1)</script><img src=x onerror=alert(2)>'
PERPLEXITY = {"ppl-book": 8, "ppl-chat": 12, "ppl-code": 8, "ppl-math": 10}
RISES = {"fp8-w8a8": 0.03, "awq-w4a16": 0.16, "rtn-w4a16": 0.27}



def _perplexity(lines: list[dict]) -> float:
    """A perplexity suite's summary score, as the evaluate stage computes it from the lines (the report checks it)."""
    return math.exp(-sum(line["loglikelihood"] for line in lines) / sum(line["n_tokens"] for line in lines))

def _write_lines(path: Path, lines: list[dict], summary: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    path.with_suffix(".json").write_text(json.dumps(summary))


def judge_line(i: int, outcome: str, consistent: bool | None = True, length_diff: int = 0, control: str | None = None) -> dict:
    """One pair of judge.jsonl as `quantize judge` writes it (the fields the figures use)."""
    line = {"id": f"p{i}", "prompt": f"prompt {i}", "base_answer": "b", "variant_answer": "v", "judgments": [],
            "outcome": outcome, "consistent": None if outcome == "unjudged" else consistent,
            "unjudged_reason": "unparsable verdict" if outcome == "unjudged" else None, "length_diff": length_diff}
    if control:
        line["control"] = {"judgments": [], "outcome": control, "consistent": None if control == "unjudged" else True,
                           "unjudged_reason": None}
    return line


def write_judge(folder: Path, lines: list[dict], **overrides) -> dict:
    """judge.jsonl of these lines and the judge.json `quantize judge` writes beside them (its figures from the lines,
    pipeline/verdict/judge.py), with `overrides` on top; returns the summary."""
    from pipeline.verdict.judge import pairwise_figures

    figures = pairwise_figures(lines, any("control" in line for line in lines), confidence=0.95)
    summary = {"mode": "pairwise", "judge": "tiny judge", "weak_judge": False, "confidence": 0.95, **figures, **overrides}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "judge.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (folder / "judge.json").write_text(json.dumps(summary, indent=2))
    return summary


def write_kl(folder: Path, kl_mean: float, top1: float, sequences: int = 4, tokens: int = 64, seed: int = 0) -> dict:
    """kl.jsonl of `sequences` sequences of per-token KL near `kl_mean` (exponential, as KL's long tail) with top-1
    agreement near `top1`, and kl.json's figures from them (pipeline/verdict/drift.py); returns the summary."""
    from pipeline.formats.kl_lines import write_kl_lines
    from pipeline.verdict.drift import kl_figures

    rng = np.random.default_rng(seed)
    per_sequence = [(list(rng.exponential(kl_mean, size=tokens).astype(np.float32).tolist()),
                     int(round(top1 * tokens))) for _ in range(sequences)]
    folder.mkdir(parents=True, exist_ok=True)
    write_kl_lines(folder / "kl.jsonl", per_sequence)
    from pipeline.formats.kl_lines import read_kl_lines

    summary = kl_figures(read_kl_lines(folder / "kl.jsonl"))
    (folder / "kl.json").write_text(json.dumps(summary, indent=2))
    return summary


def demo_like(root: Path, *, capacity: bool = True) -> tuple[Path, Path, dict]:
    """Writes root/results and root/models; returns (results, models, params dict)."""
    from test_bench import bench_summary

    rng = np.random.default_rng(5)
    results, models = root / "results", root / "models"
    for suite, n in PERPLEXITY.items():
        tokens = rng.integers(150, 600, size=n)
        base_nll = tokens * rng.uniform(2.0, 3.0, size=n)
        for model in ["base", *RISES]:
            rise = RISES.get(model, 0.0)
            spread = 0.08 if suite == "ppl-chat" and model == "awq-w4a16" else 0.01
            nll = base_nll if model == "base" else base_nll + tokens * (
                math.log1p(rise) + rng.normal(0, spread, size=n))
            lines = [{"id": f"{suite}-{i}", "suite": suite, "variant": model, "prompt": f"document {i} {XSS}",
                      "target": "", "output": "", "score": float(math.exp(l / t)), "correct": None,
                      "loglikelihood": -float(l), "n_tokens": int(t), "seconds": None}
                     for i, (l, t) in enumerate(zip(nll, tokens))]
            _write_lines(results / model / f"{suite}.jsonl", lines,
                         {"suite": suite, "n": n, "score": _perplexity(lines), "seconds": 14.0, "generate_seconds": 6.0})
    for suite, n, model_scores in (("math", 20, {"base": 1, "awq-w4a16": 0}), ("code", 10, {"base": 0, "awq-w4a16": 0})):
        for model, right in model_scores.items():
            target = (lambda i: f"    if x:\n        return {i}\n") if suite == "code" else str  # code keeps its indent
            lines = [{"id": f"{suite}-{i}", "suite": suite, "variant": model, "prompt": f"question {i} {XSS}",
                      "target": target(i), "output": f"Answer: {i if i < right else -1} {XSS}", "score": float(i < right),
                      "correct": i < right, "n_tokens": 30, "seconds": 1.5} for i in range(n)]
            _write_lines(results / model / f"{suite}.jsonl", lines,
                         {"suite": suite, "n": n, "score": right / n, "seconds": 40.0, "generate_seconds": 30.0})
    for model in ("base", *RISES):  # VQA on a text-only model: a summary that says so, and no result lines
        (results / model / "vqa.json").write_text(json.dumps(
            {"suite": "vqa", "status": "not applicable", "n": 0, "score": None,
             "reason": f"LlamaForCausalLM has no vision tower {XSS}"}))
    for model in ("awq-w4a16", "fp8-w8a8"):
        write_judge(results / model, [judge_line(0, "unjudged")], judge=f"models/base {XSS}", weak_judge=True, seconds=60.0)
    sizes = {"awq-w4a16": 112_000_000, "fp8-w8a8": 170_000_000, "rtn-w4a16": 112_000_000}
    # served by: shown (the run), refused (the engine's error), not tried (the command), as engines/support.py says
    shown = {"serves": True, "status": "shown", "version": "0.24.0", "date": "2026-11-30",
             "evidence": "benchmarks/results/gpu_vllm_bench.json", "how": "shown on the GPU machine (vllm 0.24.0, 2026-11-30)"}
    refused = {"serves": False, "status": "cannot", "how": f"lmdeploy 0.18 cannot serve FP8 W8A8: {XSS}; serve it with vLLM"}
    untried = {"serves": False, "status": "not shown",
               "how": "not shown: no lmdeploy run of LlamaForCausalLM with w4a16, KV none was recorded; try: "
                      "quantize export DIR --engine lmdeploy, then lmdeploy serve api_server EXPORT --backend pytorch"}
    servings = {"awq-w4a16": {"vllm": shown, "lmdeploy": untried}, "fp8-w8a8": {"vllm": shown, "lmdeploy": refused},
                "rtn-w4a16": {"vllm": shown, "lmdeploy": untried}}
    for i, (model, size) in enumerate(sizes.items()):
        write_kl(results / model, kl_mean=0.05 * (i + 1), top1=0.86 - 0.1 * i, sequences=8, tokens=256, seed=i)
        method = model.split("-")[0]
        (models / model).mkdir(parents=True, exist_ok=True)
        (models / model / "quant.json").write_text(json.dumps({
            "method": method, "scheme": {"awq": "W4A16 asymmetric, group 64", "fp8": "FP8 W8A8 (static activations), KV cache FP8 per-head",
                       "rtn": "W4A16 asymmetric, group 64, round-to-nearest"}[method],
            "group_size": 64 if method != "fp8" else None, "size_bytes": size, "base_size_bytes": 260_000_000,
            "quantized_modules": 210, "calibration": {"blocks": 16, "seq_len": 256, "sha256": "0" * 64},
            "seconds": {"total": 100}, "device": "cpu", "peak_rss_bytes": 1 << 30, "ignored": {},
            "verify": {"reloads": True, "sample": "", "vision": {"vision_tensors": 0, "mismatched": []}},
            "serving": {"hf": {"serves": True, "status": "in-process", "how": "in-process transformers"},
                        **servings[model]}}))
    for model, tpot in (("base", 6.3), ("fp8-w8a8", 4.1)):
        summary = bench_summary(tpot, "vllm")
        if capacity:
            summary["capacity"] = {"kv_cache_tokens": 500_000 if model == "base" else 900_000, "max_context_batch1": 131072,
                                   "weight_bytes": 17 << 30, "goodput_tok_s_per_gpu": 5000.0 if model == "base" else 7000.0,
                                   "slo": {"ttft_ms": 200, "tpot_ms": 15}}
        (results / model / "bench.json").write_text(json.dumps(summary))
    params = {
        "model": {"source": "tiny-hf", "base_dir": "models/base", "dtype": "float16"},
        "variants": {"awq-w4a16": {"method": "awq", "group_size": 64}, "fp8-w8a8": {"method": "fp8"},
                     "rtn-w4a16": {"method": "rtn", "group_size": 64}},
        "suites": {"math": {"task": "quant_gsm8k", "models": ["base", "awq-w4a16"]},
                   "code": {"task": "quant_humaneval", "models": ["base", "awq-w4a16"]},
                   "ppl-book": {"task": "quant_ppl_book"}, "ppl-chat": {"task": "quant_ppl_chat"},
                   "ppl-code": {"task": "quant_ppl_humaneval"}, "ppl-math": {"task": "quant_ppl_gsm8k"},
                   "vqa": {"task": "quant_vqa"}},
        "verdict": {"margins": {"perplexity": 0.10, "suites": {"math": 0.03, "code": 0.03}}},
    }
    params["suites"]["ppl-chat"]["options"] = {"data": "calib_data/build/holdout.jsonl"}
    return results, models, params


# ---------------------------------------------------------------- a vision-language model's run

VLM_IMAGE_TOKENS = {1: 1369, 4: 1369}  # a 1024 x 1024 image at GLM-4.1V's 14-pixel patches, 2 x 2 merged: 37 x 37


def vlm_bench_summary(tpot: float, kv_pool: int) -> dict:
    """bench.json of a vision-language model as `quantize bench` writes it on vLLM: the text-only load and the
    same requests with 1 and 4 images (each image's tokens by the model's processor, KV tokens per request as the
    server counted the prompt), and the capacity per load."""
    from test_bench import bench_summary

    summary = bench_summary(tpot, "vllm")
    fixed = summary["workloads"]["fixed"]
    fixed.update(name="fixed", label="text only", kv_tokens_per_request=384,
                 kv_tokens_source="prompt + output, the prompt as the server counted it (usage.prompt_tokens)")
    by_load = {"fixed": {"label": "text only", "kv_tokens_per_request": 384, "requests_in_kv_pool": kv_pool // 384,
                         "goodput_tok_s_per_gpu": 60000.0 / tpot}}
    for count in (1, 4):
        name, label = f"{count}-image{'s' if count > 1 else ''}", f"{count} image{'s' if count > 1 else ''}"
        prompt = 170 + count * VLM_IMAGE_TOKENS[count]
        levels = []
        for level in fixed["levels"]:
            slower = 1 + 0.2 * count
            levels.append({**level, "ttft_p50_ms": level["ttft_p50_ms"] * (1 + 3 * count),
                           "ttft_ms": {k: v * (1 + 3 * count) for k, v in level["ttft_ms"].items()},
                           "tpot_ms": level["tpot_ms"] * slower, "output_tokens_per_s": level["output_tokens_per_s"] / slower,
                           "input_tokens_mean": prompt, "server_prompt_tokens_mean": prompt})
        summary["workloads"][name] = {
            "name": name, "prompts": 64, "label": label, "images_per_request": count, "image_size": [1024, 1024],
            "image_tokens_per_image": VLM_IMAGE_TOKENS[count],
            "image_tokens_rule": "the model's image processor: grid t*h*w / merge^2 per image", "text_tokens_mean": 170,
            "prompt_tokens_mean": prompt, "kv_tokens_per_request": prompt + 256,
            "kv_tokens_source": "prompt + output, the prompt as the server counted it (usage.prompt_tokens)",
            "levels": levels, "rates": []}
        by_load[name] = {"label": label, "kv_tokens_per_request": prompt + 256,
                         "requests_in_kv_pool": kv_pool // (prompt + 256),
                         "goodput_tok_s_per_gpu": 60000.0 / tpot / (1 + count)}
    summary["capacity"] = {"kv_cache_tokens": kv_pool, "max_context_batch1": 65536, "weight_bytes": 40 << 30,
                           "kv_cache_bytes": 60 << 30, "goodput_tok_s_per_gpu": by_load["fixed"]["goodput_tok_s_per_gpu"],
                           "slo": {"ttft_ms": 2000, "tpot_ms": 15}, "by_load": by_load}
    return summary


def vlm_like(root: Path) -> tuple[Path, Path, dict]:
    """A GLM-4.6V-like run: VQA (100 right/wrong items, about two thirds right for the base) and held-out perplexity for the base, an FP8
    and an AWQ variant, each variant's quant.json with its vision tower's check (FP8's kept bit-identical in bf16;
    AWQ's with two tensors changed, as a checkpoint from elsewhere could hold), and bench.json with images for the
    base and FP8. Returns (results, models, params dict)."""
    rng = np.random.default_rng(7)
    results, models = root / "results", root / "models"
    right = rng.random(100) < 0.62
    lost = {"fp8-w8a8": set(), "awq-w4a16": set(np.flatnonzero(right)[:12].tolist())}
    for model in ("base", *lost):
        lines = [{"id": f"easyvqa-{i}", "suite": "vqa", "variant": model, "prompt": f"<image>\nwhat shape? {XSS}",
                  "target": "circle", "output": "circle" if r and i not in lost.get(model, ()) else "square",
                  "score": float(r and i not in lost.get(model, ())), "correct": bool(r and i not in lost.get(model, ())),
                  "n_tokens": 2, "seconds": 0.2} for i, r in enumerate(right)]
        _write_lines(results / model / "vqa.jsonl", lines, {"suite": "vqa", "n": 100, "score": sum(l["score"] for l in lines) / 100})
    tokens = rng.integers(150, 600, size=12)
    base_nll = tokens * rng.uniform(2.0, 3.0, size=12)
    for model, rise in (("base", 0.0), ("fp8-w8a8", 0.01), ("awq-w4a16", 0.05)):
        nll = base_nll + tokens * (math.log1p(rise) + (rng.normal(0, 0.005, size=12) if rise else 0))
        lines = [{"id": f"ppl-chat-{i}", "suite": "ppl-chat", "variant": model, "prompt": f"conversation {i}", "target": "",
                  "output": "", "score": float(math.exp(l / t)), "correct": None, "loglikelihood": -float(l),
                  "n_tokens": int(t), "seconds": None} for i, (l, t) in enumerate(zip(nll, tokens))]
        _write_lines(results / model / "ppl-chat.jsonl", lines, {"suite": "ppl-chat", "n": 12, "score": _perplexity(lines)})
    vision = {"fp8-w8a8": {"vision_tensors": 182, "mismatched": [], "dtypes": ["BF16"]},
              "awq-w4a16": {"vision_tensors": 182, "mismatched": ["model.visual.blocks.0.attn.qkv.weight",
                                                                   f"model.visual.merger.proj.weight {XSS}"],
                            "dtypes": ["BF16"]}}
    for model, scheme in (("fp8-w8a8", "FP8 W8A8 (dynamic activations)"), ("awq-w4a16", "W4A16 asymmetric, group 128")):
        (models / model).mkdir(parents=True, exist_ok=True)
        (models / model / "quant.json").write_text(json.dumps({
            "method": model.split("-")[0], "scheme": scheme, "size_bytes": 60 << 30, "base_size_bytes": 200 << 30,
            "quantized_modules": 9000, "calibration": {"blocks": 64, "seq_len": 2048, "sha256": "0" * 64},
            "seconds": {"total": 3600}, "device": "cuda", "ignored": {"re:.*visual.*": "vision tower: kept in full precision by design"},
            "verify": {"reloads": True, "sample": "", "vision": vision[model]}}))
    for model, tpot, pool in (("base", 12.0, 900_000), ("fp8-w8a8", 9.0, 1_600_000)):
        (results / model / "bench.json").write_text(json.dumps(vlm_bench_summary(tpot, pool)))
    params = {
        "model": {"source": "tiny-hf", "base_dir": "models/base", "dtype": "bfloat16"},
        "variants": {"fp8-w8a8": {"method": "fp8"}, "awq-w4a16": {"method": "awq", "group_size": 128}},
        "suites": {"vqa": {"task": "quant_vqa"}, "ppl-chat": {"task": "quant_ppl_chat"}},
        "verdict": {"margins": {"perplexity": 0.10, "suites": {"vqa": 0.06}}},
    }
    return results, models, params
