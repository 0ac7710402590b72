"""Issue 33: the report says what each decision rests on (coverage), states recovery as model cards do, gates on
an incomplete decision, formats each kind of figure one way, and refuses to decide nothing."""

import json
import re
from html.parser import HTMLParser
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TINY_PARAMS, write_params
from pipeline.stages import report
from pipeline.settings.params import Params
from pipeline.settings import suites
from pipeline.verdict.recovery import average_recovery
from report_fixture import demo_like, write_kl
from test_bad_inputs import assert_refused, invoke, snapshot
from test_report import write_results

EVALS = Path(__file__).resolve().parent.parent / "evals"


def test_the_shipped_suites_are_the_task_files_under_evals():
    """Every task YAML under evals/ is a suite the registry knows (the coverage names it "not configured" when
    params.yaml leaves it out), under the name params.yaml gives it."""
    shipped = {path.stem for path in EVALS.rglob("quant_*.yaml")}
    assert set(suites.shipped()) == shipped
    assert {s.name for s in suites.shipped().values()} == {"math", "math-hard", "code", "long_context", "vqa", "ppl-chat",
                                                             "ppl-book", "ppl-math", "ppl-code", "charts", "documents",
                                                             "small_text", "counting"}


def test_each_suite_is_decided_not_counted_not_run_not_applicable_or_not_configured(tmp_path):
    results, models, params = demo_like(tmp_path)
    verdict = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models).verdict
    fp8, awq, rtn = (verdict["variants"][v]["coverage"] for v in ("fp8-w8a8", "awq-w4a16", "rtn-w4a16"))
    # the example: a GO on perplexity alone says so, and why the rest is missing
    assert fp8["line"] == ("GO on 4 perplexity suites; math, code not run; judge shown, not counted; vqa not applicable; "
                           "6 suites not configured")
    assert [s for s, e in fp8["suites"].items() if e["state"] == "not configured"] == [
        "long_context", "math-hard", "charts", "counting", "documents", "small_text"]  # each named in its entry
    assert fp8["suites"]["math"] == {"state": "not run", "key": "suites.math.models", "label": "not run",
                                     "why": "suites.math.models (base, awq-w4a16) leaves out fp8-w8a8"}
    assert fp8["suites"]["vqa"]["state"] == "not applicable" and "has no vision tower" in fp8["suites"]["vqa"]["why"]
    assert fp8["suites"]["long_context"]["key"] == "suites.long_context"
    assert "quant_long_context" in fp8["suites"]["long_context"]["why"]
    assert fp8["suites"]["ppl-chat"] == {"state": "decided", "kind": "perplexity", "decision": "GO", "label": "decided"}
    assert fp8["decided"] == ["ppl-book", "ppl-chat", "ppl-code", "ppl-math"]
    assert fp8["base_ran"] == ["math", "code", *fp8["decided"]] and not fp8["complete"]
    # AWQ ran math and code, but the base sits at the floor there: shown, not counted, and why
    assert awq["suites"]["math"]["state"] == "not counted" and awq["suites"]["math"]["decision"] == "UNINFORMATIVE"
    assert awq["suites"]["math"]["why"] == "the base model scores 5.0%, at the floor"
    assert awq["line"].startswith("NO-GO on 4 perplexity suites; math, code, judge shown, not counted;")
    # RTN has no judge.json: not run, and the command that runs it
    assert rtn["suites"]["judge"]["state"] == "not run" and "`quantize judge models/rtn-w4a16`" in rtn["suites"]["judge"]["why"]
    page = (tmp_path / "reports" / "index.html").read_text()
    assert 'id="coverage-table"' in page and 'id="coverage-fp8-w8a8-math"' in page
    assert "<code>suites.math.models</code>: suites.math.models (base, awq-w4a16) leaves out fp8-w8a8" in page
    assert "&lt;script&gt;" in page and "<script" not in page  # the n/a reason, escaped


def _code_results(results: Path, model: str, scores: list[int]) -> None:
    write_results(results, model, scores)
    lines = (results / model / "math.jsonl").read_text().replace('"suite": "math"', '"suite": "code"')
    (results / model / "code.jsonl").write_text(lines)
    (results / model / "math.jsonl").unlink()


