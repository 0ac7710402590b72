"""Issue 65: how a suite is compared comes from the kind its YAML declares (metadata.suite.kind, read by
pipeline/settings/suites.py), never from what its result lines look like: a right/wrong suite whose lines also carry
each answer's log-likelihood is decided per item; a perplexity suite whose lines are not documents is refused."""

import json

import pytest

from conftest import TINY_PARAMS, with_variants
from pipeline.errors import UserError
from pipeline.settings import suites
from pipeline.settings.params import Params
from pipeline.stages import report
from pipeline.verdict.decision import TABLES_KEY

CHOICE_YAML = """task: quant_selftest_choice
custom_dataset: !function utils.load
output_type: multiple_choice
test_split: test
doc_to_text: "{{question}}"
doc_to_choice: ["yes", "no"]
doc_to_target: 0
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
metadata:
  version: 1.0
  suite:
    name: choice
    kind: right-wrong
    card: {dataset: example-org/choice, describes: yes-or-no questions}
"""


@pytest.fixture(autouse=True)
def own_includes(monkeypatch):
    monkeypatch.setattr(suites, "_INCLUDED", [])


def _lines(suite: str, rights: list[int], documents: bool) -> str:
    lines = []
    for i, right in enumerate(rights):
        line = {"id": f"{suite}-{i:03d}", "score": float(right), "correct": bool(right)}
        if documents:  # what a multiple-choice scorer may keep of its answer: its log-likelihood and length
            line |= {"loglikelihood": -1.0 - 0.01 * i, "n_tokens": 3}
        lines.append(json.dumps(line) + "\n")
    return "".join(lines)


def test_a_right_wrong_suite_whose_lines_carry_loglikelihoods_is_decided_per_item(tmp_path):
    folder = tmp_path / "my-suites" / "choice"
    folder.mkdir(parents=True)
    (folder / "quant_selftest_choice.yaml").write_text(CHOICE_YAML)
    (folder / "utils.py").write_text("def load(**_):\n    raise NotImplementedError\n")
    results = tmp_path / "results"
    for model, rights in (("base", [1] * 60 + [0] * 40), ("v", [1] * 60 + [0] * 40)):
        (results / model).mkdir(parents=True)
        (results / model / "choice.jsonl").write_text(_lines("choice", rights, documents=True))
        # a table shaped as a retrieval table's: it is one only for a suite that declares kind retrieval-table
        (results / model / "choice.json").write_text(json.dumps({"table": {
            "by_length_and_depth": {"1024": {"d0": {"n": 1, "score": 1.0}}}}}))
    params = Params.model_validate(with_variants({**TINY_PARAMS, "suites": {
        "choice": {"task": "quant_selftest_choice", "tasks_dir": str(folder.parent)}}}, "v"))
    verdict = report.run(results, tmp_path / "reports", params, models_dir=tmp_path / "models").verdict
    entry = verdict["variants"]["v"]
    assert "choice" in entry["suites"] and "choice" not in entry["perplexity"]  # per item, as its YAML declares
    assert entry["suites"]["choice"]["n"] == 100 and entry["coverage"]["suites"]["choice"]["kind"] == "accuracy"
    assert verdict["base"]["suites"]["choice"]["score"] == pytest.approx(0.6)
    assert verdict[TABLES_KEY] == {}  # not a retrieval-table suite: no retrieval table


def test_a_perplexity_suite_whose_lines_are_not_documents_is_refused_naming_the_file(tmp_path):
    results = tmp_path / "results"
    for model in ("base", "v"):
        (results / model).mkdir(parents=True)
        (results / model / "ppl-book.jsonl").write_text(_lines("ppl-book", [1, 0, 1, 1], documents=False))
    params = Params.model_validate(with_variants({**TINY_PARAMS, "suites": {
        "ppl-book": TINY_PARAMS["suites"]["ppl-book"]}}, "v"))
    with pytest.raises(UserError, match=r"base/ppl-book\.jsonl.*ppl-book is a perplexity suite \(its task YAML's "
                                        r"metadata\.suite\.kind\) and this line is no document"):
        report.run(results, tmp_path / "reports", params, models_dir=tmp_path / "models")
