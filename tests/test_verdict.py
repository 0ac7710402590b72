import numpy as np
import pytest

from pipeline.verdict import decision as verdict_decision, intervals, paired


def items(scores, prefix="q"):
    return {f"{prefix}{i}": {"id": f"{prefix}{i}", "score": float(s), "correct": bool(s)} for i, s in enumerate(scores)}


def test_identical_outcomes_are_go_with_zero_delta():
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 2, 400)
    v = paired.compare_suite(items(scores), items(scores), variant="v", suite="math", margin=0.02)
    assert v.decision == intervals.GO
    # no flip is still evidence of limited size: the interval is [-w, +w], not [0, 0]
    assert v.delta == 0 and -0.02 < v.ci_low < 0 < v.ci_high == pytest.approx(-v.ci_low)
    assert v.right_to_wrong == [] and v.wrong_to_right == [] and v.p_value == 1.0
    assert v.interval == intervals.TANGO and v.min_items_for_go == 280
    assert v.sentence.startswith("math: GO: on 400 paired items the variant turned 0 right answers wrong")
    assert "entirely above -2.00 points (the margin for math)" in v.sentence


def test_ten_items_without_a_flip_are_never_go_and_say_how_many_items_a_go_needs():
    v = paired.compare_suite(items([1] * 6 + [0] * 4), items([1] * 6 + [0] * 4), variant="v", suite="math",
                              margin=0.03, floor_ceiling=0)
    assert v.decision == intervals.INCONCLUSIVE and v.ci_low < -0.3
    assert v.min_items_for_go == intervals.min_items_for_go(0.03) == 185
    assert any("a GO needs at least 185 paired items" in r for r in v.reasons)
    assert "below 185 items not even zero flips could show a GO" in v.sentence
    big = paired.compare_suite(items([1] * 111 + [0] * 74), items([1] * 111 + [0] * 74), variant="v",
                                suite="math", margin=0.03)
    assert big.n == 185 and big.decision == intervals.GO  # at the computed number, zero flips do show it


def test_a_clear_drop_on_a_small_suite_is_still_no_go():
    v = paired.compare_suite(items([1] * 20), items([0] * 20), variant="v", suite="math", margin=0.03,
                              floor_ceiling=0)
    assert v.decision == intervals.NO_GO and v.ci_high < -0.03
    assert not any("too few items" in r for r in v.reasons)


def test_clear_drop_is_no_go_with_flips_listed():
    base = [1] * 150 + [0] * 50
    var = [0] * 60 + [1] * 90 + [0] * 50  # 60 right->wrong
    v = paired.compare_suite(items(base), items(var), variant="v", suite="math", margin=0.02)
    assert v.decision == intervals.NO_GO
    assert len(v.right_to_wrong) == 60 and v.wrong_to_right == []
    assert v.ci_high < -0.02 and v.p_value < 1e-10
    assert v.recovery == pytest.approx(90 / 150)


def test_small_n_is_inconclusive_and_says_how_many_items_would_settle_it():
    base = [1, 0, 1, 1, 0, 1, 0, 1, 1, 0]
    var = [1, 0, 0, 1, 0, 1, 1, 1, 0, 0]
    v = paired.compare_suite(items(base), items(var), variant="v", suite="math", margin=0.02)
    assert v.decision == intervals.INCONCLUSIVE
    assert v.items_to_settle and v.items_to_settle > 10
    assert any("would likely settle" in r for r in v.reasons)
    # the number comes from the same interval: at that many items, with these flip rates, it settles
    n = v.items_to_settle
    low, high = intervals.tango_interval(n * 1 / 10, n * 2 / 10, n)
    assert high < -0.02 or low > -0.02
    low, high = intervals.tango_interval((n - 1) * 1 / 10, (n - 1) * 2 / 10, n - 1)
    assert low <= -0.02 <= high


