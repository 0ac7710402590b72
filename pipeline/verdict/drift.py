"""Distribution drift: the figures kl.json states (`quantize kl`, pipeline/stages/kl.py), recomputed from kl.jsonl's
per-token values: mean, 99th percentile (linear interpolation, as torch.quantile and numpy's default) and maximum
of KL(base || variant) over every scored token, and the share of tokens whose top-1 tokens agree."""

from __future__ import annotations

import numpy as np

FIGURES = ("sequences", "tokens", "kl_mean", "kl_p99", "kl_max", "top1_agreement")


def kl_figures(lines: list[dict]) -> dict:
    """{sequences, tokens, kl_mean, kl_p99, kl_max, top1_agreement} of kl.jsonl's lines (pipeline/formats/kl_lines.py)."""
    values = np.concatenate([np.asarray(line["kl"], dtype=np.float64) for line in lines])
    return {"sequences": len(lines), "tokens": int(values.size), "kl_mean": float(values.mean()),
            "kl_p99": float(np.quantile(values, 0.99)), "kl_max": float(values.max()),
            "top1_agreement": sum(line["top1_agree"] for line in lines) / values.size}
