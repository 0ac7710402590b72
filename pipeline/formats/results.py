"""Result lines: `results/<model>/<suite>.jsonl` (one JSON object per item) and its `<suite>.json`
summary. Written by `quantize eval` (pipeline/evaluate.py), read by `quantize report`.

A line holds at least `id`, `score` and `correct` (true/false); a perplexity suite's line is one
document with its summed `loglikelihood` and `n_tokens` (`correct` null). The summary names the
suite, metric and score, or `status: not applicable` (or `not run`) with a `reason`, and a .jsonl of no items
beside it: one blank line, not an empty file, which `dvc repro` would warn about as if something had failed.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats.checked_json import (
    Mismatch, check, decode, fix_command, kind_of, parse, problem, read_bytes, read_checked_json, unpaired_surrogate,
)
from pipeline.outputs import write_atomic, write_json

RESULT_LINE = {"id": "result id", "score": "number", "correct": "flag"}
# a perplexity suite's line: one document, its summed log-likelihood and its token count (no right/wrong)
DOCUMENT_LINE = {"id": "result id", "score": "number", "correct": ("flag", None), "loglikelihood": "number",
                 "n_tokens": "count"}
ENGINE_DEFECT = {"key": "text", "avoided": "flag", "what?": "text", "when?": "text", "avoided_by?": "text",
                 "upstream?": "text", "evidence?": "text"}  # pipeline/engines/vllm_defects.py: Defect.summary
SUMMARY = {"status?": ("text", None), "reason?": ("text", None), "engine?": ("text", None),
           "engine_defects?": [ENGINE_DEFECT],
           "long_context?": {"by_length_and_depth": {"*": {"*": {"score": "number", "n": "count"}}},
                             "lengths_skipped?": [{"length": "count", "reason": "text"}]}}
COMMAND = "quantize eval models/{model} --suite {suite}"  # what writes them again
NO_ITEMS = "\n"  # a suite not run (or not applicable): no item; not an empty file (DVC: "WARNING: ... is empty")


def lines_path(out_dir: Path | str, suite: str) -> Path:
    return Path(out_dir) / f"{suite}.jsonl"


def write_results(out_dir: Path | str, suite: str, lines: list[dict], summary: dict) -> Path:
    """<out_dir>/<suite>.jsonl (the lines, in order) and <suite>.json (the summary), each atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = lines_path(out_dir, suite)
    write_atomic(path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines) or NO_ITEMS)
    write_json(out_dir / f"{suite}.json", summary)
    return path


def read_summary(path: Path | str) -> dict | None:
    """A <suite>.json, checked for what the report uses of it; None when absent."""
    return read_checked_json(Path(path), SUMMARY, COMMAND)


def read_lines(path: Path | str) -> dict[str, dict]:
    """{item id: result line} of one results/<model>/<suite>.jsonl, every line checked; a duplicate id,
    or a line that is not a result is a UserError naming the file and the line."""
    path = Path(path)
    text = decode(path, read_bytes(path, COMMAND), COMMAND)
    items: dict[str, dict] = {}
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f":{number}"
        item = parse(path, line, where, COMMAND)
        if not isinstance(item, dict):
            raise problem(path, where, f"a result line must be a JSON object, not {kind_of(item)}", COMMAND)
        try:
            check(item, DOCUMENT_LINE if "loglikelihood" in item else RESULT_LINE)
        except Mismatch as exc:
            key, expected, found = exc.args
            raise problem(path, where, f"{key}: expected {expected}, found {found}", COMMAND) from None
        if "\\ud" in line.lower() and (key := unpaired_surrogate(item)) is not None:
            raise problem(path, where, f"{key}: holds an unpaired UTF-16 surrogate (a broken character) that no "
                                       "UTF-8 page can hold", COMMAND)
        item_id = str(item["id"])
        if item_id in first_line:
            raise UserError(f"{path}:{number}: id {item_id[:80]!r} is already on line {first_line[item_id]}; "
                            "each item must appear once: delete the duplicate line, or run "
                            f"`{fix_command(path, COMMAND)}` again into an empty results folder")
        first_line[item_id] = number
        items[item_id] = item
    return items  # empty for a suite that does not apply (its <suite>.json says why)
