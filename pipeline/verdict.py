"""Paired statistics and the decision: GO / NO-GO / INCONCLUSIVE per variant and suite.

Both models answered the same items, so every test is paired. For right/wrong items the
interval of the change in accuracy is Tango's score interval for a paired difference of
proportions, with a continuity correction (`tango_interval`): it keeps its coverage at every n,
zero flips included, where the percentile bootstrap it replaces gave [0, 0] and a GO on 10
unchanged items. An exact McNemar test gives the p-value. Partial-credit scores in [0, 1] get a
Student-t interval never narrower than Tango's for no change (`partial_credit_interval`); other
scores keep the paired bootstrap. GO when the interval's lower end clears minus the margin, NO-GO
when its upper end falls below it, else INCONCLUSIVE with the items that would likely settle it;
a suite too small to ever show a GO says how many items it needs. Perplexity suites compare the
per-token log-likelihood paired by document (`compare_perplexity`, a ratio-estimator t interval) against
a margin on the relative rise. The judge's win rate and the serving-speed comparison are decided here
too. Each decision also comes as one sentence a reviewer can check (`decision_sentence`,
`perplexity_sentence`, `judge_sentence`).
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

GO, NO_GO, INCONCLUSIVE, UNINFORMATIVE = "GO", "NO-GO", "INCONCLUSIVE", "UNINFORMATIVE"


@dataclass
class SuiteVerdict:
    variant: str
    suite: str
    n: int
    base_score: float
    variant_score: float
    delta: float
    ci_low: float
    ci_high: float
    confidence: float
    recovery: float | None
    right_to_wrong: list[str]
    wrong_to_right: list[str]
    p_value: float | None
    margin: float
    decision: str
    counted: bool
    reasons: list[str] = field(default_factory=list)
    items_to_settle: int | None = None
    interval: str = ""  # how ci_low / ci_high were computed
    min_items_for_go: int | None = None  # fewest paired items with which a GO is possible at all
    sentence: str = ""  # the decision in one sentence a reviewer can check

    def to_dict(self) -> dict:
        return asdict(self)


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


def decide(ci_low: float, ci_high: float, margin: float) -> str:
    if ci_low > -margin:
        return GO
    if ci_high < -margin:
        return NO_GO
    return INCONCLUSIVE


def compare_suite(base_items: dict[str, dict], variant_items: dict[str, dict], *, variant: str, suite: str,
                  margin: float, confidence: float = 0.95, iterations: int = 2000, seed: int = 0,
                  floor_ceiling: float = 0.05) -> SuiteVerdict:
    """base_items / variant_items: result lines keyed by item id (the DESIGN.md contract).
    Scores in [0, 1] (right/wrong, or partial credit): Tango's interval; other scores: the bootstrap."""
    ids = sorted(set(base_items) & set(variant_items))
    base = np.array([base_items[i]["score"] for i in ids], dtype=float)
    var = np.array([variant_items[i]["score"] for i in ids], dtype=float)
    deltas = var - base
    bounded = bool(ids) and bool(((base >= 0) & (base <= 1) & (var >= 0) & (var <= 1)).all())
    binary = bool(ids) and bool(np.isin(base, (0.0, 1.0)).all() and np.isin(var, (0.0, 1.0)).all())
    if binary:
        low, high = tango_interval(int((deltas > 0).sum()), int((deltas < 0).sum()), len(ids), confidence)
        method = TANGO
    elif bounded:
        low, high = partial_credit_interval(deltas, confidence)
        method = PARTIAL_CREDIT
    else:
        low, high = paired_bootstrap(deltas, iterations, confidence, seed)
        method = f"percentile bootstrap ({iterations} resamples of the items, seed {seed})"
    base_right = [bool(base_items[i]["correct"]) for i in ids]
    var_right = [bool(variant_items[i]["correct"]) for i in ids]
    r2w = [i for i, b, v in zip(ids, base_right, var_right) if b and not v]
    w2r = [i for i, b, v in zip(ids, base_right, var_right) if v and not b]
    base_score = float(base.mean()) if len(ids) else float("nan")
    var_score = float(var.mean()) if len(ids) else float("nan")
    reasons, counted = [], True
    fewest = min_items_for_go(margin, confidence) if bounded else None
    if not ids:
        decision, counted = INCONCLUSIVE, False
        reasons.append("no paired items: the variant and the base answered different items")
    else:
        decision = decide(low, high, margin)
        unmatched = len(set(base_items) ^ set(variant_items))
        if unmatched:
            reasons.append(f"{unmatched} items answered by only one model were left out")
        if floor_ceiling > 0 and (base_score <= floor_ceiling or base_score >= 1 - floor_ceiling):
            counted = False
            where = "floor" if base_score <= floor_ceiling else "ceiling"
            reasons.append(f"the base model scores {base_score:.1%}, at the {where}: this suite tells little "
                           "about the variant, so it is shown but not counted")
        if fewest and len(ids) < fewest and decision != NO_GO:
            no_flip_low, _ = tango_interval(0, 0, len(ids), confidence)
            reasons.append(f"too few items to ever show a GO: with {len(ids)} paired items even no flip at all "
                           f"leaves the interval's lower end at {_points(no_flip_low)} points, below "
                           f"{_points(-margin)}; a GO needs at least {fewest} paired items")
    verdict = SuiteVerdict(
        variant=variant, suite=suite, n=len(ids), base_score=base_score, variant_score=var_score,
        delta=var_score - base_score if ids else float("nan"), ci_low=low, ci_high=high,
        confidence=confidence, recovery=(var_score / base_score) if ids and base_score > 0 else None,
        right_to_wrong=r2w, wrong_to_right=w2r,
        p_value=mcnemar_exact(len(r2w), len(w2r)) if binary and ids else None,
        margin=margin, decision=decision if counted else UNINFORMATIVE if ids else INCONCLUSIVE,
        counted=counted, reasons=reasons, interval=method if ids else "", min_items_for_go=fewest,
    )
    if decision == INCONCLUSIVE and ids and counted:
        if binary:
            verdict.items_to_settle = tango_items_to_settle(int((deltas > 0).sum()), int((deltas < 0).sum()),
                                                            len(ids), margin, confidence)
        else:
            verdict.items_to_settle = items_to_settle(deltas, margin, confidence)
            if fewest and verdict.items_to_settle and verdict.delta > -margin:
                verdict.items_to_settle = max(verdict.items_to_settle, fewest)
        if verdict.items_to_settle and verdict.items_to_settle != fewest:
            reasons.append(f"about {verdict.items_to_settle} paired items at these flip rates would likely settle it")
    verdict.sentence = decision_sentence(verdict, binary)
    return verdict


