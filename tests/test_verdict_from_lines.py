"""Issue 46, items 1 and 2: the verdict is computed from the per-item lines, never from a summary it can recompute
(judge.json from judge.jsonl, kl.json from kl.jsonl, the long-context table from its lines), and a variant of
params.yaml without results is named, with what to run, and fails `--fail-on incomplete`. The refusals of values
outside their domain, each with its file, line and field, are in tests/test_bad_inputs.py (DOMAIN_CASES)."""

import json
import math
from html import unescape

import numpy as np
import pytest

from conftest import TINY_PARAMS, write_params
from pipeline.stages import report
from pipeline.errors import UserError
from pipeline.settings.params import Params
from pipeline.verdict.decision import TABLES_KEY
from report_fixture import demo_like, judge_line, write_judge
from test_bad_inputs import assert_refused, invoke
from test_report import write_results


def _verdict(tmp_path, params: dict) -> dict:
    results = tmp_path / "results"
    return report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=tmp_path / "models").verdict


def test_a_judge_json_whose_interval_its_pairs_do_not_give_is_refused_not_decided_on(tmp_path):
    """The finding: a counted judge.json with 4 wins and 0 losses but an interval of [-3, -2] turned fp8-w8a8 from
    GO to NO-GO. Its 4 pairs give [39.6 %, 100 %] (too few for a GO: INCONCLUSIVE); any other interval is refused
    with judge.json's line and key, whatever the decision it would give."""
    results, _, params = demo_like(tmp_path)
    assert _verdict(tmp_path, params)["variants"]["fp8-w8a8"]["decision"] == "GO"
    honest = write_judge(results / "fp8-w8a8", [judge_line(i, "win", control="tie") for i in range(4)])
    judged = _verdict(tmp_path, params)["variants"]["fp8-w8a8"]
    assert judged["judge"]["counted"] and judged["judge"]["decision"] == "INCONCLUSIVE"
    assert judged["decision"] == "INCONCLUSIVE" and judged["judge"]["summary"]["ci_low"] == pytest.approx(0.39577, abs=1e-5)
    path = results / "fp8-w8a8" / "judge.json"
    for low, high, expected in ((-3, -2, "ci_low: -3 is not a win rate (in [0, 1])"),
                                (0.1, 0.2, "ci_low: 0.1 is not what the 4 lines of")):
        path.write_text(json.dumps({**honest, "ci_low": low, "ci_high": high}, indent=2))
        line = next(n for n, text in enumerate(path.read_text().splitlines(), 1) if '"ci_low":' in text)
        with pytest.raises(UserError) as refused:
            _verdict(tmp_path, params)
        assert f"{path}:{line}: {expected}" in str(refused.value)
        assert "run `quantize judge models/fp8-w8a8` again" in str(refused.value)


