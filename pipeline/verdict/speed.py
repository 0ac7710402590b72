"""Serving speed in the verdict: the figures of one bench.json the report uses (`speed_row`), the variant's
batch-1 decode rate against the base's (`compare_speed`; it counts, as NO-GO, only when
verdict.nogo_if_slower_at_batch1 is set and it was measured on verdict.speed_engine: `speed_verdict`), and
one line per variant beside its decision, e.g. "GO, 1.5× tokens/s, 2.0× KV capacity" (`capacity_line`, from
bench.json's `capacity`, pipeline/engines/capacity.py). A model benched with images (a vision-language model) has
its loads too (`load_rows`: text only, 1 image, 4 images, each with its image and KV tokens per request and the
requests the KV pool holds), and every figure names the load it is from ("text only, c=1"); a text-only model's
figures stay unlabelled.
"""

from __future__ import annotations

import math

from pipeline.verdict import figures

def compare_speed(base: dict | None, variant: dict, tolerance: float, deploy_engine: str | None = None) -> dict:
    """Batch-1 decode rate of the variant against the base's, when both were measured alike, and
    whether that was on the engine the variant will be deployed on (only then can it count)."""
    same = ("engine", "device", "input_len", "output_len", "batch1_concurrency", "tensor_parallel_size")
    comparable = base is not None and all(base.get(k) == variant.get(k) for k in same)
    if base is None:
        why = "no base bench"
    elif not comparable:
        why = "base and variant were benched differently (engine, device, lengths or parallel layout)"
    elif not base["batch1_tokens_per_s"] or not variant["batch1_tokens_per_s"]:
        why = "no batch-1 decode rate (a single output token per request leaves no time per output token)"
    else:
        why = None
    if why:
        return {"comparable": False, "reason": why, "ratio": None, "slower": None, "deployment_engine": None}
    ratio = variant["batch1_tokens_per_s"] / base["batch1_tokens_per_s"]
    on_deploy = deploy_engine is not None and variant["engine"] == deploy_engine
    load = f" ({variant['batch1_load']})" if variant.get("batch1_load") else ""  # a bench with images: which load
    reason = (f"batch-1 decode{load} {figures.rate(variant['batch1_tokens_per_s'])} vs base "
              f"{figures.rate(base['batch1_tokens_per_s'])} tokens/s ({figures.ratio(ratio)}) on {variant['engine']}, "
              f"{variant['device']}")
    if deploy_engine is not None and not on_deploy:
        reason += (f"; measured on {variant['engine']}, but the variants are deployed on {deploy_engine} "
                   f"(verdict.speed_engine): engines invert which variant is faster, so it is shown, not counted")
    return {"comparable": True, "ratio": ratio, "slower": ratio < 1 - tolerance, "reason": reason,
            "deployment_engine": on_deploy}


def speed_verdict(speeds: dict, variant: str, p) -> dict | None:
    """The variant's batch-1 speed against the base's; counted (as NO-GO) only when
    verdict.nogo_if_slower_at_batch1 is set, it is slower by more than verdict.speed_tolerance, and
    it was measured on verdict.speed_engine, the engine the variant will be deployed on."""

    if variant not in speeds:
        return None
    comparison = compare_speed(speeds.get("base"), speeds[variant], p.speed_tolerance, p.speed_engine)
    comparison["counted"] = bool(p.nogo_if_slower_at_batch1 and comparison["slower"]
                                 and comparison.get("deployment_engine"))
    return comparison


def _decode_rate(level: dict) -> float | None:
    return 1000 / level["tpot_ms"] if level.get("tpot_ms") else None


def load_rows(summary: dict) -> list[dict] | None:
    """A bench with images (bench.json's workloads with a `label`: text only, then each image count): per load its
    images and their tokens, prompt and KV tokens per request, the requests the KV pool holds at once and goodput
    (capacity.by_load), batch-1 decode and TTFT, output tokens/s and TTFT p50 per concurrency. None without images."""
    labelled = [w for w in summary["workloads"].values() if isinstance(w, dict) and w.get("label") and w.get("levels")]
    if not any(w.get("images_per_request") for w in labelled):
        return None
    by_load = (summary.get("capacity") or {}).get("by_load") or {}
    rows = []
    for w in sorted(labelled, key=lambda w: w.get("images_per_request") or 0):
        first, cap = w["levels"][0], by_load.get(w.get("name")) or {}
        rows.append({
            "name": w.get("name"), "label": w["label"], "images_per_request": w.get("images_per_request") or 0,
            "image_size": w.get("image_size"), "image_tokens_per_image": w.get("image_tokens_per_image"),
            # the text-only load's prompt: as the server counted it, else as sent
            "prompt_tokens_mean": w.get("prompt_tokens_mean") or first.get("server_prompt_tokens_mean") or first.get(
                "input_tokens_mean"), "kv_tokens_per_request": w.get("kv_tokens_per_request"),
            "kv_tokens_source": w.get("kv_tokens_source"),
            "batch1_concurrency": first["concurrency"], "batch1_tokens_per_s": _decode_rate(first),
            "batch1_ttft_ms": first["ttft_p50_ms"],
            "tokens_per_s": {str(l["concurrency"]): l["output_tokens_per_s"] for l in w["levels"]},
            "ttft_p50_ms": {str(l["concurrency"]): l["ttft_p50_ms"] for l in w["levels"]},
            "requests_in_kv_pool": cap.get("requests_in_kv_pool"), "goodput_tok_s_per_gpu": cap.get("goodput_tok_s_per_gpu"),
        })
    return rows