def _points(change: float) -> str:
    """A change in accuracy as signed percentage points, e.g. -0.0312 -> '-3.12'."""
    return f"{change * 100:+.2f}"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def decision_sentence(v: SuiteVerdict, binary: bool = True) -> str:
    """The decision in one sentence a reviewer can check: the suite, the paired counts, the
    interval (which method, its ends), the margin and what follows."""
    if not v.n:
        return f"{v.suite}: {v.decision}: the variant and the base share no item, so nothing can be compared."
    head = f"{v.suite}: {v.decision}" + ("" if v.counted else " (not counted: the base scores "
                                         f"{v.base_score:.1%}, at the {'floor' if v.base_score < 0.5 else 'ceiling'})")
    if binary:
        facts = (f"on {v.n} paired items the variant turned {_count(len(v.right_to_wrong), 'right answer')} wrong "
                 f"and {_count(len(v.wrong_to_right), 'wrong answer')} right")
    else:
        facts = f"on {v.n} paired items ({'partial-credit scores' if v.min_items_for_go else 'scores'})"
    facts += (f" ({v.base_score:.1%} -> {v.variant_score:.1%}, a change of {_points(v.delta)} points); "
              f"{v.interval} puts the change at [{_points(v.ci_low)}, {_points(v.ci_high)}] points with "
              f"{v.confidence:.0%} confidence")
    bound = f"{_points(-v.margin)} points (the margin for {v.suite})"
    side = decide(v.ci_low, v.ci_high, v.margin)
    if side == GO:
        end = f"entirely above {bound}, so any drop is within the margin"
    elif side == NO_GO:
        end = f"entirely below {bound}, so the variant is worse by more than the margin"
    else:
        end = f"which straddles {bound}, so the evidence settles nothing"
        notes = []
        if v.min_items_for_go and v.n < v.min_items_for_go:
            notes.append(f"below {v.min_items_for_go} items not even zero flips could show a GO")
        if v.items_to_settle and v.items_to_settle != v.min_items_for_go:
            notes.append(f"about {v.items_to_settle} paired items at these flip rates would settle it")
        if notes:
            end += f" ({'; '.join(notes)})"
    return f"{head}: {facts}, {end}."


