"""Perplexity suites in the verdict: the paired interval against an independent computation and by
simulation, the decision against the margin, and the report's table and AWQ-vs-RTN comparison."""

import json
import math

import numpy as np
import pytest

from conftest import TINY_PARAMS
from pipeline.stages import report
from pipeline.verdict import intervals, perplexity as perplexity_verdict
from pipeline.settings.params import Params


def documents(loglikelihoods, tokens, prefix="doc"):
    return {f"{prefix}{i}": {"id": f"{prefix}{i}", "suite": "ppl-book", "prompt": f"text {i} <b>x</b>", "target": "",
                             "output": "", "score": math.exp(-ll / n), "correct": None, "loglikelihood": float(ll),
                             "n_tokens": int(n), "seconds": None}
            for i, (ll, n) in enumerate(zip(loglikelihoods, tokens))}


def simulated(rng, m, rise, spread=0.02, noise=0.5):
    """m documents of 100-400 tokens; the variant's per-token NLL is higher by log(1 + rise) on
    average, each document by its own amount (spread) plus token-level noise."""
    tokens = rng.integers(100, 400, size=m)
    base_nll = tokens * rng.uniform(2.5, 3.5, size=m)
    shift = tokens * (math.log1p(rise) + rng.normal(0, spread, size=m)) + np.sqrt(tokens) * rng.normal(0, noise, size=m)
    return -base_nll, -(base_nll + shift), tokens


def test_interval_equals_statsmodels_wls_with_hc2_errors():
    """The ratio estimator and its standard error are statsmodels' weighted least-squares fit of the
    per-document NLL change on token count (weights 1/tokens, no intercept) with HC2 sandwich errors;
    the t quantile is at the Bell-McCaffrey degrees of freedom (checked separately below)."""
    import statsmodels.api as sm
    from scipy import stats as scipy_stats

    rng = np.random.default_rng(3)
    base, var, tokens = simulated(rng, 17, rise=0.04)
    deltas = base - var
    estimate, low, high = perplexity_verdict.ratio_interval(deltas, tokens.astype(float), 0.95)
    fit = sm.WLS(deltas, tokens.astype(float)[:, None], weights=1 / tokens).fit(cov_type="HC2")
    t = scipy_stats.t.ppf(0.975, perplexity_verdict.bell_mccaffrey_df(tokens))
    assert estimate == pytest.approx(fit.params[0], rel=1e-12)
    se = fit.bse[0]
    assert (low, high) == (pytest.approx(fit.params[0] - t * se, rel=1e-9), pytest.approx(fit.params[0] + t * se, rel=1e-9))
    assert high - low > 2 * scipy_stats.t.ppf(0.975, 16) * se  # fewer degrees of freedom than m - 1: wider


def _dense_bell_mccaffrey(tokens):
    """(tr A)^2 / tr(A^2) from A's eigenvalues, A the HC2 variance as a quadratic form in unit errors."""
    n = np.asarray(tokens, dtype=float)
    m, total = len(n), n.sum()
    residual_maker = np.eye(m) - np.outer(n, np.ones(m)) / total
    found = []
    for scale in (np.sqrt(n), n):
        b = residual_maker * scale[None, :]
        eig = np.linalg.eigvalsh(b.T @ np.diag(1 / (1 - n / total)) @ b)
        found.append(eig.sum() ** 2 / (eig ** 2).sum())
    return min(found)


@pytest.mark.parametrize("m", [2, 3, 5, 17, 120])
def test_bell_mccaffrey_degrees_of_freedom_closed_form_equals_the_eigenvalues(m):
    tokens = np.random.default_rng(m).integers(10, 900, size=m)
    assert perplexity_verdict.bell_mccaffrey_df(tokens) == pytest.approx(_dense_bell_mccaffrey(tokens), rel=1e-9)
    assert perplexity_verdict.bell_mccaffrey_df(np.full(m, 300)) == pytest.approx(m - 1, rel=1e-9)  # equal documents
    assert perplexity_verdict.bell_mccaffrey_df(tokens) <= m - 1 + 1e-9


@pytest.mark.parametrize("m", [5, 12, 40])
def test_interval_covers_the_true_change_in_simulation(m):
    rng = np.random.default_rng(m)
    truth = math.log1p(0.05)
    covered = 0
    runs = 1000
    for _ in range(runs):
        base, var, tokens = simulated(rng, m, rise=0.05)
        _, low, high = perplexity_verdict.ratio_interval(base - var, tokens.astype(float), 0.95)
        covered += low <= truth <= high
    print(f"coverage at {m} documents: {covered / runs:.3f}")
    assert covered / runs >= 0.935  # 1000 runs: Monte Carlo error ~0.007; the benchmark measures >= 0.945


