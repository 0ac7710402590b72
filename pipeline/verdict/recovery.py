"""Recovery as published quantized-model cards state it (Red Hat / Neural Magic): the variant's score over the
base's, per suite and on average, beside the paired change; it describes, the paired test decides.

Accuracy suites: recovery = variant score / base score (100 % for no change). The average is the mean variant
score over the mean base score across the counted accuracy suites (a model card's "average" row: the ratio of
the averages), so a suite at the floor, which says little, does not drag it; those left out are named.
Perplexity suites (lower is better): recovery = base perplexity / variant perplexity, so that it reads the same
way (100 % for no change, lower for a worse variant); it is per suite only, never averaged with accuracy.
"""

from __future__ import annotations

RECOVERY_METHOD = ("mean variant score / mean base score over the counted accuracy suites (model cards' average "
                   "recovery); per perplexity suite: base perplexity / variant perplexity, not averaged")


def average_recovery(suite_verdicts: list) -> dict:
    """variants.<v>.recovery of verdict.json: the average over the counted accuracy suites (None without one),
    which suites it covers and which are left out and why."""
    over, left_out = [], {}
    for v in suite_verdicts:
        if not v.counted:
            left_out[v.suite] = "not counted (" + ("the base at the floor or ceiling" if v.n else "no paired items") + ")"
        elif not v.base_score > 0:
            left_out[v.suite] = "the base scores 0"
        else:
            over.append(v)
    base = sum(v.base_score for v in over) / len(over) if over else None
    variant = sum(v.variant_score for v in over) / len(over) if over else None
    return {"accuracy": variant / base if over else None, "base_mean": base, "variant_mean": variant,
            "suites": [v.suite for v in over], "left_out": left_out, "method": RECOVERY_METHOD}
