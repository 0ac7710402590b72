"""Tango's score interval (pipeline.verdict.intervals.tango_interval) against a published worked example,
an independent implementation and closed forms, and its coverage in simulation: >= 500 datasets
per setting (here 4000), n from 10 to 1319, true changes 0, -margin and -3 x margin, discordance
rates down to where most small samples have no flip at all. The judge's win rate likewise.
`benchmarks/interval_coverage.py` prints the full table beside the old percentile bootstrap."""

import math
from statistics import NormalDist

import numpy as np
import pytest

from pipeline.verdict import intervals, judge as judge_rule

Z95 = NormalDist().inv_cdf(0.975)


def test_no_flip_interval_matches_its_closed_form():
    """With no discordant pair the score equation solves by hand: uncorrected |d| = z^2 / (n + z^2);
    corrected (n|d| - 1)^2 = z^2 n|d| (1 - |d|), a quadratic in u = n|d|."""
    for n in (1, 4, 10, 37, 100, 1319):
        low, high = intervals.tango_interval(0, 0, n, correction=0)
        assert high == pytest.approx(Z95 ** 2 / (n + Z95 ** 2), abs=1e-12) and low == pytest.approx(-high, abs=1e-12)
        a, b = 1 + Z95 ** 2 / n, 2 + Z95 ** 2
        u = (b + math.sqrt(b * b - 4 * a)) / (2 * a)
        low, high = intervals.tango_interval(0, 0, n)
        assert high == pytest.approx(min(u / n, 1.0), abs=1e-9) and low == pytest.approx(-high, abs=1e-9)


def test_score_at_no_change_is_mcnemars_statistic():
    """At d = 0 Tango's score is McNemar's z; with the continuity correction, the corrected one."""
    for improved, worsened in [(1, 7), (12, 9), (0, 5), (30, 0), (44, 61)]:
        n = 200
        plain = intervals.tango_score(improved, worsened, n, 0.0, correction=0)
        corrected = intervals.tango_score(improved, worsened, n, 0.0)
        assert plain ** 2 == pytest.approx((improved - worsened) ** 2 / (improved + worsened))
        assert corrected ** 2 == pytest.approx((abs(improved - worsened) - 1) ** 2 / (improved + worsened))
        try:
            from statsmodels.stats.contingency_tables import mcnemar
        except ImportError:
            continue
        table = [[50, worsened], [improved, 150 - improved - worsened]]
        assert corrected ** 2 == pytest.approx(mcnemar(table, exact=False, correction=True).statistic)
        assert plain ** 2 == pytest.approx(mcnemar(table, exact=False, correction=False).statistic)


def _independent_tango(improved: int, worsened: int, n: int, correction: float) -> tuple[float, float]:
    """Tango's interval from scratch: the constrained maximum likelihood by numerical optimisation
    (not the closed-form quadratic) and the ends by Brent's method (not bisection)."""
    from scipy.optimize import brentq, minimize_scalar

    rest = n - improved - worsened

    def score(change: float) -> float:
        lo, hi = max(0.0, -change), min(1.0, (1 - change) / 2)  # p_down, with p_up = p_down + change

        def nll(p: float) -> float:
            up, down = p + change, p
            terms = [(improved, up), (worsened, down), (rest, 1 - up - down)]
            return -sum(k * math.log(max(q, 1e-300)) for k, q in terms if k)

        p = minimize_scalar(nll, bounds=(lo, hi), method="bounded", options={"xatol": 1e-13}).x
        gap = improved - worsened - n * change
        gap = math.copysign(max(abs(gap) - 2 * correction, 0.0), gap)
        return gap / math.sqrt(n * (2 * p + change * (1 - change)))

    estimate = (improved - worsened) / n
    eps = 1e-9
    low = -1.0 if score(-1 + eps) < Z95 else brentq(lambda d: score(d) - Z95, -1 + eps, estimate, xtol=1e-12)
    high = 1.0 if score(1 - eps) > -Z95 else brentq(lambda d: score(d) + Z95, estimate, 1 - eps, xtol=1e-12)
    return low, high


@pytest.mark.parametrize("improved,worsened,n", [(1, 7, 21), (9, 12, 1319), (0, 4, 10), (3, 0, 50), (40, 20, 160),
                                                 (6, 16, 161), (2, 2, 30)])
def test_matches_an_independent_implementation(improved, worsened, n):
    for correction in (0.0, intervals.CONTINUITY):
        ours = intervals.tango_interval(improved, worsened, n, correction=correction)
        assert ours == pytest.approx(_independent_tango(improved, worsened, n, correction), abs=2e-5)


