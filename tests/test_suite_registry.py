"""Issue 65: a suite is one folder (task YAML + data + utils.py) whose YAML declares what the product needs to know
(`metadata.suite`, read by pipeline/settings/suites.py). A folder made here, outside the repository, with no code
edited anywhere, is scored, decided, shown in the report and the model card and listed in the params reference; a
mistake in its declaration is one message naming the file, the line, the key and the fix (exit 2)."""

import json
import re
import shutil
import sys

import pytest

from conftest import REPO, TINY_PARAMS, with_variants, write_params
from pipeline.errors import UserError
from pipeline.settings import suites
from pipeline.settings.params import Params
from pipeline.stages import evaluate, report
from pipeline.verdict.decision import TABLES_KEY
from test_bad_inputs import assert_refused, invoke

@pytest.fixture(autouse=True)
def own_includes(monkeypatch):
    """The folders this module's params.yaml name join the registry for this test only (the registry keeps a
    process's tasks_dirs, and a test process runs many params.yaml; a broken one stays with its own test)."""
    monkeypatch.setattr(suites, "_INCLUDED", [])


SUITE_YAML = """# A suite of this test's own: each item asks for its number back; its YAML says what the product needs.
task: quant_selftest_parity
custom_dataset: !function utils.load
output_type: generate_until
test_split: test
doc_to_text: "Repeat this number: {{n}}"
doc_to_target: "{{n}}"
process_results: !function utils.score
generation_kwargs: {until: [], do_sample: false, max_gen_toks: 1}
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
metadata:
  version: 1.0
  suite:
    name: parity
    kind: right-wrong
    card: {dataset: example-org/parity, describes: numbers to repeat, split: test}
"""
SUITE_UTILS = """import json
from pathlib import Path

import datasets

DATA = Path(__file__).with_name("items.jsonl")


def load(**_):
    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def score(doc, results):
    # what a 2-layer random model answers is noise: the even items are credited, so the base sits at 50 %, where
    # a paired comparison decides; the copy of the base answers the same
    return {"acc": float(doc["n"] % 2 == 0)}
"""


def suite_folder(root, yaml_text: str = SUITE_YAML):
    folder = root / "parity"
    folder.mkdir(parents=True)
    (folder / "quant_selftest_parity.yaml").write_text(yaml_text)
    (folder / "utils.py").write_text(SUITE_UTILS)
    (folder / "items.jsonl").write_text("".join(json.dumps({"id": f"parity-{n:03d}", "n": n}) + "\n" for n in range(80)))
    return folder


def test_a_suite_folder_is_scored_decided_reported_carded_and_in_the_params_reference(tmp_path, tiny_llama):
    sys.path.insert(0, str(REPO / "tools"))
    from gen_docs import params_page
    from pipeline.report.model_card import model_cards

    folder = suite_folder(tmp_path / "my-suites")
    margins = {"suites": {"parity": 0.1}}  # a margin of its own, as for any suite
    settings = with_variants({**TINY_PARAMS, "verdict": {**TINY_PARAMS["verdict"], "margins": margins},
                              "suites": {"parity": {"task": "quant_selftest_parity", "tasks_dir": str(folder)}}}, "copy")
    params = Params.model_validate(settings)
    models, results = tmp_path / "models", tmp_path / "results"
    shutil.copytree(tiny_llama, models / "base")
    shutil.copytree(tiny_llama, models / "copy")
    for model in ("base", "copy"):  # scored: `quantize eval models/<model>` runs every suite of params.yaml
        done = evaluate.run_model(models / model, params, out_dir=results / model)
        assert [r.figures["suite"] for r in done.suites] == ["parity"] and done.suites[0].figures["n"] == 80
    assert suites.find("quant_selftest_parity").name == "parity"  # the registry knows it from its tasks_dir

    out = report.run(results, tmp_path / "reports", params, models_dir=models)
    copy = out.verdict["variants"]["copy"]
    assert copy["suites"]["parity"]["counted"] and copy["suites"]["parity"]["decision"] == "GO"  # decided
    assert copy["coverage"]["suites"]["parity"]["state"] == "decided"
    assert copy["coverage"]["suites"]["math"]["state"] == "not configured"  # the shipped suites, from evals/
    html = out.html.read_text()
    assert 'id="suite-parity"' in html or ">parity<" in html  # in the report

    card = model_cards(out.verdict, tasks={"parity": "quant_selftest_parity"}, speed_engine=None)["copy"]
    assert "type: example-org/parity" in card and "numbers to repeat (80 items scored)" in card  # in the card

    reference = params_page()
    assert "| `parity` | `quant_selftest_parity` | right-wrong | - | numbers to repeat (`example-org/parity`) |" in reference


