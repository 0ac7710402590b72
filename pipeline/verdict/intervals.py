"""Paired intervals and tests for right/wrong and scored items, and the decision read off an interval.

Tango's score interval with continuity correction for paired right/wrong items (`tango_interval`),
the exact McNemar test, a Student-t interval for partial credit widened to Tango's for no change,
the paired bootstrap for other scores, and the items that would likely settle an open interval.
pipeline/verdict/paired.py and judge.py build the per-suite and the judge's verdicts on them.
"""

from __future__ import annotations

import functools
import math

import numpy as np

GO, NO_GO, INCONCLUSIVE, UNINFORMATIVE = "GO", "NO-GO", "INCONCLUSIVE", "UNINFORMATIVE"


def paired_bootstrap(deltas: np.ndarray, iterations: int, confidence: float, seed: int) -> tuple[float, float]:
    """Percentile interval of the mean paired difference."""
    if len(deltas) == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(deltas), size=(iterations, len(deltas)))
    means = deltas[picks].mean(axis=1)
    alpha = (1 - confidence) / 2
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def mcnemar_exact(right_to_wrong: int, wrong_to_right: int) -> float:
    """Two-sided exact McNemar p-value: a binomial test on the discordant pairs."""
    n = right_to_wrong + wrong_to_right
    if n == 0:
        return 1.0
    k = min(right_to_wrong, wrong_to_right)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def items_to_settle(deltas: np.ndarray, margin: float, confidence: float) -> int | None:
    """Items needed for the interval half-width to fit between the observed delta and -margin."""
    sd = float(np.std(deltas, ddof=1)) if len(deltas) > 1 else 0.0
    gap = abs(float(np.mean(deltas)) + margin)
    if sd == 0 or gap == 0:
        return None
    z = 1.959963984540054 if abs(confidence - 0.95) < 1e-9 else _z(confidence)
    return int(math.ceil((z * sd / gap) ** 2))


def _z(confidence: float) -> float:
    from statistics import NormalDist

    return NormalDist().inv_cdf(0.5 + confidence / 2)


# ---------------------------------------------------------------- paired right/wrong items: Tango's score interval
#
# Tango T. (1998), "Equivalence test and confidence interval for the difference in proportions
# for the paired-sample design", Statistics in Medicine 17:891-908: the interval holds every
# change d whose score test |T(d)| <= z does not reject, where T uses the maximum-likelihood rates
# of the discordant pairs under the constraint "true change = d" (a closed-form quadratic).
# The continuity correction (Chang P. et al. (2024), "Continuity corrected score confidence
# interval for the difference in proportions in paired data", J. Appl. Stat. 51:139-152) takes
# one pair off |improved - worsened - n d|, as the corrected McNemar test does: at d = 0 the
# statistic is exactly McNemar's corrected one. Without it Tango's interval covers as little as
# 0.93 at some n and discordance rates; with it the exact coverage stays >= 0.954 at n = 10..1319
# (benchmarks/interval_coverage.py). The same computation, with skew=FALSE, bcf=FALSE, cc=TRUE,
# is R's ratesci::pairbinci(c(a, b, c, d), method = "Score"), for a reviewer who wants to check.

TANGO = "Tango's score interval with continuity correction"
CONTINUITY = 0.5  # McNemar's; subtracts 2 x 0.5 = 1 pair from the score's numerator
_BISECTIONS = 52  # [-1, 1] halved 52 times: ~4e-16, below float resolution of the change


def _restricted_worsened_rate(improved, worsened, n, change):
    """Tango's maximum-likelihood P(right -> wrong) under the constraint P(w->r) - P(r->w) = change:
    the positive root of 2n p^2 + B p + C = 0, computed without cancellation."""
    a = 2.0 * n
    b = -improved - worsened + (2.0 * n - improved + worsened) * change
    c = -worsened * change * (1.0 - change)
    root = np.sqrt(np.maximum(b * b - 4.0 * a * c, 0.0))
    with np.errstate(divide="ignore", invalid="ignore"):
        rate = np.where(b > 0, -2.0 * c / (b + root), (root - b) / (2.0 * a))
    return np.clip(np.nan_to_num(rate), 0.0, 1.0)


def tango_score(improved, worsened, n, change, correction: float = CONTINUITY):
    """Tango's score statistic for H0: true change = `change`, continuity-corrected; arrays broadcast.
    improved / worsened: pairs that went wrong -> right / right -> wrong (fractions allowed)."""
    improved, worsened, n, change = (np.asarray(v, dtype=float) for v in (improved, worsened, n, change))
    p_worse = _restricted_worsened_rate(improved, worsened, n, change)
    variance = n * (2.0 * p_worse + change * (1.0 - change))
    gap = improved - worsened - n * change
    shrunk = np.sign(gap) * np.maximum(np.abs(gap) - 2.0 * correction, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        score = np.where(shrunk == 0, 0.0, shrunk / np.sqrt(variance))
    return np.where(np.isnan(score), 0.0, score)


def tango_interval(improved, worsened, n, confidence: float = 0.95, correction: float = CONTINUITY):
    """Tango's score interval (continuity-corrected) for the paired change in accuracy,
    variant minus base, found by bisection of the score test; vectorised over arrays of counts.
    Returns (low, high) as floats for scalar input, else as arrays."""
    scalar = all(np.ndim(v) == 0 for v in (improved, worsened, n))
    counts = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (improved, worsened, n)))
    z = _z(confidence)
    low, high = (_tango_end(*counts, z, side, correction) for side in (+1, -1))
    return (float(low), float(high)) if scalar else (low, high)


