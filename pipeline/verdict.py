"""Paired statistics and the decision: GO / NO-GO / INCONCLUSIVE per variant and suite.

Both models answered the same items, so every test is paired: a paired bootstrap of the
per-item score difference gives the interval, an exact McNemar test the p-value for
right/wrong suites. GO when the interval's lower end clears minus the margin, NO-GO when
its upper end falls below it, else INCONCLUSIVE with the items that would likely settle it.
"""

from __future__ import annotations

import math
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


def decide(ci_low: float, ci_high: float, margin: float) -> str:
    if ci_low > -margin:
        return GO
    if ci_high < -margin:
        return NO_GO
    return INCONCLUSIVE


def compare_suite(base_items: dict[str, dict], variant_items: dict[str, dict], *, variant: str, suite: str,
                  margin: float, confidence: float = 0.95, iterations: int = 2000, seed: int = 0,
                  floor_ceiling: float = 0.05) -> SuiteVerdict:
    """base_items / variant_items: result lines keyed by item id (the DESIGN.md contract)."""
    ids = sorted(set(base_items) & set(variant_items))
    base = np.array([base_items[i]["score"] for i in ids], dtype=float)
    var = np.array([variant_items[i]["score"] for i in ids], dtype=float)
    deltas = var - base
    low, high = paired_bootstrap(deltas, iterations, confidence, seed)
    base_right = [bool(base_items[i]["correct"]) for i in ids]
    var_right = [bool(variant_items[i]["correct"]) for i in ids]
    r2w = [i for i, b, v in zip(ids, base_right, var_right) if b and not v]
    w2r = [i for i, b, v in zip(ids, base_right, var_right) if v and not b]
    binary = all(s in (0.0, 1.0) for s in np.concatenate([base, var]))
    base_score = float(base.mean()) if len(ids) else float("nan")
    var_score = float(var.mean()) if len(ids) else float("nan")
    reasons, counted = [], True
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
        reasons.append(_explain(decision, low, high, margin, confidence))
    verdict = SuiteVerdict(
        variant=variant, suite=suite, n=len(ids), base_score=base_score, variant_score=var_score,
        delta=var_score - base_score if ids else float("nan"), ci_low=low, ci_high=high,
        confidence=confidence, recovery=(var_score / base_score) if ids and base_score > 0 else None,
        right_to_wrong=r2w, wrong_to_right=w2r,
        p_value=mcnemar_exact(len(r2w), len(w2r)) if binary and ids else None,
        margin=margin, decision=decision if counted else UNINFORMATIVE if ids else INCONCLUSIVE,
        counted=counted, reasons=reasons,
    )
    if decision == INCONCLUSIVE and ids and counted:
        verdict.items_to_settle = items_to_settle(deltas, margin, confidence)
        if verdict.items_to_settle:
            reasons.append(f"about {verdict.items_to_settle} paired items would likely settle it")
    return verdict


def _explain(decision: str, low: float, high: float, margin: float, confidence: float) -> str:
    ci = f"{confidence:.0%} interval of the change [{low:+.3f}, {high:+.3f}]"
    if decision == GO:
        return f"{ci} lies above -{margin:.3f} (the margin): the drop, if any, is within the margin"
    if decision == NO_GO:
        return f"{ci} lies below -{margin:.3f} (the margin): the variant is worse by more than allowed"
    return f"{ci} straddles -{margin:.3f} (the margin): not enough evidence either way"


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


# ---------------------------------------------------------------- perplexity suites

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

    def to_dict(self) -> dict:
        return asdict(self)


def ratio_interval(deltas: np.ndarray, tokens: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """Mean per-token change D = sum(deltas) / sum(tokens) over paired documents, with a t interval.

    The standard error is the ratio estimator's linearization (Cochran 1977, Sampling Techniques,
    sec. 6.4; equal to the HC1 sandwich error of a weighted least-squares fit of deltas on tokens
    with weights 1/tokens): se^2 = m / (m - 1) * sum((d_i - D n_i)^2) / (sum n_i)^2, with Student's
    t at m - 1 degrees of freedom for m documents, which widens the interval at small m."""
    from scipy.stats import t as student_t

    m = len(deltas)
    total = float(tokens.sum())
    estimate = float(deltas.sum()) / total
    if m < 2:
        return estimate, float("nan"), float("nan")
    residuals = deltas - estimate * tokens
    se = math.sqrt(m / (m - 1) * float((residuals ** 2).sum())) / total
    half = float(student_t.ppf(0.5 + confidence / 2, m - 1)) * se
    return estimate, estimate - half, estimate + half


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
    return verdict