@pytest.mark.parametrize("mistake, line, expected", [
    ("    kind: right-wrong\n", "    kind: multiple-choice\n",
     ":15: metadata.suite.kind: 'multiple-choice' is not a suite kind; use one of right-wrong, score, perplexity, "
     "retrieval-table"),
    ("    kind: right-wrong\n", "    kind: right-wrong\n    needs: [gpu]\n",
     ":16: metadata.suite.needs: 'gpu' is not one of images, sandbox, context, thinking; fix or remove it"),
    ("    kind: right-wrong\n", "    kind: perplexity\n",
     ":15: metadata.suite.kind: perplexity: a perplexity suite's task has output_type: loglikelihood_rolling, not "
     "generate_until; declare the kind its scorer gives"),
    ("    name: parity\n", "", ":13: metadata.suite.name: required: the suite's name in params.yaml (suites.<name>)"),
    ("    kind: right-wrong\n", "    kind: retrieval-table\n",
     ":13: metadata.suite.hooks: a retrieval-table suite's own module defines summarize and table_from_lines; name it "
     "(hooks: hooks.py)"),
    ("    kind: right-wrong\n", "    kind: right-wrong\n    hooks: missing.py\n",
     ":16: metadata.suite.hooks: missing.py is not a file in"),
])
def test_a_mistake_in_a_suite_declaration_names_file_line_key_and_fix(tmp_path, tiny_llama, mistake, line, expected):
    folder = suite_folder(tmp_path / "my-suites", SUITE_YAML.replace(mistake, line))
    with pytest.raises(UserError, match=re.escape("quant_selftest_parity.yaml" + expected)):
        suites.read_suite(folder / "quant_selftest_parity.yaml")
    # through the command a user runs: exit 2, the message, no traceback
    params = write_params(tmp_path, {**TINY_PARAMS, "verdict": {**TINY_PARAMS["verdict"], "margins": {}},
                                     "suites": {"parity": {"task": "quant_selftest_parity", "tasks_dir": str(folder)}}})
    assert_refused(invoke(["eval", str(tiny_llama), "--suite", "parity", "--params", str(params), "--out",
                           str(tmp_path / "r")]), [expected], "a suite declaration")


def test_every_shipped_suite_is_declared_and_its_hooks_are_its_own():
    """evals/ holds the thirteen shipped suites, each declared; the long-context suite and the generated visual suites
    have their own module, found by the registry from their YAML (not by their name), and their options are checked
    there."""
    shipped = suites.shipped()
    assert {s.kind for s in shipped.values()} == {"right-wrong", "perplexity", "retrieval-table"}
    own = [s for s in shipped.values() if s.hooks_file]
    assert all(s.hooks_file.parent == s.folder for s in own)
    assert sorted(s.task for s in own) == ["quant_charts", "quant_counting", "quant_documents", "quant_long_context",
                                           "quant_small_text"]
    tabled = [s for s in own if s.kind == "retrieval-table"]
    assert [s.task for s in tabled] == ["quant_long_context"]
    assert suites.bench_file("text").name == "alice29.txt" and suites.bench_file("images").suffix == ".jsonl"
    assert [s.task for s in shipped.values() if s.held_out] == ["quant_ppl_chat"]
    assert suites.named("long_context") is tabled[0] and suites.named("no such suite") is None
    assert "lengths: give a list" in tabled[0].hook("options_problem")({"lengths": [10]})


