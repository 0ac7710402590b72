import json
from html import unescape

import pytest

from conftest import TINY_PARAMS, with_variants, write_params
from report_fixture import judge_line, write_judge
from pipeline.stages import report
from pipeline.settings.params import Params
from pipeline.verdict.decision import failing
from pipeline.verdict.speed import capacity_figures

XSS = ['<script>alert(1)</script>', '<img src=x onerror=alert(1)>', '<a href="javascript:alert(1)">x</a>', '<div><b>unclosed']


def write_results(root, variant, scores, outputs=None):
    (root / variant).mkdir(parents=True, exist_ok=True)
    lines = []
    for i, s in enumerate(scores):
        lines.append({"id": f"q{i}", "suite": "math", "variant": variant, "prompt": f"question {i} {XSS[i % 4]}",
                      "target": str(i), "output": (outputs or {}).get(i, f"answer {i}"), "score": float(s),
                      "correct": bool(s), "n_tokens": 5, "seconds": 0.1})
    (root / variant / "math.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))


def test_report_writes_verdict_and_escaped_self_contained_html(tmp_path):
    results = tmp_path / "results"
    base = [1] * 120 + [0] * 80
    write_results(results, "base", base)
    write_results(results, "copy", base)
    write_results(results, "broken", [0] * 200, outputs={0: XSS[0], 1: XSS[1], 2: "x" * (1 << 20)})
    params = Params.model_validate(with_variants(TINY_PARAMS, "copy", "broken"))
    out = report.run(results, tmp_path / "reports", params, models_dir=tmp_path / "models")
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    assert verdict["variants"]["copy"]["decision"] == "GO"
    assert verdict["variants"]["broken"]["decision"] == "NO-GO"
    assert len(verdict["variants"]["broken"]["suites"]["math"]["right_to_wrong"]) == 120
    # every decision comes with one checkable sentence, in verdict.json and on the page
    copy_math = verdict["variants"]["copy"]["suites"]["math"]
    assert copy_math["interval"] == "Tango's score interval with continuity correction"
    assert copy_math["sentence"].startswith("math: GO: on 200 paired items the variant turned 0 right answers wrong")
    assert "the margin for math" in copy_math["sentence"]
    assert verdict["variants"]["broken"]["suites"]["math"]["sentence"].startswith("math: NO-GO")
    html = out.html.read_text()
    for attack in XSS:
        assert attack not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "<script" not in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert 'id="row-copy"' in html and 'id="suite-table"' in html and 'id="forest"' in html
    # the first screen's matrix: a counted right/wrong suite in points, coloured by its decision
    assert '<td class="cell go" id="cell-copy-math" data-decision="GO"' in html
    assert '<td class="cell nogo" id="cell-broken-math" data-decision="NO-GO"' in html
    assert "-60.00 pts [" in html and "/ -3.00 pts · NO-GO</text>" in html  # broken: 120 of 200 right -> 0
    assert copy_math["sentence"] in unescape(html) and 'id="interval-method"' in html
    assert len(html) < 2_000_000  # the 1 MB output is clipped on the page (whole in the JSONL)
    assert failing(verdict, "no-go") == {"broken": "NO-GO"}
    assert failing(verdict, None) == {}


def test_the_gate_takes_each_variant_with_its_fix_at_every_level():
    """A variant and its fix are gated as one (docs/decision.md): the pair passes a level when either passes it."""
    from pipeline.verdict.decision import passed_by_fix

    def entry(decision, complete=True, **extra):
        suites = {"math": {"state": "decided"}, "code": {"state": "decided" if complete else "not run"}}
        return {"decision": decision, "coverage": {"complete": complete, "base_ran": ["math", "code"], "suites": suites},
                **extra}

    verdict = {"variants": {
        "v": entry("NO-GO", fix={"variant": "v-mixed"}), "v-mixed": entry("GO", complete=False, fix_of="v"),
        "w": entry("GO", fix={"variant": "w-mixed"}), "w-mixed": entry("NO-GO", fix_of="w"),
        "x": entry("INCONCLUSIVE", fix={"variant": "x-mixed"}), "x-mixed": entry("INCONCLUSIVE", fix_of="x"),
        "y": entry("NO-GO", fix={"variant": "y-mixed", "state": "not built"})}}
    assert failing(verdict, "no-go") == {"y": "NO-GO"}  # v through its fix; w needs none; x, x-mixed not NO-GO
    assert passed_by_fix(verdict, "no-go") == {"v": "v-mixed"}
    assert failing(verdict, "inconclusive") == {"x": "INCONCLUSIVE; its fix x-mixed: INCONCLUSIVE", "y": "NO-GO"}
    incomplete = failing(verdict, "incomplete")  # v's fix is GO on fewer suites than the base ran: no pass
    assert set(incomplete) == {"v", "x", "y"} and incomplete["v"].startswith("NO-GO; its fix v-mixed: GO, incomplete")
    assert passed_by_fix(verdict, "incomplete") == {}


def test_report_cli_gates_on_no_go(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    write_results(tmp_path / "results", "base", [1] * 50 + [0] * 50)
    write_results(tmp_path / "results", "bad", [0] * 100)
    write_params(tmp_path, with_variants(TINY_PARAMS, "bad"))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["report"]).exit_code == 0
    gated = runner.invoke(app, ["report", "--fail-on", "no-go"])
    assert gated.exit_code == 1 and "bad did not pass --fail-on no-go" in gated.output
    shown = runner.invoke(app, ["show-verdict"])  # what `make demo` prints last: what to ship, then the decisions
    assert shown.exit_code == 0 and shown.output.startswith("Ship none: bad NO-GO on math.\n")  # verdict.json's headline
    assert "\nbad: NO-GO on 1 accuracy suite; " in shown.output  # and what it rests on
    assert "\n  math: NO-GO: on 100 paired items the variant turned 50" in shown.output


def judge_pairs(wins: int = 5, ties: int = 10, losses: int = 25, disagreeing: int = 4) -> list[dict]:
    """judge.jsonl's pairs: `disagreeing` of the ties are pairs whose two orders disagreed; a control run at 50 %."""
    outcomes = ["win"] * wins + ["tie"] * ties + ["loss"] * losses
    return [judge_line(i, outcome, consistent=not (outcome == "tie" and i - wins < disagreeing), length_diff=i % 7,
                       control="tie") for i, outcome in enumerate(outcomes)]


def test_a_reliable_judge_counts_and_an_unreliable_one_does_not(tmp_path):
    results = tmp_path / "results"
    base = [1] * 120 + [0] * 80
    for name in ("base", "loses-judge", "shaky-judge"):
        write_results(results, name, base)
    write_judge(results / "loses-judge", judge_pairs())  # consistency 36 / 40
    write_judge(results / "shaky-judge", judge_pairs(wins=2, ties=30, losses=8, disagreeing=28))  # 12 / 40
    params = Params.model_validate(with_variants(TINY_PARAMS, "loses-judge", "shaky-judge"))
    verdict = report.run(results, tmp_path / "reports", params, models_dir=tmp_path / "models").verdict
    assert verdict["variants"]["loses-judge"]["judge"]["decision"] == "NO-GO"
    assert verdict["variants"]["loses-judge"]["decision"] == "NO-GO"  # suites GO, but the judge prefers the base
    shaky = verdict["variants"]["shaky-judge"]
    assert shaky["judge"]["decision"] == "UNRELIABLE" and not shaky["judge"]["counted"]
    assert shaky["decision"] == "GO"
    html = (tmp_path / "reports" / "index.html").read_text()
    assert 'id="judge-table"' in html and "the judge is unreliable" in html
    assert '<td class="cell nogo" id="cell-loses-judge-judge" data-decision="NO-GO"' in html  # a counted judge
    assert 'id="cell-shaky-judge-judge" data-decision=""' in html  # its column, but this judge is not counted
    assert "win 25.0% [14.8%, 39.0%] / ≥ 45.0% · NO-GO</text>" in html  # Tango's interval, from the 40 pairs
    sentence = verdict["variants"]["loses-judge"]["judge"]["sentence"]
    assert sentence.startswith("judge: NO-GO: of 40 judged pairs the judge preferred the variant in 5, the base in 25")
    assert "entirely below 45.0% (50% - margin 5.0%)" in sentence and sentence in unescape(html)
    assert verdict["variants"]["shaky-judge"]["judge"]["sentence"].startswith("judge: UNRELIABLE (not counted)")


def test_not_applicable_suite_is_shown_as_na_never_as_zero(tmp_path):
    results = tmp_path / "results"
    write_results(results, "base", [1] * 120 + [0] * 80)
    write_results(results, "v", [1] * 120 + [0] * 80)
    for model in ("base", "v"):
        (results / model / "vqa.jsonl").write_text("")
        (results / model / "vqa.json").write_text(json.dumps({"status": "not applicable", "n": 0, "score": None,
                                                               "reason": "text-only model"}))
    params = Params.model_validate(with_variants({**TINY_PARAMS, "suites": {**TINY_PARAMS["suites"], "vqa": {"task": "quant_vqa"}}}, "v"))
    verdict = report.run(results, tmp_path / "reports", params, models_dir=tmp_path / "models").verdict
    assert verdict["variants"]["v"]["not_applicable"] == {"vqa": "text-only model"}
    assert "vqa" not in verdict["variants"]["v"]["suites"] and verdict["variants"]["v"]["decision"] == "GO"
    assert "not applicable: text-only model" in (tmp_path / "reports" / "index.html").read_text()


def test_long_context_accuracy_by_length_and_skipped_lengths(tmp_path):
    results = tmp_path / "results"
    write_results(results, "base", [1] * 120 + [0] * 80)
    write_results(results, "v", [1] * 120 + [0] * 80)
    lc = {"max_context": 2048, "lengths_run": [1024],
          "lengths_skipped": [{"length": 4096, "reason": "beyond the model's context: needs ~4364 tokens, has 2048"}],
          "by_length_and_depth": {"1024": {"d0": {"n": 4, "score": 0.75}, "d50": {"n": 4, "score": 0.5}}},
          "by_kind": {}}
    (results / "base" / "long_context.json").write_text(json.dumps({"table": lc}))
    report.run(results, tmp_path / "reports", Params.model_validate(with_variants(TINY_PARAMS, "v")),
               models_dir=tmp_path / "models")
    html = (tmp_path / "reports" / "index.html").read_text()
    assert 'id="long-context-table"' in html
    assert "75.0% (4)" in html and "50.0% (4)" in html and "depth 50%" in html
    assert "skipped: beyond the model&#39;s context: needs ~4364 tokens, has 2048" in html


def test_every_result_run_without_isolation_is_flagged(tmp_path):
    """Issue 26: with allow_unsandboxed the model's code could read the host's files; every result it
    touches says so in verdict.json and on the page, compared with the base or not."""
    results = tmp_path / "results"
    write_results(results, "base", [1] * 120 + [0] * 80)
    write_results(results, "v", [1] * 120 + [0] * 80)
    write_results(results, "w", [1] * 120 + [0] * 80)
    lines = [{"id": f"c{i}", "score": 0.0, "correct": False, "isolated": False} for i in range(3)]
    (results / "v" / "code.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))  # base has no code results
    (results / "w" / "code.jsonl").write_text("".join(json.dumps({**l, "isolated": True} | ({} if i else {"isolated": None}))
                                                       + "\n" for i, l in enumerate(lines)))
    (results / "w" / "code.json").write_text(json.dumps({"sandbox": "rlimits+audit"}))  # the summary says so
    verdict = report.run(results, tmp_path / "reports", Params.model_validate(with_variants(TINY_PARAMS, "v", "w")),
                         models_dir=tmp_path / "models").verdict
    assert verdict["unsandboxed"] == ["v/code", "w/code"]
    for name in ("v", "w"):
        assert verdict["variants"][name]["reasons"][0].startswith(f"UNSANDBOXED: the model-written code of {name} ran")
    assert "unsandboxed" not in verdict["base"]["suites"]["math"]
    page = (tmp_path / "reports" / "index.html").read_text()
    assert "Run without isolation" in page and "v/code, w/code." in page


def test_folders_under_results_that_name_no_model_are_ignored_and_named(tmp_path, capsys):
    results = tmp_path / "results"
    write_results(results, "base", [1] * 120 + [0] * 80)
    write_results(results, "awq-w4a16", [1] * 120 + [0] * 80)
    write_results(results, "awq-w4a16 (copy)", [0] * 200)  # a copy, a typo: never a variant of its own
    write_results(results, ".ipynb_checkpoints", [0] * 200)
    verdict = report.run(results, tmp_path / "reports", Params.model_validate(TINY_PARAMS),
                         models_dir=tmp_path / "models").verdict
    assert list(verdict["variants"]) == ["awq-w4a16"]
    assert set(verdict["ignored_results"]) == {str(results / "awq-w4a16 (copy)"), str(results / ".ipynb_checkpoints")}
    assert "is neither base nor a variant in params.yaml" in verdict["ignored_results"][str(results / "awq-w4a16 (copy)")]
    assert "Not read: " in (tmp_path / "reports" / "index.html").read_text()


def test_each_inconclusive_says_what_to_run_and_about_how_long(tmp_path):
    """Item by item: the suite, how many items or documents would settle it, the commands, and the time at
    the speed the results were produced (the stage's start plus the scoring time per item, base and variant)."""
    from typer.testing import CliRunner

    from pipeline.cli.app import app
    from report_fixture import demo_like

    results, models, params = demo_like(tmp_path)
    verdict = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models).verdict
    awq = verdict["variants"]["awq-w4a16"]
    assert awq["perplexity"]["ppl-chat"]["decision"] == "INCONCLUSIVE"
    [step, judge] = awq["next_steps"]
    needed = awq["perplexity"]["ppl-chat"]["documents_to_settle"]
    assert step["suite"] == "ppl-chat" and step["now"] == 12 and step["needed"] == needed > 12 and step["counted"]
    assert step["commands"] == [f"quantize eval models/{m} --suite ppl-chat --limit {needed}" for m in ("base", "awq-w4a16")]
    # each model's ppl-chat.json: 14 s in all, 6 s of it scoring 12 documents
    assert step["seconds"] == pytest.approx(2 * (8 + 6 / 12 * needed), abs=0.1)
    assert f"suites.ppl-chat.limit: {needed}" in step["text"] and "dvc repro" in step["text"]
    held_out = Params.model_validate(params).calib.holdout  # ppl-chat reads the held-out conversations
    assert ("raise it to at least" in step["text"]) == (needed > held_out)
    assert judge["suite"] == "judge" and not judge["counted"] and "stronger model" in judge["text"]
    assert verdict["variants"]["rtn-w4a16"]["next_steps"] == []  # nothing open
    assert awq["why"] == "beyond the margin on ppl-book, ppl-code, ppl-math; ppl-chat open"
    assert verdict["variants"]["fp8-w8a8"]["why"] == "within the margin on all 4 counted suites"
    shown = CliRunner().invoke(app, ["show-verdict", str(tmp_path / "reports" / "verdict.json")])
    assert shown.exit_code == 0 and f"  to settle ppl-chat: 12 documents did not settle it; about {needed}" in shown.output
    # a right/wrong suite too small to ever show a GO asks for the items a GO needs
    write_results(tmp_path / "small", "base", [1] * 12 + [0] * 8)
    write_results(tmp_path / "small", "v", [1] * 12 + [0] * 8)
    (tmp_path / "small" / "base" / "math.json").write_text(json.dumps({"n": 20, "seconds": 50.0, "generate_seconds": 40.0}))
    (tmp_path / "small" / "v" / "math.json").write_text(json.dumps({"n": 20, "seconds": 50.0, "generate_seconds": 40.0}))
    small = report.run(tmp_path / "small", tmp_path / "r2", Params.model_validate(with_variants(TINY_PARAMS, "v")),
                       models_dir=tmp_path / "models").verdict["variants"]["v"]
    [step] = small["next_steps"]
    assert small["decision"] == "INCONCLUSIVE" and step["needed"] == small["suites"]["math"]["min_items_for_go"] == 185
    assert step["seconds"] == pytest.approx(2 * (10 + 2 * 185)) and "about 13 min" in step["text"]


def test_capacity_from_bench_json_is_read_when_numeric_and_left_out_otherwise():
    assert capacity_figures({"kv_cache_tokens": 1000, "weight_bytes": 5, "goodput_tok_s_per_gpu": "fast",
                             "max_context_batch1": float("nan"), "slo": {"ttft_ms": 200}}) == \
        {"kv_cache_tokens": 1000, "weight_bytes": 5, "slo": {"ttft_ms": 200}}
    assert capacity_figures(None) is None and capacity_figures({"kv_cache_tokens": True}) is None


def test_a_zero_margin_still_draws(tmp_path):
    results = tmp_path / "results"
    write_results(results, "base", [1] * 120 + [0] * 80)
    write_results(results, "v", [1] * 120 + [0] * 80)
    settings = json.loads(json.dumps(with_variants(TINY_PARAMS, "v")))
    settings["verdict"]["margins"]["suites"] = {"math": 0.0}
    out = report.run(results, tmp_path / "reports", Params.model_validate(settings), models_dir=tmp_path / "models")
    assert out.verdict["variants"]["v"]["suites"]["math"]["decision"] == "INCONCLUSIVE"
    assert "/ -0.00 pts · INCONCLUSIVE</text>" in out.html.read_text()
