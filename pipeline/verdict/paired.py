"""Right/wrong and scored suites: the variant against the base on the same items, paired.

For right/wrong items the interval of the change in accuracy is Tango's score interval for a paired
difference of proportions, with a continuity correction (pipeline/verdict/intervals.py): it keeps its
coverage at every n, zero flips included, where the percentile bootstrap it replaces gave [0, 0] and a
GO on 10 unchanged items. An exact McNemar test gives the p-value. Partial-credit scores in [0, 1] get a
Student-t interval never narrower than Tango's for no change; other scores (plain data only: the report's
reader refuses a result line scoring outside [0, 1]) keep the paired bootstrap.
GO when the interval's lower end clears minus the margin, NO-GO when its upper end falls below it, else
INCONCLUSIVE with the items that would likely settle it; a suite too small to ever show a GO says how
many items it needs (`compare_suite`). Each decision also comes as one sentence a reviewer can check
(`decision_sentence`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline.verdict.figures import points, share
from pipeline.verdict.intervals import (GO, INCONCLUSIVE, NO_GO, PARTIAL_CREDIT, PER_ITEM_MEANS, TANGO, UNINFORMATIVE,
                                        beyond_suite, cannot_settle, decide,
                                        items_to_settle, mcnemar_exact, min_items_for_go, paired_bootstrap,
                                        partial_credit_interval, per_item_mean_interval, tango_interval,
                                        tango_items_to_settle)
from pipeline.verdict.samples import sampled_figures, samples_per_item, samples_to_settle, within_item_variance


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
    available: int | None = None  # the items the suite has (its results' record), None when not recorded
    # k samples per item (issue 66): scores are then avg@k, compared on the per-item means
    samples_per_item: int = 1
    base_pass_at: dict[str, float] | None = None  # {"1": pass@1, ..., "k": pass@k}, Chen et al.'s estimator
    variant_pass_at: dict[str, float] | None = None
    samples_to_settle: int | None = None  # samples per item that would likely settle an INCONCLUSIVE on these items

    def to_dict(self) -> dict:
        return asdict(self)


def compare_suite(base_items: dict[str, dict], variant_items: dict[str, dict], *, variant: str, suite: str,
                  margin: float, confidence: float = 0.95, iterations: int = 2000, seed: int = 0,
                  floor_ceiling: float = 0.05, available: int | None = None) -> SuiteVerdict:
    """base_items / variant_items: result lines keyed by item id (the DESIGN.md contract).
    Scores in [0, 1] (right/wrong, or partial credit): Tango's interval; other scores: the bootstrap. `available`:
    the items the suite has, so no next step asks for more."""
    ids = sorted(set(base_items) & set(variant_items))
    base = np.array([base_items[i]["score"] for i in ids], dtype=float)
    var = np.array([variant_items[i]["score"] for i in ids], dtype=float)
    deltas = var - base
    paired_base, paired_variant = {i: base_items[i] for i in ids}, {i: variant_items[i] for i in ids}
    samples = max(samples_per_item(paired_base), samples_per_item(paired_variant))
    bounded = bool(ids) and bool(((base >= 0) & (base <= 1) & (var >= 0) & (var <= 1)).all())
    binary = samples == 1 and bool(ids) and bool(np.isin(base, (0.0, 1.0)).all() and np.isin(var, (0.0, 1.0)).all())
    if samples > 1:
        low, high, method = (*per_item_mean_interval(deltas, confidence), PER_ITEM_MEANS)
    else:
        low, high, method = _interval(deltas, binary, bounded, len(ids), confidence, iterations, seed)
    base_right = [bool(base_items[i]["correct"]) for i in ids]
    var_right = [bool(variant_items[i]["correct"]) for i in ids]
    r2w = [i for i, b, v in zip(ids, base_right, var_right) if b and not v]
    w2r = [i for i, b, v in zip(ids, base_right, var_right) if v and not b]
    base_score = float(base.mean()) if len(ids) else float("nan")
    var_score = float(var.mean()) if len(ids) else float("nan")
    fewest = min_items_for_go(margin, confidence) if bounded else None
    decision, counted, reasons = _decide(ids, base_items, variant_items, low, high, margin, base_score, floor_ceiling,
                                         fewest, confidence)
    verdict = SuiteVerdict(
        variant=variant, suite=suite, n=len(ids), base_score=base_score, variant_score=var_score,
        delta=var_score - base_score if ids else float("nan"), ci_low=low, ci_high=high,
        confidence=confidence, recovery=(var_score / base_score) if ids and base_score > 0 else None,
        right_to_wrong=r2w, wrong_to_right=w2r,
        p_value=mcnemar_exact(len(r2w), len(w2r)) if binary and ids else None,
        margin=margin, decision=decision if counted else UNINFORMATIVE if ids else INCONCLUSIVE,
        counted=counted, reasons=reasons, interval=method if ids else "", min_items_for_go=fewest,
        available=available, samples_per_item=samples,
        base_pass_at=(sampled_figures(paired_base) or {}).get("pass_at"),
        variant_pass_at=(sampled_figures(paired_variant) or {}).get("pass_at"),
    )
    if decision == INCONCLUSIVE and ids and counted:
        _items_to_settle(verdict, deltas, binary, margin, confidence, fewest)
        if samples > 1:
            within = np.array([within_item_variance(base_items[i]) + within_item_variance(variant_items[i]) for i in ids])
            verdict.samples_to_settle = samples_to_settle(deltas, within, samples, margin, confidence,
                                                          -tango_interval(0, 0, len(ids), confidence)[0])
            if verdict.samples_to_settle:
                verdict.reasons.append(f"about {verdict.samples_to_settle} samples per item (now {samples}) on these "
                                       f"{len(ids)} items would likely settle it")
    verdict.sentence = decision_sentence(verdict, binary)
    return verdict


def _interval(deltas, binary: bool, bounded: bool, n: int, confidence: float, iterations: int,
              seed: int) -> tuple[float, float, str]:
    """The paired change's interval and its method: Tango's for right/wrong items, the partial-credit one for
    other scores in [0, 1], else the bootstrap."""
    if binary:
        low, high = tango_interval(int((deltas > 0).sum()), int((deltas < 0).sum()), n, confidence)
        return low, high, TANGO
    if bounded:
        low, high = partial_credit_interval(deltas, confidence)
        return low, high, PARTIAL_CREDIT
    low, high = paired_bootstrap(deltas, iterations, confidence, seed)
    return low, high, f"percentile bootstrap ({iterations} resamples of the items, seed {seed})"


def _decide(ids: list[str], base_items: dict, variant_items: dict, low: float, high: float, margin: float,
            base_score: float, floor_ceiling: float, fewest: int | None,
            confidence: float) -> tuple[str, bool, list[str]]:
    """(decision, counted, reasons) of a suite's paired interval against its margin."""
    reasons, counted = [], True
    if not ids:
        return INCONCLUSIVE, False, ["no paired items: the variant and the base answered different items"]
    decision = decide(low, high, margin)
    unmatched = len(set(base_items) ^ set(variant_items))
    if unmatched:
        reasons.append(f"{unmatched} items answered by only one model were left out")
    if floor_ceiling > 0 and (base_score <= floor_ceiling or base_score >= 1 - floor_ceiling):
        counted = False
        where = "floor" if base_score <= floor_ceiling else "ceiling"
        reasons.append(f"the base model scores {share(base_score)}, at the {where}: this suite tells little "
                       "about the variant, so it is shown but not counted")
    if fewest and len(ids) < fewest and decision != NO_GO:
        no_flip_low, _ = tango_interval(0, 0, len(ids), confidence)
        reasons.append(f"too few items to ever show a GO: with {len(ids)} paired items even no flip at all "
                       f"leaves the interval's lower end at {points(no_flip_low)} points, below "
                       f"{points(-margin)}; a GO needs at least {fewest} paired items")
    return decision, counted, reasons