def test_fail_on_incomplete_fails_a_go_that_rests_on_fewer_suites_than_the_base_ran(tmp_path, monkeypatch):
    """awq-w4a16 runs math and code, fp8-w8a8 only math (suites.code.models); both are GO on what they ran
    (300 unchanged items: enough for a GO at code's 2-point margin)."""
    scores = [1] * 180 + [0] * 120
    for model in ("base", "awq-w4a16", "fp8-w8a8"):
        if model != "fp8-w8a8":
            _code_results(tmp_path / "results", model, scores)
        write_results(tmp_path / "results", model, scores)
    evaluated = {name: TINY_PARAMS["variants"][name] for name in ("awq-w4a16", "fp8-w8a8")}
    write_params(tmp_path, {**TINY_PARAMS, "variants": evaluated})  # a variant without results fails too: below
    monkeypatch.chdir(tmp_path)
    passed = invoke(["report", "--fail-on", "inconclusive"])
    assert passed.exit_code == 0, passed.output  # both GO
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    assert verdict["variants"]["awq-w4a16"]["coverage"]["complete"]
    assert verdict["variants"]["fp8-w8a8"]["coverage"]["line"].startswith("GO on 1 accuracy suite; code, ")
    gated = invoke(["report", "--fail-on", "incomplete"])
    assert gated.exit_code == 1
    assert "gate: fp8-w8a8 did not pass --fail-on incomplete" in gated.output
    assert "fp8-w8a8: GO, incomplete: decided on 1 of the 2 suites the base ran; code not run" in gated.output
    assert "awq-w4a16" not in gated.output.split("gate:")[1]  # complete: it passes
    assert_refused(invoke(["report", "--fail-on", "partial"]), ["--fail-on partial: use no-go, inconclusive or incomplete"],
                   "an unknown gate")


def test_a_report_with_no_variant_to_decide_exits_2_names_what_it_ignored_and_writes_nothing(tmp_path, monkeypatch):
    results = tmp_path / "results"
    write_results(results, "base", [1] * 120 + [0] * 80)
    write_results(results, "awq-w4a16 (copy)", [1] * 120 + [0] * 80)  # a copy: ignored, never a variant
    (results / "fp8-w8a8").mkdir()  # a variant of params.yaml with nothing to compare yet
    write_kl(results / "fp8-w8a8", kl_mean=0.1, top1=0.9)
    write_params(tmp_path, TINY_PARAMS)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    out = assert_refused(invoke(["report"]), [
        "results: no variant to decide: params.yaml names awq-w4a16, fp8-w8a8, rtn-w4a16",
        "read: results/fp8-w8a8 (no <suite>.jsonl of a suite in params.yaml)",
        "ignored: results/awq-w4a16 (copy): 'awq-w4a16 (copy)' is neither base nor a variant in params.yaml",
        "no report was written"], "no variant")
    assert "Traceback" not in out and snapshot(tmp_path) == before and not (tmp_path / "reports").exists()


def test_recovery_is_the_model_cards_variant_over_base_per_suite_and_on_average():
    """Peer: the OpenLLM v1 table of Neural Magic's Meta-Llama-3-70B-Instruct-quantized.w8a16 card (base and
    quantized score per task, and the card's "Average Accuracy" row: 79.18 % and 77.90 %). Our average recovery is
    the ratio of those averages; a suite not counted is left out of it and named."""
    card = {"arc-c": (72.44, 71.59), "hellaswag": (85.54, 85.65), "mmlu": (80.18, 78.69), "truthfulqa": (62.92, 61.94),
            "winogrande": (83.19, 83.11), "gsm8k": (90.83, 86.43)}
    suites = [SimpleNamespace(suite=name, counted=True, n=100, base_score=b / 100, variant_score=v / 100)
              for name, (b, v) in card.items()]
    floor = SimpleNamespace(suite="math", counted=False, n=20, base_score=0.05, variant_score=0.0)
    found = average_recovery([*suites, floor])
    assert round(found["base_mean"] * 100, 2) == 79.18 and round(found["variant_mean"] * 100, 2) == 77.90  # the card's
    assert found["accuracy"] == pytest.approx(77.9017 / 79.1833, abs=1e-5) and round(found["accuracy"] * 100, 1) == 98.4
    assert found["suites"] == list(card) and found["left_out"] == {"math": "not counted (the base at the floor or ceiling)"}
    assert average_recovery([floor])["accuracy"] is None


