"""The judge's win rate and its decision: GO when the win rate's interval lies above 0.5 - margin, NO-GO
when below; UNRELIABLE (shown, not counted) when the judge contradicts itself with the answers swapped
too often. The interval is Tango's on wins against losses (pipeline/verdict/intervals.py). `judge_verdict`
is what the report records for a variant from its judge.json.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from pipeline.settings.params import Params
from pipeline.verdict.figures import share
from pipeline.verdict.intervals import (GO, INCONCLUSIVE, NO_GO, TANGO, decide, min_items_for_go, paired_bootstrap,
                                        tango_interval)

UNRELIABLE = "UNRELIABLE"
WIN_RATE_INTERVAL = f"{TANGO} on wins against losses, halved and shifted by 0.5"
SCORE = {"win": 1.0, "tie": 0.5, "loss": 0.0}  # a judged pair's outcome, from the variant's side


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


def correlation(x: list[float], y: list[float]) -> float | None:
    """Pearson correlation, None when undefined (fewer than 3 points or a constant series)."""
    if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def pairwise_figures(lines: list[dict], control: bool, *, confidence: float = 0.95, **_bootstrap) -> dict:
    """What a pairwise judge.json states about its pairs, from judge.jsonl's lines (each pair's `outcome`,
    `consistent`, `length_diff`, and its `control` run's): the counts, the win rate and its interval,
    position-swap consistency, the length bias and the control run's win rate (the noise floor)."""
    summary = win_rate([line["outcome"] for line in lines], confidence=confidence)
    both = [line["consistent"] for line in lines if line["consistent"] is not None]
    summary["consistency"] = sum(both) / len(both) if both else None
    summary["unjudged_reasons"] = dict(Counter(line["unjudged_reason"] for line in lines if line["unjudged_reason"]))
    judged = [line for line in lines if line["outcome"] in SCORE]
    summary["length_bias"] = correlation([line["length_diff"] for line in judged],
                                         [SCORE[line["outcome"]] for line in judged])
    summary["control_win_rate"] = summary["noise_floor"] = summary["control_consistency"] = None
    if control:
        ctrl = win_rate([line["control"]["outcome"] for line in lines], confidence=confidence)
        both = [line["control"]["consistent"] for line in lines if line["control"]["consistent"] is not None]
        summary["control_win_rate"] = ctrl["win_rate"]
        summary["control_n"] = ctrl["n"]
        summary["noise_floor"] = abs(ctrl["win_rate"] - 0.5) if ctrl["n"] else None
        summary["control_consistency"] = sum(both) / len(both) if both else None
    return summary


def reference_figures(lines: list[dict], *, iterations: int, confidence: float, seed: int) -> dict:
    """What a reference-mode judge.json states about its answers, from judge.jsonl's lines (each answer's
    `grade` 1-5 or null): the counts, the mean grade with its bootstrap interval, the grades, the length bias."""
    graded = [line for line in lines if line["grade"]]
    grades = np.array([line["grade"] for line in graded], dtype=float)
    low, high = paired_bootstrap(grades, iterations, confidence, seed)
    return {
        "n": len(graded), "unjudged": len(lines) - len(graded),
        "unjudged_reasons": dict(Counter(line["unjudged_reason"] for line in lines if line["unjudged_reason"])),
        "mean_grade": float(grades.mean()) if len(grades) else None,
        "ci_low": low if len(grades) else None, "ci_high": high if len(grades) else None,
        "grades": {str(g): int((grades == g).sum()) for g in range(1, 6)},
        "consistency": None,
        "length_bias": correlation([line["length_diff"] for line in graded], list(grades)),
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
        shown = "n/a" if consistency is None else share(consistency)
        return reasons + [f"position-swap consistency {shown} is below judge.min_consistency "
                          f"{share(min_consistency)}: the judge is unreliable and its verdict is not counted"]
    interval = f"win rate {share(summary['win_rate'])}, interval [{share(summary['ci_low'])}, {share(summary['ci_high'])}]"
    floor = 0.5 - margin
    text = {GO: f"{interval} lies above {share(floor)} (50% - margin): the variant is not judged worse",
            NO_GO: f"{interval} lies below {share(floor)} (50% - margin): the judge prefers the base",
            INCONCLUSIVE: f"{interval} straddles {share(floor)} (50% - margin): not enough evidence either way"}
    reasons.append(text[decision])
    fewest = min_judged_pairs_for_go(margin, summary.get("confidence", 0.95))
    if fewest and summary["n"] < fewest and decision != NO_GO:
        reasons.append(f"too few judged pairs to ever show a GO: with {summary['n']} even all ties leave the "
                       f"interval's lower end below {share(floor)}; a GO needs at least {fewest} judged pairs")
    if summary.get("noise_floor") is not None and summary["noise_floor"] > margin:
        reasons.append(f"the control run (base against itself) is off 50% by {share(summary['noise_floor'])}, "
                       f"more than the margin {share(margin)}: read the verdict with care")
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
              f"{summary['losses']} and tied {summary['ties']} (win rate {share(summary['win_rate'])})")
    if decision == UNRELIABLE:
        consistency = summary.get("consistency")
        shown = "n/a" if consistency is None else share(consistency)
        return (f"judge: UNRELIABLE (not counted): {counts}, but it gave the same verdict with the answers swapped "
                f"in only {shown} of pairs, below judge.min_consistency {share(min_consistency)}.")
    floor = 0.5 - margin
    method = summary.get("ci_method") or "a bootstrap interval"
    interval = (f"{method} puts the win rate at [{share(summary['ci_low'])}, {share(summary['ci_high'])}] with "
                f"{summary.get('confidence', 0.95):.0%} confidence")
    threshold = f"{share(floor)} (50% - margin {share(margin)})"
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


def judge_verdict(summary: dict | None, params: Params) -> dict | None:
    """The judge's win rate tested against 0.5 - margin (a variant's judge.json, None when it has none);
    counted only when the judge is reliable."""
    if summary is None:
        return None
    margin, min_consistency = params.verdict.margins.judge, params.judge.min_consistency
    decision = decide_judge(summary, margin, min_consistency)
    counted = decision != UNRELIABLE and summary.get("mode", "pairwise") == "pairwise" and bool(summary.get("n"))
    return {"decision": decision, "counted": counted, "margin": margin,
            "sentence": judge_sentence(summary, decision, margin, min_consistency),
            "reasons": explain_judge(summary, decision, margin, min_consistency), "summary": summary}