def _tango_end(improved, worsened, n, z: float, side: int, correction: float):
    """The interval's lower end (side +1: the largest change the score test still rejects from
    below, score >= z) or upper end (side -1: the smallest rejected from above, score <= -z)."""
    lo, hi = np.full(n.shape, -1.0), np.full(n.shape, 1.0)
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        beyond = side * tango_score(improved, worsened, n, mid, correction) >= z
        if side > 0:
            lo, hi = np.where(beyond, mid, lo), np.where(beyond, hi, mid)
        else:
            lo, hi = np.where(beyond, lo, mid), np.where(beyond, mid, hi)
    return (lo + hi) / 2


def tango_items_to_settle(improved: float, worsened: float, n: int, margin: float, confidence: float = 0.95,
                          cap: int = 10 ** 8) -> int | None:
    """Fewest paired items at which Tango's interval, at the observed flip rates, clears -margin
    (GO if the observed change is above it, NO-GO if below); None if no number would."""
    change = (improved - worsened) / n if n else 0.0
    if n <= 0 or math.isclose(change, -margin, abs_tol=1e-12):
        return None
    up, down, z = improved / n, worsened / n, _z(confidence)
    side = +1 if change > -margin else -1  # GO needs the lower end above -margin, NO-GO the upper below

    def settled(items: int) -> bool:
        end = float(_tango_end(*(np.asarray(v, dtype=float) for v in (up * items, down * items, items)),
                               z, side, CONTINUITY))
        return end > -margin if side > 0 else end < -margin

    high = 1
    while not settled(high):
        high *= 2
        if high > cap:
            return None
    low = high // 2
    while high - low > 1:  # settled(high) holds, settled(low) does not (or low == 0)
        mid = (low + high) // 2
        low, high = (low, mid) if settled(mid) else (mid, high)
    return high


@functools.lru_cache(maxsize=64)
def min_items_for_go(margin: float, confidence: float = 0.95) -> int | None:
    """Fewest paired items with which a GO is possible at all: even with no flip, Tango's interval
    is [-w, +w] with w shrinking as n grows; below this n it reaches past -margin."""
    return tango_items_to_settle(0.0, 0.0, 1, margin, confidence) if margin > 0 else None


def partial_credit_interval(deltas: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """Scores in [0, 1] that are not all 0/1 (partial credit): a Student-t interval of the mean paired
    change, widened where needed to Tango's no-flip interval for this n around the observed change, so
    that agreement on few items is never taken for proof (the t interval alone is [0, 0] when nothing
    changed, and covers 0.47-0.93 at n = 10-30 with rare changes; this one >= 0.94 at n = 10..300 in
    benchmarks/interval_coverage.py)."""
    from scipy.stats import t as student

    n = len(deltas)
    mean = float(np.mean(deltas))
    half = float(student.ppf(0.5 + confidence / 2, n - 1) * np.std(deltas, ddof=1) / math.sqrt(n)) if n > 1 else 1.0
    floor_low, floor_high = tango_interval(0, 0, n, confidence)
    return max(-1.0, min(mean - half, mean + floor_low)), min(1.0, max(mean + half, mean + floor_high))


PARTIAL_CREDIT = f"a Student-t interval of the mean change, widened at least to {TANGO} for no change"


def per_item_mean_interval(deltas, confidence: float = 0.95):
    """The paired change in per-item means (each item answered k times by each model: avg@k), variant minus base:
    Student's t on the per-item differences, each end moved out by one item's whole change (1 / n, the continuity
    correction Tango's interval and McNemar's test make), and widened at least to Tango's interval for no flip at
    this n around the observed change (as the partial-credit interval is), so that n items that all agree are never
    taken for proof. Vectorised over the last axis (one row of per-item differences per dataset); floats for one row.
    Simulated coverage (benchmarks/per_item_mean_coverage.py, n = 30..1,319, k = 1..16, items of every difficulty
    spread, a few items broken or all shifted): lowest 0.947 of 900 settings, none below 0.95 beyond Monte Carlo
    error (the lowest eight again over 20,000 datasets: 0.954-0.959), where t alone covers 0.74 at n = 30 and t
    widened to the floor 0.93 at n = 300 with a few items broken; Johnson's (1978) skewness correction and a BCa
    bootstrap (scipy) changed nothing measurable there."""
    from scipy.stats import t as student

    deltas = np.asarray(deltas, dtype=float)
    n = deltas.shape[-1]
    mean = deltas.mean(axis=-1)
    if n < 2:
        low, high = np.full(np.shape(mean), -1.0), np.full(np.shape(mean), 1.0)
    else:
        half = student.ppf(0.5 + confidence / 2, n - 1) * deltas.std(axis=-1, ddof=1) / math.sqrt(n) + 1 / n
        floor_low, floor_high = tango_interval(0, 0, n, confidence)
        low = np.maximum(-1.0, np.minimum(mean - half, mean + floor_low))
        high = np.minimum(1.0, np.maximum(mean + half, mean + floor_high))
    return (float(low), float(high)) if np.ndim(low) == 0 else (low, high)


PER_ITEM_MEANS = ("Student's t on the per-item means (avg@k) with a continuity correction of one item, widened at least "
                  f"to {TANGO} for no change")


def decide(ci_low: float, ci_high: float, margin: float) -> str:
    if ci_low > -margin:
        return GO
    if ci_high < -margin:
        return NO_GO
    return INCONCLUSIVE


def beyond_suite(needed: int | None, available: int | None) -> bool:
    """Whether settling a suite would take more items than it has (`available`: the suite's items, when the results
    recorded it)."""
    return isinstance(needed, int) and isinstance(available, int) and needed > available


def cannot_settle(available: int, unit: str) -> str:
    """What an open suite's next step is when settling it would take more items than it has."""
    return f"it cannot be settled on this suite ({available} {unit})"