def test_recovery_in_verdict_json_beside_each_paired_change(tmp_path):
    from pipeline.verdict.paired import compare_suite
    from pipeline.verdict.perplexity import compare_perplexity

    items = lambda scores: {f"q{i}": {"score": float(s), "correct": bool(s)} for i, s in enumerate(scores)}  # noqa: E731
    v = compare_suite(items([1] * 120 + [0] * 80), items([1] * 114 + [0] * 86), variant="v", suite="math", margin=0.03)
    assert v.recovery == pytest.approx(114 / 120)
    docs = lambda nll: {f"d{i}": {"loglikelihood": -x, "n_tokens": 100} for i, x in enumerate(nll)}  # noqa: E731
    ppl = compare_perplexity(docs([200, 210, 190]), docs([220, 230, 200]), variant="v", suite="ppl-book", margin=0.1)
    assert ppl.recovery == pytest.approx(ppl.base_ppl / ppl.variant_ppl) and ppl.recovery == pytest.approx(1 / (1 + ppl.change))
    results, models, params = demo_like(tmp_path)
    verdict = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models).verdict
    fp8 = verdict["variants"]["fp8-w8a8"]
    assert fp8["perplexity"]["ppl-book"]["recovery"] == pytest.approx(1 / (1 + fp8["perplexity"]["ppl-book"]["change"]))
    assert fp8["recovery"]["accuracy"] is None and fp8["recovery"]["suites"] == []  # no accuracy suite counted
    assert verdict["variants"]["awq-w4a16"]["suites"]["math"]["recovery"] == 0.0  # 5 % -> 0 %, shown per suite
    assert set(verdict["variants"]["awq-w4a16"]["recovery"]["left_out"]) == {"math", "code"}


class _Cells(HTMLParser):
    """{table id: [[cell text, ...] per body row]}."""

    def __init__(self):
        super().__init__()
        self.tables, self.table, self.row, self.cell = {}, None, None, None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "table":
            self.table = self.tables.setdefault(attrs.get("id") or f"table-{len(self.tables)}", [])
        elif tag == "tr" and self.table is not None:
            self.row = []
        elif tag in ("td", "th") and self.row is not None:
            self.cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self.cell is not None:
            self.row.append(" ".join("".join(self.cell).split()))
            self.cell = None
        elif tag == "tr" and self.row is not None:
            self.table.append(self.row)
            self.row = None
        elif tag == "table":
            self.table = None

    def handle_data(self, data):
        if self.cell is not None:
            self.cell.append(data)


SHARE, POINTS, RELATIVE = r"\d+\.\d%", r"[+-]\d+\.\d\d", r"[+-]\d+\.\d%"
PPL, KL = r"\d+\.\d{3}", r"\d\.\d{4}"


def test_one_number_format_per_kind_of_figure(tmp_path):
    """Accuracy and recovery as 45.0%, changes in accuracy as +1.23 points, perplexity as 12.345, its change as
    +2.7%, KL as 0.0560: the same in every table, the first screen and the sentences."""
    results, models, params = demo_like(tmp_path)
    out = report.run(results, tmp_path / "reports", Params.model_validate(params), models_dir=models)
    parser = _Cells()
    parser.feed(out.html.read_text())
    columns = {"suite-table": {3: SHARE, 4: SHARE, 5: POINTS, 6: rf"\[{POINTS}, {POINTS}\]", 7: POINTS, 8: rf"{SHARE}|–"},  # no recovery when the base scores 0
               "perplexity-table": {4: PPL, 5: PPL, 6: RELATIVE, 7: rf"\[{RELATIVE}, {RELATIVE}\]", 8: RELATIVE, 9: SHARE},
               "kl-table": {2: KL, 3: KL, 4: KL, 5: SHARE}, "method-table": {5: PPL, 6: PPL, 7: RELATIVE}}
    for table, formats in columns.items():
        rows = [r for r in parser.tables[table][1:] if len(r) > max(formats)]
        assert rows, table
        for row in rows:
            for column, pattern in formats.items():
                assert re.fullmatch(pattern, row[column]), (table, row, column)
    for name, v in out.verdict["variants"].items():
        for s in v["perplexity"].values():
            assert re.search(rf"perplexity went {PPL} -> {PPL} \({RELATIVE},", s["sentence"]), s["sentence"]
            assert re.search(rf"\[{RELATIVE}, {RELATIVE}\]", s["sentence"]) and "+10.0% (the margin" in s["sentence"]
        for s in v["suites"].values():
            assert re.search(rf"\({SHARE} -> {SHARE}, a change of {POINTS} points\)", s["sentence"]), s["sentence"]
    summary = parser.tables["summary"]
    cells = [c for row in summary for c in row if c.startswith(("+", "-"))]
    assert cells and all(re.fullmatch(rf"{RELATIVE} ?\[{RELATIVE}, {RELATIVE}\] ?recovery {SHARE} ?\d+ docs", c) for c in cells), cells