def test_published_worked_example_through_the_same_score():
    """Fagerland, Lydersen & Laake (2014) airway example, pairs (1, 1, 7, 12): R's ratesci documents
    pairbinci(x = c(1, 1, 7, 12)) = [-0.5281, -0.0184], Laud's skewness-corrected version of the same
    Tango score (variance x N/(N-1), Gart-Nam skewness term). Built on our constrained rates, it must
    reproduce that to the 4 published decimals, which checks the part every variant shares."""
    b, c, n = 1.0, 7.0, 21.0  # change p1 - p2 = (b - c) / n: b plays "improved", c "worsened"

    def scas(change: float) -> float:
        down = float(intervals._restricted_worsened_rate(b, c, n, change))
        up, same = down + change, 1 - 2 * down - change
        variance = (up + down - change ** 2) / n * n / (n - 1)
        third = (up * (1 - change) ** 3 + same * (-change) ** 3 + down * (-1 - change) ** 3) / n ** 2
        plain = ((b - c) / n - change) / math.sqrt(variance)
        skew = third / (6 * variance ** 1.5)
        return plain if abs(skew) < 1e-12 else (-1 + math.sqrt(max(0.0, 1 + 4 * skew * (plain + skew)))) / (2 * skew)

    from scipy.optimize import brentq

    low = brentq(lambda d: scas(d) - Z95, -0.99, -6 / 21)
    high = brentq(lambda d: scas(d) + Z95, -6 / 21, 0.99)
    assert (round(low, 4), round(high, 4)) == (-0.5281, -0.0184)
    # and ours, uncorrected, is the plain Tango interval on the same data
    assert intervals.tango_interval(1, 7, 21, correction=0) == pytest.approx(_independent_tango(1, 7, 21, 0.0), abs=1e-6)


# ---------------------------------------------------------------- coverage in simulation

DATASETS = 4000  # per setting (the issue asks >= 500); 4000 keeps the sampling error near 0.0035
MARGIN = 0.03


def _settings():
    """(n, true change, discordance rate): one-directional flips (rate = |change|), rare flips (many
    samples with none), common flips."""
    for n in (10, 30, 100, 300, 1319):
        for change in (0.0, -MARGIN, -3 * MARGIN):
            for discordance in sorted({abs(change), 0.02, 0.1, 0.3} - {0.0}):
                if discordance >= abs(change):
                    yield n, change, discordance


def _simulate(rng, n, p_up, p_down, size):
    counts = rng.multinomial(n, [p_up, p_down, 1 - p_up - p_down], size=size)
    return counts[:, 0], counts[:, 1]


def test_coverage_holds_at_every_n_including_zero_flip_samples():
    rng = np.random.default_rng(2024)
    settings = list(_settings())
    xs, ys, ns, truths = [], [], [], []
    for n, change, discordance in settings:
        p_down = (discordance - change) / 2
        x, y = _simulate(rng, n, p_down + change, p_down, DATASETS)
        xs.append(x), ys.append(y), ns.append(np.full(DATASETS, n)), truths.append(np.full(DATASETS, change))
    x, y, n, truth = map(np.concatenate, (xs, ys, ns, truths))
    low, high = intervals.tango_interval(x, y, n)  # all settings in one vectorised call
    covered = ((low <= truth + 1e-12) & (truth - 1e-12 <= high)).reshape(len(settings), DATASETS).mean(axis=1)
    report = {s: round(float(c), 4) for s, c in zip(settings, covered)}
    assert min(covered) >= 0.94, report
    zero_flips = (x == 0) & (y == 0)
    assert zero_flips[n == 10].mean() > 0.3  # the small-n settings do exercise samples without a flip
    assert not (low[zero_flips & (n == 10)] > -MARGIN).any()  # none of them would be GO: that needs 185 items


def test_false_go_is_rare_when_the_true_drop_equals_the_margin():
    rng = np.random.default_rng(7)
    for n in (10, 100, 1319):
        for discordance in (0.03, 0.1, 0.3):
            p_down = (discordance + MARGIN) / 2
            x, y = _simulate(rng, n, p_down - MARGIN, p_down, DATASETS)
            low, _ = intervals.tango_interval(x, y, n)
            assert (low > -MARGIN).mean() <= 0.03, (n, discordance)  # one side of a 95 % interval: 2.5 %


def test_judge_win_rate_interval_covers_from_4_to_200_pairs():
    rng = np.random.default_rng(11)
    rates = [(0.5, 0.0, 0.5), (0.3, 0.4, 0.3), (0.1, 0.8, 0.1), (0.6, 0.3, 0.1), (0.05, 0.15, 0.8), (0.9, 0.0, 0.1)]
    worst = {}
    for n in (4, 6, 10, 30, 100, 200):
        for win, tie, loss in rates:
            counts = rng.multinomial(n, [win, tie, loss], size=DATASETS)
            low, high = intervals.tango_interval(counts[:, 0], counts[:, 2], n)
            truth = win + tie / 2
            covered = ((0.5 + low / 2 <= truth + 1e-12) & (truth - 1e-12 <= 0.5 + high / 2)).mean()
            worst[(n, win, tie, loss)] = covered
    assert min(worst.values()) >= 0.94, worst
    one = judge_rule.win_rate(["win", "tie", "loss", "tie"])
    assert one["ci_method"] == judge_rule.WIN_RATE_INTERVAL and 0 <= one["ci_low"] < 0.5 < one["ci_high"] <= 1
