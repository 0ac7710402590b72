"""k samples per item: what a suite sampled several times per item is scored as, per model, and how many samples
per item would settle an open comparison.

A result line of such a suite holds its `samples` (each with its own score and right/wrong), its `score` is their
mean (avg@k) and `pass_at_k` whether any was right (pipeline/formats/results.py). Per model and suite: avg@k, the
mean of the items' avg@k, and pass@k' for k' up to k by the unbiased estimator of Chen et al. (2021), "Evaluating
Large Language Models Trained on Code", eq. 1: per item 1 - C(n - c, k') / C(n, k') for c right of n samples,
averaged over the items (`sampled_figures`). The paired comparison of a sampled suite is on the per-item means
(pipeline/verdict/intervals.py: per_item_mean_interval); what more samples per item would do to it follows from
the share of the per-item differences' variance that is sampling noise (`samples_to_settle`).
"""

from __future__ import annotations

import math

import numpy as np


def sample_count(line: dict) -> int:
    """How many samples one result line holds (1 for a line without `samples`)."""
    return len(line.get("samples") or ()) or 1


def samples_per_item(items: dict[str, dict]) -> int:
    """The most samples any item of a model's suite holds (1: one answer per item, as before issue 66)."""
    return max((sample_count(line) for line in items.values()), default=1)


def pass_at_k(samples: int, right: int, k: int) -> float:
    """Chen et al.'s unbiased estimate of pass@k from `right` of `samples` samples: 1 - C(n - c, k) / C(n, k),
    computed as a product so that it stays exact for large n (their numerically stable form)."""
    if not 1 <= k <= samples:
        raise ValueError(f"pass@{k} needs 1 <= k <= {samples} samples")
    if samples - right < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(samples - right + 1, samples + 1)))


def _right(line: dict) -> tuple[int, int]:
    """(samples, right) of one line; a line without samples is one sample, right when it scores 1."""
    samples = line.get("samples")
    if samples:
        return len(samples), sum(bool(s.get("correct")) for s in samples)
    return 1, int(line.get("score") == 1)


def pass_at_ks(k: int) -> list[int]:
    """The k' a suite sampled k times is shown at: 1, the powers of two below k, and k."""
    return sorted({1, k} | {2 ** e for e in range(1, max(k.bit_length(), 1)) if 2 ** e < k})


def sampled_figures(items: dict[str, dict]) -> dict | None:
    """{samples_per_item, avg_at_k, pass_at: {"1": ..., "k": ...}} of a model's suite sampled more than once per
    item (pass@k' at each k' that every item has samples for), None for a suite of one answer per item."""
    k = samples_per_item(items)
    if k < 2 or not items:
        return None
    counts = [_right(line) for line in items.values()]
    fewest = min(samples for samples, _ in counts)
    return {"samples_per_item": k, "avg_at_k": float(np.mean([line["score"] for line in items.values()])),
            "pass_at": {str(kk): float(np.mean([pass_at_k(samples, right, kk) for samples, right in counts]))
                        for kk in pass_at_ks(fewest)}}


def within_item_variance(line: dict) -> float:
    """The variance of one line's sample scores (ddof 1: unbiased, q (1 - q) for right/wrong samples); 0 for one."""
    scores = [s["score"] for s in line.get("samples") or ()]
    return float(np.var(scores, ddof=1)) if len(scores) > 1 else 0.0


def samples_to_settle(deltas: np.ndarray, within: np.ndarray, samples: int, margin: float, confidence: float,
                      floor_half: float) -> int | None:
    """About how many samples per item would settle an open comparison on these same items: the per-item
    differences' variance is the items' own spread plus sampling noise (`within`: per item, the base's and the
    variant's sample variances summed) over the samples; more samples shrink only the noise. None when no number
    would (the items differ among themselves too much, or the no-flip floor `floor_half` at this n is wider than
    the gap between the observed change and -margin)."""
    n = len(deltas)
    if n < 2 or samples < 1:
        return None
    gap = abs(float(np.mean(deltas)) + margin)
    if gap == 0 or floor_half >= gap:
        return None
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    noise = float(np.mean(within))  # one sample's noise, base and variant together
    between = max(float(np.var(deltas, ddof=1)) - noise / samples, 0.0)
    allowed = n * (gap / z) ** 2  # the per-item variance at which the interval's half-width is the gap
    if noise == 0 or between >= allowed:
        return None
    needed = math.ceil(noise / (allowed - between))
    return needed if needed > samples else None