def overall(suite_verdicts: list[SuiteVerdict], extra: list[tuple[str, str]] = ()) -> tuple[str, list[str]]:
    """NO-GO if any counted suite is NO-GO, GO if all counted suites are GO, else INCONCLUSIVE.
    `extra`: other counted evidence as (name, decision), e.g. a reliable judge."""
    counted = [(v.suite, v.decision) for v in suite_verdicts if v.counted] + list(extra)
    if not counted:
        return INCONCLUSIVE, ["nothing counted: every suite was uninformative or empty"]
    no_go = [name for name, d in counted if d == NO_GO]
    if no_go:
        return NO_GO, [f"NO-GO on {', '.join(no_go)}"]
    open_ = [name for name, d in counted if d != GO]
    if open_:
        return INCONCLUSIVE, [f"not settled on {', '.join(open_)}"]
    return GO, [f"GO on everything counted ({', '.join(name for name, _ in counted)})"]


# ---------------------------------------------------------------- the judge's win rate and decision

UNRELIABLE = "UNRELIABLE"
WIN_RATE_INTERVAL = f"{TANGO} on wins against losses, halved and shifted by 0.5"


def win_rate(outcomes: list[str], *, confidence: float = 0.95) -> dict:
    """Win rate (W + T/2) / N over judged pairs, with Tango's continuity-corrected score interval for
    (W - L) / N mapped onto the win-rate scale (0.5 + change / 2): exact coverage >= 0.95 for n = 4..200
    (benchmarks/interval_coverage.py), where a percentile bootstrap covered 0.89 at n = 4."""
    counts = Counter(outcomes)
    wins, ties, losses = counts["win"], counts["tie"], counts["loss"]
    judged = wins + ties + losses
    low = high = None
    if judged:
        change_low, change_high = tango_interval(wins, losses, judged, confidence)
        low, high = 0.5 + change_low / 2, 0.5 + change_high / 2
    return {
        "n": judged, "wins": wins, "ties": ties, "losses": losses, "unjudged": counts["unjudged"],
        "win_rate": (wins + ties / 2) / judged if judged else None,
        "ci_low": low, "ci_high": high, "ci_method": WIN_RATE_INTERVAL,
    }


def decide_judge(summary: dict, margin: float, min_consistency: float) -> str:
    """GO when the win rate's interval lies above 0.5 - margin, NO-GO when below; UNRELIABLE when
    the judge contradicts itself too often for its verdict to count."""
    if summary.get("mode", "pairwise") != "pairwise" or not summary.get("n"):
        return INCONCLUSIVE
    consistency = summary.get("consistency")
    if consistency is None or consistency < min_consistency:
        return UNRELIABLE
    return decide(summary["ci_low"] - 0.5, summary["ci_high"] - 0.5, margin)


def explain_judge(summary: dict, decision: str, margin: float, min_consistency: float) -> list[str]:
    reasons = []
    if summary.get("weak_judge"):
        reasons.append("the judge is the base model itself: a weak judge, biased towards its own answers "
                       "and often unable to tell answers apart; use a stronger model for a real verdict")
    if summary.get("mode") == "reference":
        return reasons + ["reference mode grades the variant 1-5 against the base answer; it has no GO "
                          "threshold, so it informs but does not decide (use judge.mode: pairwise)"]
    if not summary.get("n"):
        return reasons + ["no pair was judged: every prompt is unjudged"]
    if decision == UNRELIABLE:
        consistency = summary.get("consistency")
        shown = "n/a" if consistency is None else f"{consistency:.0%}"
        return reasons + [f"position-swap consistency {shown} is below judge.min_consistency "
                          f"{min_consistency:.0%}: the judge is unreliable and its verdict is not counted"]
    interval = f"win rate {summary['win_rate']:.3f}, interval [{summary['ci_low']:.3f}, {summary['ci_high']:.3f}]"
    floor = 0.5 - margin
    text = {GO: f"{interval} lies above {floor:.3f} (0.5 - margin): the variant is not judged worse",
            NO_GO: f"{interval} lies below {floor:.3f} (0.5 - margin): the judge prefers the base",
            INCONCLUSIVE: f"{interval} straddles {floor:.3f} (0.5 - margin): not enough evidence either way"}
    reasons.append(text[decision])
    fewest = min_judged_pairs_for_go(margin, summary.get("confidence", 0.95))
    if fewest and summary["n"] < fewest and decision != NO_GO:
        reasons.append(f"too few judged pairs to ever show a GO: with {summary['n']} even all ties leave the "
                       f"interval's lower end below {floor:.3f}; a GO needs at least {fewest} judged pairs")
    if summary.get("noise_floor") is not None and summary["noise_floor"] > margin:
        reasons.append(f"the control run (base against itself) is off 0.5 by {summary['noise_floor']:.3f}, "
                       f"more than the margin {margin:.3f}: read the verdict with care")
    return reasons