def _items_to_settle(verdict: SuiteVerdict, deltas, binary: bool, margin: float, confidence: float,
                     fewest: int | None) -> None:
    """An INCONCLUSIVE suite's paired items that would likely settle it, and the reason saying so."""
    if binary:
        verdict.items_to_settle = tango_items_to_settle(int((deltas > 0).sum()), int((deltas < 0).sum()),
                                                        verdict.n, margin, confidence)
    else:
        verdict.items_to_settle = items_to_settle(deltas, margin, confidence)
        if fewest and verdict.items_to_settle and verdict.delta > -margin:
            verdict.items_to_settle = max(verdict.items_to_settle, fewest)
    if beyond_suite(verdict.items_to_settle, verdict.available):
        verdict.reasons.append(cannot_settle(verdict.available, "items"))
    elif verdict.items_to_settle and verdict.items_to_settle != fewest:
        verdict.reasons.append(f"about {verdict.items_to_settle} paired items at {_rates(verdict)} would likely settle it")


def _rates(v: SuiteVerdict) -> str:
    """What an item count to settle a suite assumes stays as it is."""
    return "these flip rates" if v.samples_per_item == 1 else "this spread of the per-item changes"


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def decision_sentence(v: SuiteVerdict, binary: bool = True) -> str:
    """The decision in one sentence a reviewer can check: the suite, the paired counts, the
    interval (which method, its ends), the margin and what follows."""
    if not v.n:
        return f"{v.suite}: {v.decision}: the variant and the base share no item, so nothing can be compared."
    head = f"{v.suite}: {v.decision}" + ("" if v.counted else " (not counted: the base scores "
                                         f"{share(v.base_score)}, at the {'floor' if v.base_score < 0.5 else 'ceiling'})")
    if v.samples_per_item > 1:
        facts = (f"on {v.n} paired items, each answered {v.samples_per_item} times by each model and compared on its "
                 f"mean, avg@{v.samples_per_item}")
    elif binary:
        facts = (f"on {v.n} paired items the variant turned {_count(len(v.right_to_wrong), 'right answer')} wrong "
                 f"and {_count(len(v.wrong_to_right), 'wrong answer')} right")
    else:
        facts = f"on {v.n} paired items ({'partial-credit scores' if v.min_items_for_go else 'scores'})"
    facts += (f" ({share(v.base_score)} -> {share(v.variant_score)}, a change of {points(v.delta)} points); "
              f"{v.interval} puts the change at [{points(v.ci_low)}, {points(v.ci_high)}] points with "
              f"{v.confidence:.0%} confidence")
    bound = f"{points(-v.margin)} points (the margin for {v.suite})"
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
        if beyond_suite(v.items_to_settle, v.available) or beyond_suite(v.min_items_for_go, v.available):
            notes.append(cannot_settle(v.available, "items"))
        elif v.items_to_settle and v.items_to_settle != v.min_items_for_go:
            notes.append(f"about {v.items_to_settle} paired items at {_rates(v)} would settle it")
        if v.samples_to_settle:
            notes.append(f"about {v.samples_to_settle} samples per item on these {v.n} items would")
        if notes:
            end += f" ({'; '.join(notes)})"
    return f"{head}: {facts}, {end}."
