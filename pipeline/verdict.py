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
`perplexity_sentence`, `judge_sentence`). The intervals and tests live in pipeline/verdict_intervals.py,
the perplexity suites in pipeline/verdict_perplexity.py; every name is importable from here as before.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline.verdict_intervals import (CONTINUITY, GO, INCONCLUSIVE, NO_GO, PARTIAL_CREDIT, TANGO,  # noqa: F401
                                       UNINFORMATIVE, _restricted_worsened_rate, decide, items_to_settle,
                                       mcnemar_exact, min_items_for_go, paired_bootstrap, partial_credit_interval,
                                       tango_interval, tango_items_to_settle, tango_score)
from pipeline.verdict_perplexity import (PERPLEXITY_INTERVAL, PerplexityVerdict, bell_mccaffrey_df,  # noqa: F401
                                         compare_perplexity, decide_perplexity, perplexity_sentence, ratio_interval)


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
    if type(summary.get("replaced_characters")) is int and summary["replaced_characters"] > 0:
        n = summary["replaced_characters"]
        reasons.append(f"{n} character{'s' if n > 1 else ''} of the judge's replies could not be written as UTF-8 "
                       f"(unpaired UTF-16 surrogates) and stand{'s' if n == 1 else ''} as U+FFFD in judge.jsonl")
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
