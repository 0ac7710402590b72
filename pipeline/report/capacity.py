"""One line per variant: its decision beside what it buys in serving, e.g. "GO, 1.5x tokens/s, 2x KV
capacity". The figures come from `quantize bench` (bench.json `capacity`, pipeline/engines/capacity.py)
of the variant and of the base, through the report's speed rows (pipeline/report/__init__.py: speed_row).
"""

from __future__ import annotations


def _ratio(value, reference) -> float | None:
    if value is None or not reference:
        return None
    return value / reference


def _times(ratio: float) -> str:
    return f"{ratio:.2g}x"


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
        parts.append(f"{_times(speed)} tokens/s")
    kv = _ratio(v_cap.get("kv_cache_tokens"), b_cap.get("kv_cache_tokens"))
    if kv is not None:
        parts.append(f"{_times(kv)} KV capacity")
    return ", ".join(parts)
