"""Perplexity suites: the variant's perplexity relative to the base's, paired by document, against a
margin on the relative rise (`compare_perplexity`, a ratio-estimator t interval with the HC2 error and
Bell-McCaffrey degrees of freedom), and its decision in one sentence (`perplexity_sentence`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from pipeline.verdict import figures
from pipeline.verdict.intervals import GO, INCONCLUSIVE, NO_GO, beyond_suite, cannot_settle


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
    # base perplexity / variant perplexity: 100 % for no change, lower for a worse variant, as recovery reads for
    # accuracy (variant score / base score); never averaged with the accuracy suites' recovery
    recovery: float | None = None
    available: int | None = None  # the documents the suite has (its results' record), None when not recorded

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
    with np.errstate(divide="ignore", invalid="ignore"):  # a leverage that rounds to 1: no interval (nan)
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
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # a leverage near 1: below
        return _bell_mccaffrey_df(np.asarray(tokens, dtype=float))


def _bell_mccaffrey_df(n: np.ndarray) -> float:
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
        found.append(trace * trace / square if square > 0 else math.nan)
    # one document with nearly every token (leverage within ~1e-6 of 1) cancels the closed form's terms; the
    # eigenvalues give 1 there, the least the degrees of freedom can be
    return min(found) if all(math.isfinite(df) for df in found) else 1.0


def relative_change(log_ratio: float) -> float:
    """exp(log_ratio) - 1; inf past what a float holds (the upper end of an interval over two or three documents
    that disagree wildly can reach beyond e^709)."""
    try:
        return math.expm1(log_ratio)
    except OverflowError:
        return math.inf


def decide_perplexity(ci_low: float, ci_high: float, margin: float) -> str:
    """GO when even the interval's upper end stays below the margin, NO-GO when its lower end is above it."""
    if ci_high < margin:
        return GO
    if ci_low > margin:
        return NO_GO
    return INCONCLUSIVE


def compare_perplexity(base_items: dict[str, dict], variant_items: dict[str, dict], *, variant: str, suite: str,
                       margin: float, confidence: float = 0.95, available: int | None = None) -> PerplexityVerdict:
    """base_items / variant_items: a perplexity suite's result lines keyed by document id, each with
    `loglikelihood` (natural log, summed over the document) and `n_tokens`; `available`: the documents the suite
    has, so no next step asks for more."""
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
    counted = not (math.isnan(low) or math.isnan(high))  # nan: a document whose leverage rounds to 1
    change, ci_low, ci_high = relative_change(estimate), relative_change(low), relative_change(high)
    verdict = PerplexityVerdict(
        variant=variant, suite=suite, n=len(ids), tokens=int(total),
        base_ppl=math.exp(-base_ll.sum() / total), variant_ppl=math.exp(-var_ll.sum() / total),
        change=change, ci_low=ci_low, ci_high=ci_high, confidence=confidence, margin=margin,
        decision=decide_perplexity(ci_low, ci_high, margin) if counted else INCONCLUSIVE, counted=counted,
        worse_documents=int((var_ll < base_ll).sum()), reasons=reasons,
        recovery=math.exp((var_ll.sum() - base_ll.sum()) / total), available=available,
    )
    _explain(verdict, estimate, high)
    verdict.sentence = perplexity_sentence(verdict)
    return verdict


def _explain(verdict: PerplexityVerdict, estimate: float, high: float) -> None:
    """The reason for a perplexity suite's decision (its interval against the margin), and the paired documents
    that would likely settle an open one."""
    v, margin = verdict, verdict.margin
    if not v.counted:
        v.reasons.append(f"no interval: one of the {v.n} paired documents holds all but a float's rounding of the "
                         "tokens, so the spread of the others cannot be told")
        return
    ci = (f"{v.confidence:.0%} interval of the change in perplexity [{figures.relative(v.ci_low)}, "
          f"{figures.relative(v.ci_high)}] over {v.n} documents")
    if v.decision == GO:
        v.reasons.append(f"{ci} lies below {figures.relative(margin)} (the margin): any rise is within the margin")
    elif v.decision == NO_GO:
        v.reasons.append(f"{ci} lies above {figures.relative(margin)} (the margin): perplexity rises by more than allowed")
    else:
        v.reasons.append(f"{ci} straddles {figures.relative(margin)} (the margin): not enough evidence either way")
        gap = abs(math.log1p(margin) - estimate)
        if gap > 0 and math.isfinite((high - estimate) / gap):
            v.documents_to_settle = int(math.ceil(v.n * ((high - estimate) / gap) ** 2))
            v.reasons.append(cannot_settle(v.available, "documents") if beyond_suite(v.documents_to_settle, v.available)
                             else f"about {v.documents_to_settle} paired documents would likely settle it")


def perplexity_sentence(v: PerplexityVerdict) -> str:
    """A perplexity suite's decision in one sentence a reviewer can check: documents and tokens, both
    perplexities, the interval (which method, its ends), the margin and what follows."""
    if not v.counted:
        return f"{v.suite}: {v.decision} (not counted): " + (
            f"{v.n} paired documents, too few for an interval." if v.n < 2 else f"{v.reasons[-1]}.")
    facts = (f"on {v.n} paired documents ({v.tokens:,} tokens) perplexity went {figures.perplexity(v.base_ppl)} -> "
             f"{figures.perplexity(v.variant_ppl)} ({figures.relative(v.change)}, higher in {v.worse_documents} of {v.n} "
             f"documents); a {v.interval} puts the change at [{figures.relative(v.ci_low)}, "
             f"{figures.relative(v.ci_high)}] with {v.confidence:.0%} confidence")
    bound = f"{figures.relative(v.margin)} (the margin for {v.suite})"
    if v.decision == GO:
        end = f"entirely below {bound}, so any rise is within the margin"
    elif v.decision == NO_GO:
        end = f"entirely above {bound}, so perplexity rises by more than the margin"
    else:
        end = f"which straddles {bound}, so the evidence settles nothing"
        if beyond_suite(v.documents_to_settle, v.available):
            end += f" ({cannot_settle(v.available, 'documents')})"
        elif v.documents_to_settle:
            end += f" (about {v.documents_to_settle} paired documents would likely settle it)"
    return f"{v.suite}: {v.decision}: {facts}, {end}."