def min_judged_pairs_for_go(margin: float, confidence: float = 0.95) -> int | None:
    """Fewest judged pairs with which the judge can show a GO at all (every pair a tie): the win
    rate's lower end is 0.5 + change / 2, so the change must clear -2 x margin."""
    return min_items_for_go(2 * margin, confidence) if margin > 0 else None


def judge_sentence(summary: dict, decision: str, margin: float, min_consistency: float) -> str:
    """The judge's decision in one sentence a reviewer can check: the counts, the interval (which
    method, its ends), the threshold 0.5 - margin and what follows."""
    if summary.get("mode") == "reference":
        grade = summary.get("mean_grade")
        shown = "no answer graded" if grade is None else f"mean grade {grade:.2f} of 5 over {summary['n']} answers"
        return (f"judge (reference mode): {decision}: {shown}; reference mode has no GO threshold, so it informs "
                "but does not decide.")
    if not summary.get("n"):
        return (f"judge: {decision}: no pair was judged ({summary.get('unjudged', 0)} unjudged), so the judge "
                "says nothing about the variant.")
    counts = (f"of {summary['n']} judged pairs the judge preferred the variant in {summary['wins']}, the base in "
              f"{summary['losses']} and tied {summary['ties']} (win rate {summary['win_rate']:.3f})")
    if decision == UNRELIABLE:
        consistency = summary.get("consistency")
        shown = "n/a" if consistency is None else f"{consistency:.0%}"
        return (f"judge: UNRELIABLE (not counted): {counts}, but it gave the same verdict with the answers swapped "
                f"in only {shown} of pairs, below judge.min_consistency {min_consistency:.0%}.")
    floor = 0.5 - margin
    method = summary.get("ci_method") or "a bootstrap interval"
    interval = (f"{method} puts the win rate at [{summary['ci_low']:.3f}, {summary['ci_high']:.3f}] with "
                f"{summary.get('confidence', 0.95):.0%} confidence")
    threshold = f"{floor:.3f} (0.5 - margin {margin:.2f})"
    if decision == GO:
        end = f"entirely above {threshold}, so the judge does not find the variant worse by more than the margin"
    elif decision == NO_GO:
        end = f"entirely below {threshold}, so the judge prefers the base by more than the margin"
    else:
        end = f"which straddles {threshold}, so the judgments settle nothing"
        fewest = min_judged_pairs_for_go(margin, summary.get("confidence", 0.95))
        if fewest and summary["n"] < fewest:
            end += f" (below {fewest} judged pairs not even all ties could show a GO)"
    return f"judge: {decision}: {counts}; {interval}, {end}."


# ---------------------------------------------------------------- serving speed (from `quantize bench`)

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
    reason = (f"batch-1 decode {variant['batch1_tokens_per_s']:.1f} vs base {base['batch1_tokens_per_s']:.1f} "
              f"tokens/s ({ratio:.2f}x) on {variant['engine']}, {variant['device']}")
    if deploy_engine is not None and not on_deploy:
        reason += (f"; measured on {variant['engine']}, but the variants are deployed on {deploy_engine} "
                   f"(verdict.speed_engine): engines invert which variant is faster, so it is shown, not counted")
    return {"comparable": True, "ratio": ratio, "slower": ratio < 1 - tolerance, "reason": reason,
            "deployment_engine": on_deploy}


# ---------------------------------------------------------------- perplexity suites

PERPLEXITY_INTERVAL = ("Student-t interval of the per-token change in log-likelihood (ratio estimator, HC2 error, "
                       "Bell-McCaffrey degrees of freedom)")