def test_the_judges_figures_are_those_of_its_pairs_checked_against_peers(tmp_path):
    """judge.json without its figures (as an older one, or one trimmed by hand): the report computes them from
    judge.jsonl. Peers: the win rate and consistency counted by hand, the length bias against scipy's Pearson r,
    the noise floor from the control run's counts; at params.yaml's confidence (0.90 here, the judge ran at 0.95)."""
    from scipy.stats import pearsonr

    from pipeline.verdict.intervals import tango_interval

    rng = np.random.default_rng(46)
    outcomes = rng.choice(["win", "tie", "loss", "unjudged"], size=120, p=[0.5, 0.2, 0.2, 0.1])
    controls = rng.choice(["win", "tie", "loss"], size=120, p=[0.3, 0.4, 0.3])
    lines = [judge_line(i, o, consistent=not (o == "tie" and i % 3 == 0), length_diff=int(rng.integers(-50, 50)),
                        control=c) for i, (o, c) in enumerate(zip(outcomes, controls))]
    for model in ("base", "v"):
        write_results(tmp_path / "results", model, [1] * 120 + [0] * 80)
    stored = write_judge(tmp_path / "results" / "v", lines)
    (tmp_path / "results" / "v" / "judge.json").write_text(json.dumps(
        {k: v for k, v in stored.items() if k in ("mode", "judge", "weak_judge", "confidence")}))
    params = {**TINY_PARAMS, "variants": {"v": {"method": "rtn", "group_size": 32}},
              "verdict": {**TINY_PARAMS["verdict"], "confidence": 0.90}}
    shown = _verdict(tmp_path, params)["variants"]["v"]["judge"]["summary"]
    wins, ties, losses = (int((outcomes == o).sum()) for o in ("win", "tie", "loss"))
    judged = wins + ties + losses
    assert (shown["n"], shown["wins"], shown["ties"], shown["losses"], shown["unjudged"]) == (judged, wins, ties, losses, 120 - judged)
    assert shown["win_rate"] == pytest.approx((wins + ties / 2) / judged)
    low, high = tango_interval(wins, losses, judged, 0.90)
    assert (shown["ci_low"], shown["ci_high"], shown["confidence"]) == (pytest.approx(0.5 + low / 2), pytest.approx(0.5 + high / 2), 0.90)
    pairs = [line for line in lines if line["outcome"] != "unjudged"]
    assert shown["consistency"] == pytest.approx(sum(line["consistent"] for line in pairs) / len(pairs))
    score = {"win": 1.0, "tie": 0.5, "loss": 0.0}
    assert shown["length_bias"] == pytest.approx(pearsonr([line["length_diff"] for line in pairs],
                                                          [score[line["outcome"]] for line in pairs])[0])
    control_rate = (int((controls == "win").sum()) + int((controls == "tie").sum()) / 2) / 120
    assert shown["control_win_rate"] == pytest.approx(control_rate) and shown["noise_floor"] == pytest.approx(abs(control_rate - 0.5))


def test_the_kl_the_page_shows_agrees_with_every_tokens_value(tmp_path):
    """kl.json's figures are shown once kl.jsonl's per-token values give them (mean, numpy's linear 99th percentile,
    maximum, top-1 agreement); a summary that states other figures is refused with its line and key."""
    results, _, params = demo_like(tmp_path)
    kl_lines = [json.loads(line) for line in (results / "awq-w4a16" / "kl.jsonl").read_text().splitlines()]
    values = np.concatenate([line["kl"] for line in kl_lines])
    shown = _verdict(tmp_path, params)["variants"]["awq-w4a16"]["kl"]
    assert shown["tokens"] == values.size == 8 * 256
    assert (shown["kl_mean"], shown["kl_p99"], shown["kl_max"]) == (
        pytest.approx(values.mean()), pytest.approx(np.percentile(values, 99)), pytest.approx(values.max()))
    assert shown["top1_agreement"] == pytest.approx(sum(line["top1_agree"] for line in kl_lines) / values.size)
    path = results / "awq-w4a16" / "kl.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "kl_p99": shown["kl_p99"] * 1.01}, indent=2))
    with pytest.raises(UserError, match=r"kl\.json:5: kl_p99: .* is not what the 8 lines of .*kl\.jsonl give"):
        _verdict(tmp_path, params)


def test_documents_at_the_edge_of_their_domain_decide_without_a_traceback():
    """Any document lines the reader accepts (log-likelihood at most 0, at least -700 a token, 1 to 2^53 tokens) give
    a decision, a perplexity and a page row: two documents that disagree wildly put the interval's upper end past
    e^709, which is infinite (shown as a dash), not an OverflowError."""
    from pipeline.report.tables import document_rows
    from pipeline.verdict.decision import suite_score
    from pipeline.verdict.perplexity import compare_perplexity

    rng = np.random.default_rng(0)
    for _ in range(300):
        m = int(rng.integers(2, 5))
        tokens = [int(t) for t in rng.choice([1, 10, 2 ** 30, 2 ** 53], size=m)]
        base = {f"d{i}": {"loglikelihood": -float(rng.uniform(0, 700)) * t, "n_tokens": t} for i, t in enumerate(tokens)}
        variant = {f"d{i}": {"loglikelihood": -float(rng.uniform(0, 700)) * t, "n_tokens": t} for i, t in enumerate(tokens)}
        v = compare_perplexity(base, variant, variant="v", suite="s", margin=0.05)
        assert v.decision in ("GO", "NO-GO", "INCONCLUSIVE") and v.n == m and not math.isnan(v.change)
        assert math.isfinite(suite_score(base, True)["perplexity"]) and v.sentence
        assert len(document_rows({"base": {"s": base}, "v": {"s": variant}}, {"s"})["s"]) == m
    wild = compare_perplexity({"a": {"loglikelihood": -10.0, "n_tokens": 10}, "b": {"loglikelihood": -6990.0, "n_tokens": 10}},
                              {"a": {"loglikelihood": -6990.0, "n_tokens": 10}, "b": {"loglikelihood": -10.0, "n_tokens": 10}},
                              variant="v", suite="s", margin=0.05)
    assert wild.ci_high == math.inf and wild.decision == "INCONCLUSIVE" and "–]" in wild.sentence