def test_partial_credit_uses_a_t_interval_never_narrower_than_no_flip_and_the_bootstrap_only_outside_0_1():
    rng = np.random.default_rng(3)
    scores = rng.integers(0, 5, 300) / 4  # four sub-answers per item
    base = {f"q{i}": {"id": f"q{i}", "score": float(s), "correct": s == 1} for i, s in enumerate(scores)}
    same = paired.compare_suite(base, base, variant="v", suite="lc", margin=0.02, floor_ceiling=0)
    no_flip = intervals.tango_interval(0, 0, 300)
    assert same.interval == intervals.PARTIAL_CREDIT and (same.ci_low, same.ci_high) == pytest.approx(no_flip)
    assert same.decision == intervals.GO and same.p_value is None
    moved = {k: {**v, "score": max(0.0, v["score"] - 0.25 * (i % 2))} for i, (k, v) in enumerate(base.items())}
    drop = paired.compare_suite(base, moved, variant="v", suite="lc", margin=0.02, floor_ceiling=0)
    from scipy.stats import ttest_rel

    deltas = np.array([moved[k]["score"] - base[k]["score"] for k in sorted(base)])
    t_low, t_high = ttest_rel(deltas, np.zeros_like(deltas)).confidence_interval(0.95)  # scipy's own t interval
    assert t_high - t_low < no_flip[1] - no_flip[0]  # narrower than no flip: widened around the observed change
    assert (drop.ci_low, drop.ci_high) == pytest.approx((deltas.mean() + no_flip[0], deltas.mean() + no_flip[1]))
    assert drop.decision == intervals.NO_GO
    swung = {k: {**v, "score": 1.0 - v["score"] if i % 3 else v["score"]} for i, (k, v) in enumerate(base.items())}
    wide = paired.compare_suite(base, swung, variant="v", suite="lc", margin=0.02, floor_ceiling=0)
    deltas = np.array([swung[k]["score"] - base[k]["score"] for k in sorted(base)])
    t_low, t_high = ttest_rel(deltas, np.zeros_like(deltas)).confidence_interval(0.95)
    assert t_high - t_low > no_flip[1] - no_flip[0] and (wide.ci_low, wide.ci_high) == pytest.approx((t_low, t_high))
    bleu = {k: {**v, "score": 35.0} for k, v in base.items()}
    other = paired.compare_suite(bleu, bleu, variant="v", suite="bleu", margin=0.02, floor_ceiling=0)
    assert other.interval.startswith("percentile bootstrap") and other.min_items_for_go is None


def test_base_at_the_floor_is_shown_but_not_counted():
    base = [0] * 99 + [1]
    v = paired.compare_suite(items(base), items(base), variant="v", suite="math", margin=0.02)
    assert not v.counted and v.decision == intervals.UNINFORMATIVE
    assert "floor" in " ".join(v.reasons)
    decision, _ = verdict_decision.overall([v])
    assert decision == intervals.INCONCLUSIVE


def test_only_paired_items_count():
    base = items([1, 1, 1, 1])
    var = {k: v for k, v in items([1, 1, 1, 1]).items() if k != "q3"}
    v = paired.compare_suite(base, var, variant="v", suite="math", margin=0.02, floor_ceiling=0)
    assert v.n == 3 and any("only one model" in r for r in v.reasons)


def test_mcnemar_exact_matches_binomial():
    # 10 discordant pairs split 9/1: two-sided exact p = 2 * P(X <= 1 | n=10, p=.5) = 22/1024
    assert intervals.mcnemar_exact(9, 1) == pytest.approx(22 / 1024)
    assert intervals.mcnemar_exact(0, 0) == 1.0


def test_mcnemar_exact_matches_scipy_and_statsmodels():
    from scipy.stats import binomtest

    pairs = [(b, c) for b in range(0, 25, 3) for c in range(0, 25, 4)] + [(0, 1), (1, 1), (50, 61), (120, 80)]
    for b, c in pairs:
        if b + c:
            assert intervals.mcnemar_exact(b, c) == pytest.approx(binomtest(b, b + c, 0.5).pvalue, rel=1e-9)
    from statsmodels.stats.contingency_tables import mcnemar  # a dev dependency (pyproject.toml)

    for b, c in pairs:
        expected = mcnemar([[7, b], [c, 9]], exact=True).pvalue
        assert intervals.mcnemar_exact(b, c) == pytest.approx(min(expected, 1.0), rel=1e-9)


def test_overall_rules():
    mk = lambda d: paired.SuiteVerdict("v", d, 10, .5, .5, 0, 0, 0, .95, 1, [], [], None, .02, d, True)  # noqa: E731
    assert verdict_decision.overall([mk(intervals.GO), mk(intervals.GO)])[0] == intervals.GO
    assert verdict_decision.overall([mk(intervals.GO), mk(intervals.NO_GO)])[0] == intervals.NO_GO
    assert verdict_decision.overall([mk(intervals.GO), mk(intervals.INCONCLUSIVE)])[0] == intervals.INCONCLUSIVE