def test_a_suite_whose_own_module_is_broken_is_named_not_a_traceback(tmp_path):
    folder = suite_folder(tmp_path / "my-suites", SUITE_YAML.replace("    kind: right-wrong\n",
                                                                     "    kind: retrieval-table\n    hooks: hooks.py\n"))
    (folder / "hooks.py").write_text("def summarize(lines, metadata:\n")
    with pytest.raises(UserError, match=r"hooks\.py: the suite's hooks module \(metadata\.suite\.hooks\) cannot be "
                                        r"loaded: SyntaxError: .*; fix it there"):
        suites.read_suite(folder / "quant_selftest_parity.yaml")


def test_a_retrieval_table_suite_keeps_its_table_under_any_name(tmp_path):
    """The finding: the long-context table was found by the suite's name, so the same task under another name lost
    it. Now the suite's kind and hooks (its YAML) bring it, recomputed from its lines, whatever params.yaml calls it."""
    from test_report import write_results

    results = tmp_path / "results"
    for model in ("base", "v"):
        write_results(results, model, [1] * 120 + [0] * 80)
        lines = [{"id": f"niah-{length}-d{depth}-{r:02d}", "score": float(r < 2), "correct": r < 2}
                 for length in (1024, 2048) for depth in (0, 50) for r in range(4)]
        (results / model / "needles.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        (results / model / "needles.json").write_text(json.dumps({"table": {
            "by_length_and_depth": {"1024": {"d0": {"n": 1, "score": 0.0}}}, "lengths_skipped": []}}))
    params = Params.model_validate(with_variants({**TINY_PARAMS, "suites": {
        "math": TINY_PARAMS["suites"]["math"], "needles": {"task": "quant_long_context"}}}, "v"))
    verdict = report.run(results, tmp_path / "reports", params, models_dir=tmp_path / "models").verdict
    assert verdict[TABLES_KEY]["v"]["by_length_and_depth"] == {
        str(n): {"d0": {"n": 4, "score": 0.5}, "d50": {"n": 4, "score": 0.5}} for n in (1024, 2048)}


def test_pipeline_names_no_task_of_a_suite():
    """The registry is the one place a suite's task is known: no module of pipeline/ (nor the page's template) names
    one, so a suite added as a folder needs no code."""
    sources = [p for p in (REPO / "pipeline").rglob("*") if p.suffix in (".py", ".html")]
    named = [f"{p.relative_to(REPO)} names {task}" for task in suites.shipped() for p in sources
             if task in p.read_text(encoding="utf-8")]
    assert named == []


TABLED_HOOKS = """from collections import defaultdict


def table(lines):
    bins = defaultdict(list)
    for line in lines:
        bins[line["difficulty"]["parity"]].append(line["score"])
    return {"by_difficulty": {"axis": "parity", "bins": {k: {"n": len(v), "score": sum(v) / len(v)}
                                                        for k, v in sorted(bins.items())}}}


def summarize(lines, metadata):
    return table(lines)


def table_from_lines(lines):
    return table(lines)
"""


def _own_suite(root, name: str, block: str, hooks: str | None = None):
    """A suite folder of this test's own: the parity items (each with its difficulty), `block` its metadata.suite."""
    folder = root / name
    folder.mkdir(parents=True)
    yaml_text = SUITE_YAML.replace("quant_selftest_parity", f"quant_selftest_{name}").split("  suite:\n")[0]
    (folder / f"quant_selftest_{name}.yaml").write_text(yaml_text + "  suite:\n" + block)
    (folder / "utils.py").write_text(SUITE_UTILS)
    (folder / "items.jsonl").write_text("".join(json.dumps({"id": f"{name}-{n:03d}", "n": n, "difficulty": {
        "parity": "even" if n % 2 == 0 else "odd"}}) + "\n" for n in range(40)))
    if hooks:
        (folder / "hooks.py").write_text(hooks)
    return folder