def speed_row(summary: dict) -> dict:
    """The figures the report's speed table and charts show, from one bench.json; a bench with images adds its
    loads (`load_rows`) and the load the batch-1 figures are from (`batch1_load`, "text only, c=1")."""
    fixed = summary["workloads"]["fixed"]
    batch1 = fixed["levels"][0]
    info = summary.get("engine_info") or {"engine": summary["engine"]}
    roof = summary.get("roofline") or {}
    loads = load_rows(summary)
    return {
        "engine": summary["engine"], "engine_version": info.get("version"), "engine_settings": info.get("settings"),
        "tensor_parallel_size": int(info.get("tensor_parallel_size") or 1), "kv_cache_dtype": info.get("kv_cache_dtype"),
        "device": summary["device"], "date": summary.get("date"),
        "input_len": summary["input_len"], "output_len": summary["output_len"],
        "batch1_concurrency": batch1["concurrency"],
        "batch1_tokens_per_s": _decode_rate(batch1),
        "batch1_ttft_ms": batch1["ttft_p50_ms"],
        "tokens_per_s": {str(l["concurrency"]): l["output_tokens_per_s"] for l in fixed["levels"]},
        "levels": [{k: l.get(k) for k in ("concurrency", "output_tokens_per_s", "ttft_ms", "tpot_ms_stats", "itl_ms",
                                          "e2el_ms", "goodput_requests_per_s", "requests_per_s")}
                   for l in fixed["levels"]],
        "rates": [{k: l.get(k) for k in ("request_rate", "output_tokens_per_s", "ttft_ms", "tpot_ms_stats",
                                         "goodput_requests_per_s", "requests_per_s")}
                  for l in fixed.get("rates") or []],
        "memory_bytes": max((l.get("memory_bytes") or 0) for l in fixed["levels"]) or None,
        "capacity": capacity_figures(summary.get("capacity")),
        "roofline_fraction": roof.get("fraction_of_bound"),
        "roofline_tokens_per_s": roof.get("bound_tokens_per_s"),
        **({"loads": loads, "batch1_load": f"{loads[0]['label']}, c={batch1['concurrency']}"} if loads else {}),
    }


CAPACITY_FIELDS = ("kv_cache_tokens", "max_context_batch1", "weight_bytes", "kv_cache_bytes", "goodput_tok_s_per_gpu")


def capacity_figures(found) -> dict | None:
    """bench.json's `capacity` (when the bench measured it): the numeric fields the first screen shows,
    anything else left out; None when absent or holding none of them."""
    if not isinstance(found, dict):
        return None
    kept = {k: found[k] for k in CAPACITY_FIELDS
            if isinstance(found.get(k), (int, float)) and not isinstance(found.get(k), bool) and math.isfinite(found[k])}
    if isinstance(found.get("slo"), dict):
        kept["slo"] = {str(k): v for k, v in found["slo"].items() if isinstance(v, (int, float, str))}
    return kept or None


def _ratio(value, reference) -> float | None:
    if value is None or not reference:
        return None
    return value / reference


def capacity_line(decision: str, variant: dict | None, base: dict | None) -> str:
    """decision: GO / NO-GO / INCONCLUSIVE; variant, base: speed rows (None without a bench).
    tokens/s: output tokens/s per GPU of the requests that met the SLO (goodput) when both have it, else
    the highest output tokens/s of the fixed workload; KV capacity: tokens the engine's KV cache holds at
    the configured memory fraction. A figure is left out when either side lacks it or the two were benched
    on different engines or devices (their ratio would say nothing about the variant)."""
    parts = [decision]
    if not variant or not base or variant.get("engine") != base.get("engine") or variant.get("device") != base.get(
            "device"):
        return parts[0]
    v_cap, b_cap = variant.get("capacity") or {}, base.get("capacity") or {}
    speed = _ratio(v_cap.get("goodput_tok_s_per_gpu"), b_cap.get("goodput_tok_s_per_gpu"))
    if speed is None:
        peak = lambda row: max((row.get("tokens_per_s") or {}).values(), default=None)  # noqa: E731
        speed = _ratio(peak(variant), peak(base))
    if speed is not None:
        text_only = f" ({variant['loads'][0]['label']})" if variant.get("loads") else ""  # a bench with images
        parts.append(f"{figures.ratio(speed)} tokens/s{text_only}")
    kv = _ratio(v_cap.get("kv_cache_tokens"), b_cap.get("kv_cache_tokens"))
    if kv is not None:
        parts.append(f"{figures.ratio(kv)} KV capacity")
    return ", ".join(parts)