def test_the_long_context_table_is_recomputed_from_its_lines(tmp_path):
    """long_context.json's table (score per length and needle depth) is what the page shows: it comes from the
    lines; an id that names no length and depth is refused with the file."""
    results = tmp_path / "results"
    for model in ("base", "v"):
        write_results(results, model, [1] * 120 + [0] * 80)
        lines = [{"id": f"needle-{length}-d{depth}-{r}", "score": float(r < depth // 25 + 1), "correct": r < depth // 25 + 1}
                 for length in (1024, 2048) for depth in (0, 50) for r in range(4)]
        (results / model / "long_context.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        (results / model / "long_context.json").write_text(json.dumps({"table": {
            "by_length_and_depth": {"1024": {"d0": {"n": 4, "score": 1.0}}}, "lengths_skipped": []}}))
    params = {**TINY_PARAMS, "variants": {"v": {"method": "rtn", "group_size": 32}},
              "suites": {**TINY_PARAMS["suites"], "long_context": {"task": "quant_long_context"}}}
    table = _verdict(tmp_path, params)[TABLES_KEY]["base"]["by_length_and_depth"]
    assert table == {str(n): {"d0": {"n": 4, "score": 0.25}, "d50": {"n": 4, "score": 0.75}} for n in (1024, 2048)}
    (results / "v" / "long_context.jsonl").write_text(json.dumps({"id": "needle-long", "score": 1.0, "correct": True}) + "\n")
    with pytest.raises(UserError, match="long_context.jsonl: id 'needle-long' is not kind-length-dDEPTH-repeat"):
        _verdict(tmp_path, params)


def test_a_variant_of_params_yaml_without_results_is_named_and_fails_incomplete(tmp_path, monkeypatch):
    """The finding: a params.yaml variant with no results/<variant> folder was left out of verdict.json and the
    page without a word. Now: fp8-w8a8 built but never evaluated, rtn-w4a16 never built, each named with its state
    and the commands, on the page, in show-verdict, and failed by --fail-on incomplete (only by it)."""
    for model in ("base", "awq-w4a16"):
        write_results(tmp_path / "results", model, [1] * 180 + [0] * 120)
    (tmp_path / "models" / "fp8-w8a8").mkdir(parents=True)
    (tmp_path / "models" / "fp8-w8a8" / "config.json").write_text("{}")
    params = {**TINY_PARAMS, "suites": {"math": TINY_PARAMS["suites"]["math"]}}
    write_params(tmp_path, params)
    monkeypatch.chdir(tmp_path)
    done = invoke(["report", "--fail-on", "inconclusive"])
    assert done.exit_code == 0, done.output  # awq-w4a16 is GO on everything the base ran
    assert "(awq-w4a16: GO, fp8-w8a8: not evaluated, rtn-w4a16: not built)" in done.output
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    missing = verdict["variants_without_results"]
    assert list(verdict["variants"]) == ["awq-w4a16"] and list(missing) == ["fp8-w8a8", "rtn-w4a16"]
    assert missing["fp8-w8a8"]["state"] == "not evaluated"
    assert missing["fp8-w8a8"]["commands"] == ["quantize eval models/fp8-w8a8", "quantize report"]
    assert missing["rtn-w4a16"]["state"] == "not built"
    assert missing["rtn-w4a16"]["commands"] == ["quantize variant rtn-w4a16", "quantize eval models/rtn-w4a16", "quantize report"]
    page = unescape((tmp_path / "reports" / "index.html").read_text())
    assert 'id="variants-without-results"' in page
    for name, m in missing.items():
        assert f"{name} {m['state']} ({m['why']}; run {', then '.join(m['commands'])})" in page.replace("<b>", "").replace(
            "</b>", "").replace("<code>", "").replace("</code>", "")
    gated = invoke(["report", "--fail-on", "incomplete"])
    assert gated.exit_code == 1 and "gate: fp8-w8a8, rtn-w4a16 did not pass --fail-on incomplete" in gated.output
    assert "rtn-w4a16: not built: no checkpoint in models/rtn-w4a16" in gated.output
    assert "then quantize eval models/rtn-w4a16, then quantize report" in gated.output
    shown = invoke(["show-verdict"])
    assert shown.exit_code == 0 and "\nfp8-w8a8: not evaluated: models/fp8-w8a8 is built" in shown.output


