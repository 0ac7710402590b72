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
