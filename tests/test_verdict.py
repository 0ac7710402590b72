import numpy as np
import pytest

from pipeline import verdict


def items(scores, prefix="q"):
    return {f"{prefix}{i}": {"id": f"{prefix}{i}", "score": float(s), "correct": bool(s)} for i, s in enumerate(scores)}


def test_identical_outcomes_are_go_with_zero_delta():
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 2, 400)
    v = verdict.compare_suite(items(scores), items(scores), variant="v", suite="math", margin=0.02)
    assert v.decision == verdict.GO
    assert v.delta == 0 and v.ci_low == 0 and v.ci_high == 0
    assert v.right_to_wrong == [] and v.wrong_to_right == [] and v.p_value == 1.0


def test_clear_drop_is_no_go_with_flips_listed():
    base = [1] * 150 + [0] * 50
    var = [0] * 60 + [1] * 90 + [0] * 50  # 60 right->wrong
    v = verdict.compare_suite(items(base), items(var), variant="v", suite="math", margin=0.02)
    assert v.decision == verdict.NO_GO
    assert len(v.right_to_wrong) == 60 and v.wrong_to_right == []
    assert v.ci_high < -0.02 and v.p_value < 1e-10
    assert v.recovery == pytest.approx(90 / 150)


def test_small_n_is_inconclusive_and_says_how_many_items_would_settle_it():
    base = [1, 0, 1, 1, 0, 1, 0, 1, 1, 0]
    var = [1, 0, 0, 1, 0, 1, 1, 1, 0, 0]
    v = verdict.compare_suite(items(base), items(var), variant="v", suite="math", margin=0.02)
    assert v.decision == verdict.INCONCLUSIVE
    assert v.items_to_settle and v.items_to_settle > 10
    assert any("would likely settle" in r for r in v.reasons)


def test_base_at_the_floor_is_shown_but_not_counted():
    base = [0] * 99 + [1]
    v = verdict.compare_suite(items(base), items(base), variant="v", suite="math", margin=0.02)
    assert not v.counted and v.decision == verdict.UNINFORMATIVE
    assert "floor" in " ".join(v.reasons)
    decision, _ = verdict.overall([v])
    assert decision == verdict.INCONCLUSIVE


def test_only_paired_items_count():
    base = items([1, 1, 1, 1])
    var = {k: v for k, v in items([1, 1, 1, 1]).items() if k != "q3"}
    v = verdict.compare_suite(base, var, variant="v", suite="math", margin=0.02, floor_ceiling=0)
    assert v.n == 3 and any("only one model" in r for r in v.reasons)


def test_mcnemar_exact_matches_binomial():
    # 10 discordant pairs split 9/1: two-sided exact p = 2 * P(X <= 1 | n=10, p=.5) = 22/1024
    assert verdict.mcnemar_exact(9, 1) == pytest.approx(22 / 1024)
    assert verdict.mcnemar_exact(0, 0) == 1.0


def test_overall_rules():
    mk = lambda d: verdict.SuiteVerdict("v", d, 10, .5, .5, 0, 0, 0, .95, 1, [], [], None, .02, d, True)  # noqa: E731
    assert verdict.overall([mk(verdict.GO), mk(verdict.GO)])[0] == verdict.GO
    assert verdict.overall([mk(verdict.GO), mk(verdict.NO_GO)])[0] == verdict.NO_GO
    assert verdict.overall([mk(verdict.GO), mk(verdict.INCONCLUSIVE)])[0] == verdict.INCONCLUSIVE