def test_a_broken_kl_or_judge_file_in_a_demo_like_tree_is_refused_through_the_cli(tmp_path, monkeypatch):
    """The command a CI runs, on the demo's tree: `quantize report` exits 2 with the file, line and key when
    kl.json states a negative mean, and 0 when every summary agrees with its lines."""
    results, _, params = demo_like(tmp_path)
    write_params(tmp_path, params)
    monkeypatch.chdir(tmp_path)
    assert invoke(["report", "--results", results, "--models", tmp_path / "models"]).exit_code == 0
    path = results / "rtn-w4a16" / "kl.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "kl_mean": -0.5}, indent=2))
    assert_refused(invoke(["report", "--results", results, "--models", tmp_path / "models"]),
                   [f"{path}:4: kl_mean: -0.5 is negative: a KL divergence is >= 0", "quantize kl models/rtn-w4a16"],
                   "kl_mean -0.5")


@pytest.mark.parametrize("suite, key, value", [
    ("math", "score", 0.9), ("math", "n", 21), ("ppl-book", "score", 1.0), ("ppl-book", "tokens", 81),
    ("ppl-book", "n", 7), ("math", "score", "0.5")])
def test_a_suite_summary_its_lines_do_not_give_is_refused(tmp_path, monkeypatch, suite, key, value):
    """Issue 70.6: math.json and ppl-*.json are checked against their lines, as kl.json and judge.json are (a corrupted
    summary passed the report unflagged)."""
    from test_bad_inputs import build_results, report_args

    build_results(tmp_path)
    monkeypatch.chdir(tmp_path)
    summaries = {}
    for name in ("math", "ppl-book"):
        lines = [json.loads(line) for line in (tmp_path / "results" / "awq-w4a16" / f"{name}.jsonl").read_text()
                 .splitlines()]
        summary = {"suite": name, "n": len(lines), "score": sum(line["score"] for line in lines) / len(lines)}
        if name == "ppl-book":
            tokens = sum(line["n_tokens"] for line in lines)
            summary.update(tokens=tokens, score=math.exp(-sum(line["loglikelihood"] for line in lines) / tokens))
        summaries[name] = summary
        (tmp_path / "results" / "awq-w4a16" / f"{name}.json").write_text(json.dumps(summary))
    assert invoke(report_args(tmp_path)).exit_code == 0  # the summaries as the evaluate stage writes them
    path = tmp_path / "results" / "awq-w4a16" / f"{suite}.json"
    path.write_text(json.dumps({**summaries[suite], key: value}))
    refused = invoke(report_args(tmp_path))
    assert refused.exit_code == 2, refused.output
    message = " ".join(refused.output.split())
    assert f"{path}" in message and f"{key}: " in message and "is not what the" in message
    assert f"run `quantize eval models/awq-w4a16 --suite {suite}` again" in message
