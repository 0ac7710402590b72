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
                         {"suite": suite, "n": n, "score": 1.0, "seconds": 14.0, "generate_seconds": 6.0})
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