def test_suites_with_their_own_table_images_or_thinking_are_folders_too(tmp_path, tiny_llama):
    """A suite with a table of its own (its hooks, found from its YAML), one that needs images and one that needs
    thinking, each a folder outside the repository: the table is scored, kept in the verdict and shown on the page;
    the two others are "not applicable" to a text model whose template does not think, with why, never 0 %."""
    root = tmp_path / "my-suites"
    _own_suite(root, "tabled", "    name: tabled\n    kind: right-wrong\n    hooks: hooks.py\n", TABLED_HOOKS)
    _own_suite(root, "pictures", "    name: pictures\n    kind: right-wrong\n    needs: [images]\n")
    _own_suite(root, "reasoned", "    name: reasoned\n    kind: right-wrong\n    needs: [thinking]\n")
    own = {name: {"task": f"quant_selftest_{name}", "tasks_dir": str(root)} for name in ("tabled", "pictures", "reasoned")}
    params = Params.model_validate(with_variants({**TINY_PARAMS, "verdict": {**TINY_PARAMS["verdict"], "margins": {
        "suites": {"tabled": 0.1}}}, "suites": own}, "copy"))
    models, results = tmp_path / "models", tmp_path / "results"
    shutil.copytree(tiny_llama, models / "base")
    shutil.copytree(tiny_llama, models / "copy")
    for model in ("base", "copy"):
        evaluate.run_model(models / model, params, out_dir=results / model)
    out = report.run(results, tmp_path / "reports", params, models_dir=models)
    bins = {"even": {"n": 20, "score": 1.0}, "odd": {"n": 20, "score": 0.0}}
    assert out.verdict["difficulty"]["tabled"]["models"] == {"base": bins, "copy": bins}  # its own table, by its hooks
    coverage = out.verdict["variants"]["copy"]["coverage"]["suites"]
    assert coverage["tabled"]["state"] == "decided"
    assert coverage["pictures"]["state"] == "not applicable" and "the suite needs images" in coverage["pictures"]["why"]
    assert coverage["reasoned"]["state"] == "not applicable" and "chat template does not think" in coverage["reasoned"]["why"]
    assert 'id="difficulty-tabled"' in out.html.read_text()


def test_pipeline_names_no_suite_of_evals():
    """Nor a shipped suite's name or folder as a string (`== "long_context"`, `suites["vqa"]`): a special case by
    name is what a folder of its own could never get. The words that are also something else are left out: the
    `code` stage, the kind and verdict part `perplexity`, the unit `documents`, the page's `charts`."""
    other_meanings = {"code", "perplexity", "documents", "charts"}
    words = {w for s in suites.shipped().values() for w in (s.name, s.folder.name)} - other_meanings
    sources = [p for p in (REPO / "pipeline").rglob("*") if p.suffix in (".py", ".html")]
    named = [f"{p.relative_to(REPO)}:{n} names {word}" for p in sources
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             for word in words if re.search(rf"""["']{re.escape(word)}["']""", line)]
    assert named == []


def test_a_cards_reading_of_a_suite_of_ones_own_is_by_its_task_not_its_name(tmp_path):
    """The cards find what a suite declares from the task params.yaml runs it with, a user's own folder included:
    an image suite is no limitation of a text model, a held-out suite's reproduction names the held-out data."""
    from pipeline.report.card_recipe import reproduction_params
    from pipeline.report.model_card import needs_images

    root = tmp_path / "my-suites"
    _own_suite(root, "pictures", "    name: pictures\n    kind: right-wrong\n    needs: [images]\n")
    _own_suite(root, "chats", "    name: chats\n    kind: right-wrong\n    held_out: true\n")
    suites.include(root)
    tasks = {"pictures": "quant_selftest_pictures", "chats": "quant_selftest_chats"}
    assert needs_images("pictures", tasks) and not needs_images("chats", tasks)
    assert needs_images("vqa", {}) and not needs_images("math", {})  # shipped, not configured: by declared name
    entry = {"suites": {"chats": {"n": 40, "margin": 0.1}}}
    setting = reproduction_params("v", entry, {"variants": {"v": entry}}, tasks, None)["suites"]["chats"]
    assert setting["options"] == {"data": "calib/holdout.jsonl"}  # CALIB_DIR: where its calib stage writes
