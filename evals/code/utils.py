"""HumanEval, zero-shot chat prompt; pass@1 of the greedy completion, executed in pipeline.sandbox."""

import ast
import gzip
import json
import re
import secrets
import textwrap
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


def _is_statement(line: str) -> bool:
    try:
        ast.parse(line)
        return True
    except SyntaxError:
        return line.rstrip().endswith(":")  # a block header such as `if x:` or `for ...:`


def build_program(doc, output: str, sentinel: str = "") -> str:
    """Prompt + the model's code (whole function, or a body appended under the signature) + the test;
    the sentinel is printed only when check() returned, so an early `exit(0)` does not pass."""
    code = extract_code(output, doc["entry_point"])
    if _defines(code, doc["entry_point"]):
        # the prompt's stub (docstring only) comes first: its imports and helpers stay available and
        # the model's definition replaces the stub
        solution = doc["prompt"] + "\n" + code
    else:
        solution = doc["prompt"] + _as_body(code)
    program = f"{_definitions_only(solution)}\n\n{doc['test']}\n\ncheck({doc['entry_point']})\n"
    return program + (f"print({sentinel!r})\n" if sentinel else "")


def _as_body(code: str) -> str:
    code = textwrap.dedent(code.strip("\n"))
    return textwrap.indent(code, "    ") + "\n"


def _definitions_only(source: str) -> str:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source  # let the sandbox report the error; the sample fails
    tree.body = [node for node in tree.body if isinstance(node, KEEP) and not _is_call_assignment(node)]
    return ast.unparse(tree)


def _is_call_assignment(node: ast.stmt) -> bool:
    return isinstance(node, (ast.Assign, ast.AnnAssign)) and any(isinstance(n, ast.Call) for n in ast.walk(node))


def process_results(doc, results):
    from pipeline.sandbox import run_python

    sentinel = f"check passed {secrets.token_hex(8)}"
    outcome = run_python(build_program(doc, results[0], sentinel), timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    passed = outcome.passed and outcome.stdout_tail.rstrip().endswith(sentinel)
    return {"pass@1": float(passed), "isolated": float(outcome.method == "bwrap")}