def test_decisions_against_the_margin():
    rng = np.random.default_rng(0)
    base, same, tokens = simulated(rng, 30, rise=0.0, spread=0.005, noise=0.1)
    go = perplexity_verdict.compare_perplexity(documents(base, tokens), documents(same, tokens), variant="v", suite="ppl-book",
                                    margin=0.05)
    assert go.decision == intervals.GO and go.ci_high < 0.05 and go.counted
    base, worse, tokens = simulated(rng, 30, rise=0.20, spread=0.005, noise=0.1)
    nogo = perplexity_verdict.compare_perplexity(documents(base, tokens), documents(worse, tokens), variant="v",
                                      suite="ppl-book", margin=0.05)
    assert nogo.decision == intervals.NO_GO and nogo.ci_low > 0.05
    assert nogo.change == pytest.approx(nogo.variant_ppl / nogo.base_ppl - 1)
    assert nogo.worse_documents == 30 and "lies above +5.0%" in " ".join(nogo.reasons)
    base, near, tokens = simulated(rng, 4, rise=0.05, spread=0.05)
    open_ = perplexity_verdict.compare_perplexity(documents(base, tokens), documents(near, tokens), variant="v",
                                       suite="ppl-book", margin=0.05)
    assert open_.decision == intervals.INCONCLUSIVE and open_.documents_to_settle > 4
    one = perplexity_verdict.compare_perplexity(documents(base[:1], tokens[:1]), documents(near[:1], tokens[:1]), variant="v",
                                     suite="ppl-book", margin=0.05)
    assert one.decision == intervals.INCONCLUSIVE and not one.counted


def test_documents_of_other_lengths_or_one_model_only_are_left_out():
    base = documents([-300.0, -310.0, -290.0, -305.0], [100, 100, 100, 100])
    var = documents([-303.0, -313.0, -293.0, -308.0], [100, 101, 100, 100])
    del var["doc3"]
    v = perplexity_verdict.compare_perplexity(base, var, variant="v", suite="ppl-book", margin=0.05)
    assert v.n == 2 and v.tokens == 200
    assert any("different lengths" in r for r in v.reasons) and any("only one model" in r for r in v.reasons)


def _write(root, model, suite, docs):
    (root / model).mkdir(parents=True, exist_ok=True)
    (root / model / f"{suite}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs.values()))


def test_report_counts_perplexity_suites_and_compares_awq_with_rtn(tmp_path):
    rng = np.random.default_rng(7)
    results, models = tmp_path / "results", tmp_path / "models"
    base, fp8, tokens = simulated(rng, 20, rise=0.01, spread=0.005, noise=0.1)
    shift = np.log1p(0.12) * tokens
    awq = base - shift
    rtn = base - 1.6 * shift
    for model, lls in [("base", base), ("fp8-w8a8", fp8), ("awq-w4a16", awq), ("rtn-w4a16", rtn)]:
        _write(results, model, "ppl-book", documents(lls, tokens))
    for name, quant in [("awq-w4a16", {"method": "awq", "group_size": 64}), ("rtn-w4a16", {"method": "rtn", "group_size": 64}),
                        ("fp8-w8a8", {"method": "fp8"})]:
        (models / name).mkdir(parents=True)
        (models / name / "quant.json").write_text(json.dumps({**quant, "scheme": name, "size_bytes": 1, "quantized_modules": 1,
                                                             "calibration": {"blocks": 1, "seq_len": 1, "sha256": "0" * 64},
                                                             "seconds": {"total": 1}, "device": "cpu", "peak_rss_bytes": 1,
                                                             "ignored": {}, "verify": {"reloads": True, "sample": "",
                                                                                       "vision": {"vision_tensors": 0, "mismatched": []}}}))
    settings = json.loads(json.dumps(TINY_PARAMS))
    settings["suites"] = {"ppl-book": {"task": "quant_ppl_book"}}
    settings["variants"]["rtn-w4a16"] = {"method": "rtn", "group_size": 32}
    settings["verdict"]["margins"]["suites"]["ppl-book"] = 0.05
    out = report.run(results, tmp_path / "reports", Params.model_validate(settings), models_dir=models)
    variants = out.verdict["variants"]
    assert variants["fp8-w8a8"]["decision"] == "GO" and variants["awq-w4a16"]["decision"] == "NO-GO"
    assert variants["fp8-w8a8"]["perplexity"]["ppl-book"]["counted"] and variants["fp8-w8a8"]["suites"] == {}
    [comparison] = out.verdict["method_comparisons"]
    assert comparison["better"] == "awq-w4a16" and comparison["ci_high"] < 0 and comparison["suite"] == "ppl-book"
    assert (comparison["variant"], comparison["against"]) == ("awq-w4a16", "rtn-w4a16")  # pipeline/methods/awq.py
    assert comparison["change"] == pytest.approx(comparison["variant_ppl"] / comparison["against_ppl"] - 1)
    assert out.verdict["metrics"]["awq-w4a16"]["ppl-book"]["change"] > 0.05
    html = out.html.read_text()
    assert 'id="perplexity-table"' in html and 'id="method-table"' in html
    assert "<b>x</b>" not in html and "&lt;b&gt;x&lt;/b&gt;" in html  # document text escaped
    assert html.count('<th scope="row">ppl-book</th><td>fp8-w8a8</td>') == 1


def test_show_verdict_prints_perplexity_suites(tmp_path):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    path = tmp_path / "verdict.json"
    path.write_text(json.dumps({"variants": {"awq": {"decision": "NO-GO", "suites": {}, "perplexity": {"ppl-book": {
        "base_ppl": 10.0, "variant_ppl": 11.5, "change": 0.15, "ci_low": 0.12, "ci_high": 0.18, "margin": 0.05,
        "decision": "NO-GO"}}}}}))
    result = CliRunner().invoke(app, ["show-verdict", str(path)])
    assert result.exit_code == 0
    assert "ppl-book: perplexity 10.000 -> 11.500 (change +15.0%, interval [+12.0%, +18.0%], margin +5.0%): NO-GO" in result.output
