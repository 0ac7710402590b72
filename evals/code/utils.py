"""HumanEval, zero-shot chat prompt; pass@1 of the greedy completion, executed in pipeline.scoring.sandbox."""

import ast
import gzip
import json
import re
import textwrap
import threading
from pathlib import Path

DATA = Path(__file__).with_name("HumanEval.jsonl.gz")
TIMEOUT_S = 10.0  # the slowest canonical solution takes well under a second
MEMORY_MB = 1024

PROMPT = (
    "Complete the following Python function. Reply with the complete function, signature included, "
    "in one ```python code block; do not add tests or example usage.\n\n```python\n{prompt}```"
)
FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:\n[ \t]*```|\Z)", re.DOTALL | re.IGNORECASE)
THINKING = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)
# top-level statements kept from the model's code: definitions only, so its own (possibly wrong)
# asserts, prints and demo calls neither fail a correct solution nor burn the time limit
KEEP = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
CODE_START = re.compile(r"^(?:def |async def |class |import |from \S+ import |@)")


def load_humaneval(**_):
    import datasets

    with gzip.open(DATA, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    for row in rows:
        row["id"] = f"humaneval-{int(row['task_id'].split('/')[1]):03d}"
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return PROMPT.format(prompt=doc["prompt"])


def doc_to_target(doc):
    return doc["canonical_solution"]


def extract_code(output: str, entry_point: str) -> str:
    """The code in a model's answer: the fenced block that defines the entry point (else the first
    fence), or in unfenced text the lines from the first definition on, else the text as a body."""
    text = THINKING.sub("", output)
    blocks = FENCE.findall(text)
    if blocks:
        defining = [b for b in blocks if _defines(b, entry_point)]
        return (defining or blocks)[0]
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if CODE_START.match(line)), None)
    if start is None or not _defines(text, entry_point):
        return text  # a bare body, as a completion-style model writes it
    return "\n".join(_code_lines(lines[start:]))


def _defines(code: str, entry_point: str) -> bool:
    return re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE) is not None


def _code_lines(lines: list[str]) -> list[str]:
    """Lines up to the first unindented line of prose after the code."""
    kept = []
    for line in lines:
        if line.strip() and not line[0].isspace() and not CODE_START.match(line) and not _is_statement(line):
            break
        kept.append(line)
    return kept


# CPython 3.11 (up to 3.11.7, the machines' interpreter) keeps the AST constructor's recursion depth in state that
# every thread shares: two ast.parse calls at once can fail with "SystemError: AST constructor recursion depth
# mismatch" (python/cpython#106905). Samples are scored in threads, so each parse holds this lock.
_PARSING = threading.Lock()


def _parse(source: str) -> ast.Module:
    with _PARSING:
        return ast.parse(source)


def _is_statement(line: str) -> bool:
    try:
        _parse(line)
        return True
    except SyntaxError:
        return line.rstrip().endswith(":")  # a block header such as `if x:` or `for ...:`


def build_solution(doc, output: str) -> str:
    """The untrusted side: the prompt + the model's code (whole function, or a body appended under the
    signature), definitions only. The test is not in it: the sample never sees the expected values."""
    code = extract_code(output, doc["entry_point"])
    if _defines(code, doc["entry_point"]):
        # the prompt's stub (docstring only) comes first: its imports and helpers stay available and
        # the model's definition replaces the stub
        solution = doc["prompt"] + "\n" + code
    else:
        solution = doc["prompt"] + _as_body(code)
    return _definitions_only(solution)


def build_checker(doc) -> str:
    """The trusted side: the prompt's own helpers, the item's test, and check() called on the sample's
    function. The entry point's global name is rebound to it too, as in the official harness, where
    the completion defines that name (HumanEval/33's test calls `sort_third` by name)."""
    return (f"{doc['prompt']}\n\n{doc['test']}\n\n"
            f"{doc['entry_point']} = __sample_function__\ncheck({doc['entry_point']})\n")


def _as_body(code: str) -> str:
    code = textwrap.dedent(code.strip("\n"))
    return textwrap.indent(code, "    ") + "\n"


def _definitions_only(source: str) -> str:
    try:
        tree = _parse(source)
    except SyntaxError:
        return source  # let the sandbox report the error; the sample fails
    tree.body = [node for node in tree.body if isinstance(node, KEEP) and not _is_call_assignment(node)]
    return ast.unparse(tree)


def _is_call_assignment(node: ast.stmt) -> bool:
    return isinstance(node, (ast.Assign, ast.AnnAssign)) and any(isinstance(n, ast.Call) for n in ast.walk(node))


def score(doc, output: str, **options):
    """Run the item's test against the answer's function, each side in its own sandbox (pipeline.scoring.sandbox.run_check)."""
    from pipeline.scoring.sandbox import run_check

    return run_check(build_solution(doc, output), doc["entry_point"], build_checker(doc),
                     timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB, **options)


def process_results(doc, results):
    outcome = score(doc, results[0])
    return {"pass@1": float(outcome.passed), "isolated": float(outcome.method == "bwrap")}