@dataclass
class PerplexityVerdict:
    """A perplexity suite (every token of each document scored): the variant's perplexity relative to
    the base's, paired by document, against a margin on the rise (0.05: at most +5 %)."""

    variant: str
    suite: str
    n: int  # documents
    tokens: int
    base_ppl: float
    variant_ppl: float
    change: float  # variant_ppl / base_ppl - 1
    ci_low: float
    ci_high: float
    confidence: float
    margin: float
    decision: str
    counted: bool
    worse_documents: int  # documents whose perplexity rose
    reasons: list[str] = field(default_factory=list)
    documents_to_settle: int | None = None
    kind: str = "perplexity"
    interval: str = PERPLEXITY_INTERVAL
    sentence: str = ""  # the decision in one sentence a reviewer can check

    def to_dict(self) -> dict:
        return asdict(self)


def ratio_interval(deltas: np.ndarray, tokens: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """Mean per-token change D = sum(deltas) / sum(tokens) over paired documents, with a t interval
    that keeps its coverage at few documents.

    D is the ratio estimator (Cochran 1977, Sampling Techniques, sec. 6.4): the weighted least-squares
    fit of deltas on tokens with weights 1/tokens. Its standard error is the HC2 sandwich (each squared
    residual r_i = d_i - D n_i divided by 1 - h_i, h_i = n_i / sum(n), the document's leverage), with
    Student's t at the Bell-McCaffrey (2002) degrees of freedom, a Satterthwaite approximation
    (`bell_mccaffrey_df`): fewer than m - 1 when a few long documents carry most tokens. The plain
    linearized error with t at m - 1 covered 0.931-0.953 at 3-10 documents; this one >= 0.945 at every
    n >= 3, heavy-tailed per-document changes included (benchmarks/perplexity_interval_coverage.py)."""
    from scipy.stats import t as student_t

    deltas, tokens = np.asarray(deltas, dtype=float), np.asarray(tokens, dtype=float)
    m = len(deltas)
    total = float(tokens.sum())
    estimate = float(deltas.sum()) / total
    if m < 2:
        return estimate, float("nan"), float("nan")
    residuals = deltas - estimate * tokens
    adjust = 1.0 / (1.0 - tokens / total)  # HC2: 1 / (1 - leverage)
    se = math.sqrt(float((adjust * residuals ** 2).sum())) / total
    half = float(student_t.ppf(0.5 + confidence / 2, bell_mccaffrey_df(tokens))) * se
    return estimate, estimate - half, estimate + half


def bell_mccaffrey_df(tokens: np.ndarray) -> float:
    """Degrees of freedom of the HC2 variance of the ratio estimator (Bell & McCaffrey 2002): the
    Satterthwaite match (tr A)^2 / tr(A^2) of the quadratic form v = e' A e, under two working models
    for the per-document error e: variance proportional to the document's tokens (token-level noise)
    and to its tokens squared (each document its own per-token change). The smaller of the two is
    taken. Closed form in O(m): A's Gram matrix is diagonal plus rank two (tests check it against the
    dense eigenvalue computation); with equal documents it is exactly m - 1."""
    n = np.asarray(tokens, dtype=float)
    total = n.sum()
    p = n / total
    a = 1.0 / (1.0 - p)
    found = []
    for s2 in (n, n * n):  # variance of each document's error under the working model
        # residuals r = M e with M = I - n 1'/N; with e = diag(s) u: Gram C = M diag(s2) M' = diag(s2) + E,
        # E = -(s2 p' + p s2') + sum(s2) p p' (rank two); v = sum_k a_k r_k^2 = u' B' diag(a) B u
        big = s2.sum()
        e_diag = -2 * s2 * p + big * p * p
        trace = float((a * (s2 + e_diag)).sum())
        u = np.stack([s2, p], axis=1)  # E = U W U'
        w = np.array([[0.0, -1.0], [-1.0, big]])
        g = (u * a[:, None]).T @ u  # U' diag(a) U
        cross = float(np.trace(w @ g @ w @ g))
        square = float((a * a * s2 * s2).sum() + 2 * (a * a * s2 * e_diag).sum() + cross)
        found.append(trace * trace / square)
    return min(found)


def decide_perplexity(ci_low: float, ci_high: float, margin: float) -> str:
    """GO when even the interval's upper end stays below the margin, NO-GO when its lower end is above it."""
    if ci_high < margin:
        return GO
    if ci_low > margin:
        return NO_GO
    return INCONCLUSIVE


def compare_perplexity(base_items: dict[str, dict], variant_items: dict[str, dict], *, variant: str, suite: str,
                       margin: float, confidence: float = 0.95) -> PerplexityVerdict:
    """base_items / variant_items: a perplexity suite's result lines keyed by document id, each with
    `loglikelihood` (natural log, summed over the document) and `n_tokens`."""
    shared = sorted(set(base_items) & set(variant_items))
    ids = [i for i in shared if base_items[i]["n_tokens"] == variant_items[i]["n_tokens"] and base_items[i]["n_tokens"]]
    reasons: list[str] = []
    if len(ids) < len(shared):
        reasons.append(f"{len(shared) - len(ids)} documents tokenized to different lengths for the two models "
                       "were left out (another tokenizer?)")
    unmatched = len(set(base_items) ^ set(variant_items))
    if unmatched:
        reasons.append(f"{unmatched} documents scored for only one model were left out")
    tokens = np.array([base_items[i]["n_tokens"] for i in ids], dtype=float)
    base_ll = np.array([base_items[i]["loglikelihood"] for i in ids], dtype=float)
    var_ll = np.array([variant_items[i]["loglikelihood"] for i in ids], dtype=float)
    nan = float("nan")
    if len(ids) < 2:
        reasons.append(f"{len(ids)} paired documents: an interval needs at least 2")
        return PerplexityVerdict(variant, suite, len(ids), int(tokens.sum()), nan, nan, nan, nan, nan, confidence,
                                 margin, INCONCLUSIVE, counted=False, worse_documents=0, reasons=reasons)
    total = tokens.sum()
    estimate, low, high = ratio_interval(base_ll - var_ll, tokens, confidence)  # per-token rise in NLL
    change, ci_low, ci_high = math.expm1(estimate), math.expm1(low), math.expm1(high)
    decision = decide_perplexity(ci_low, ci_high, margin)
    verdict = PerplexityVerdict(
        variant=variant, suite=suite, n=len(ids), tokens=int(total),
        base_ppl=math.exp(-base_ll.sum() / total), variant_ppl=math.exp(-var_ll.sum() / total),
        change=change, ci_low=ci_low, ci_high=ci_high, confidence=confidence, margin=margin,
        decision=decision, counted=True, worse_documents=int((var_ll < base_ll).sum()), reasons=reasons,
    )
    ci = f"{confidence:.0%} interval of the change in perplexity [{ci_low:+.1%}, {ci_high:+.1%}] over {len(ids)} documents"
    if decision == GO:
        reasons.append(f"{ci} lies below +{margin:.1%} (the margin): any rise is within the margin")
    elif decision == NO_GO:
        reasons.append(f"{ci} lies above +{margin:.1%} (the margin): perplexity rises by more than allowed")
    else:
        reasons.append(f"{ci} straddles +{margin:.1%} (the margin): not enough evidence either way")
        gap = abs(math.log1p(margin) - estimate)
        if gap > 0:
            verdict.documents_to_settle = int(math.ceil(len(ids) * ((high - estimate) / gap) ** 2))
            reasons.append(f"about {verdict.documents_to_settle} paired documents would likely settle it")
    verdict.sentence = perplexity_sentence(verdict)
    return verdict


def perplexity_sentence(v: PerplexityVerdict) -> str:
    """A perplexity suite's decision in one sentence a reviewer can check: documents and tokens, both
    perplexities, the interval (which method, its ends), the margin and what follows."""
    if not v.counted:
        return f"{v.suite}: {v.decision} (not counted): {v.n} paired documents, too few for an interval."
    facts = (f"on {v.n} paired documents ({v.tokens:,} tokens) perplexity went {v.base_ppl:.3f} -> {v.variant_ppl:.3f} "
             f"({v.change:+.1%}, higher in {v.worse_documents} of {v.n} documents); a {v.interval} puts the change at "
             f"[{v.ci_low:+.1%}, {v.ci_high:+.1%}] with {v.confidence:.0%} confidence")
    bound = f"+{v.margin:.1%} (the margin for {v.suite})"
    if v.decision == GO:
        end = f"entirely below {bound}, so any rise is within the margin"
    elif v.decision == NO_GO:
        end = f"entirely above {bound}, so perplexity rises by more than the margin"
    else:
        end = f"which straddles {bound}, so the evidence settles nothing"
        if v.documents_to_settle:
            end += f" (about {v.documents_to_settle} paired documents would likely settle it)"
    return f"{v.suite}: {v.decision}: {facts}, {end}."
