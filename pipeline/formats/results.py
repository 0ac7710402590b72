"""Result lines: `results/<model>/<suite>.jsonl` (one JSON object per item) and its `<suite>.json`
summary. Written by `quantize eval` (pipeline/stages/evaluate.py), read by `quantize report`.

A line holds at least `id`, `score` (in [0, 1]) and `correct` (true exactly when the score is 1); a
perplexity suite's line is one document with its summed `loglikelihood` (at most 0) and `n_tokens` (at
least 1; `correct` null). A generated answer's line says how it was generated (`thinking`, `reasoning`,
`reasoning_tokens`, `answer_tokens`, `cut`: pipeline/scoring/result_lines.py); lines written before those
fields are read as they are. An item of k samples holds them (`samples`), its score their mean (avg@k), `correct`
null and, on a right/wrong suite, `pass_at_k`. The verdict is computed from these lines; the summary names the suite, metric
and score, or `status: not applicable` (or `not run`) with a `reason`, and a .jsonl of no items beside it:
one blank line, not an empty file, which `dvc repro` would warn about as if something had failed.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats.checked_json import fix_command, problem, read_checked_json, read_checked_lines
from pipeline.outputs import json_text, write_together

CUT = ("text", None)  # where the token budget cut an answer: "reasoning", "answer", or null
GENERATED = {"thinking?": "flag", "reasoning?": "text", "reasoning_tokens?": ("count", None),
             "answer_tokens?": ("count", None), "cut?": CUT}  # how an answer was generated (absent in older lines)
CUT_WHERE = ("reasoning", "answer", None)
# the item's share of credit; right or wrong
DIFFICULTY = {"*": ("number", "text")}  # a generated item's (evals/visual/): its table's bins
RESULT_LINE = {"id": "result id", "score": "share", "correct": "flag", "difficulty?": DIFFICULTY, **GENERATED}
SAMPLE = {"seed?": "count", "score": "share", "correct": "flag", "output?": ("text", None),
          "reasoning_tokens?": ("count", None), "answer_tokens?": ("count", None), "cut?": CUT}
# an item of k samples: its score their mean (avg@k), correct null, and on a right/wrong suite whether any is right
SAMPLED_LINE = {"id": "result id", "score": "share", "correct": ("flag", None), "samples": [SAMPLE], "pass_at_k?": "flag",
                "difficulty?": DIFFICULTY, **GENERATED}
# a perplexity suite's line: one document, its summed log-likelihood and its token count (no right/wrong)
DOCUMENT_LINE = {"id": "result id", "score": "number", "correct": ("flag", None), "loglikelihood": "number",
                 "n_tokens": "positive count"}
MAX_NLL_PER_TOKEN = 700  # nats: e^700 ~ 1e304, near the largest float; real models score ~1-15 per token
MAX_DOCUMENT_TOKENS = 2 ** 53  # a token count a float (numpy's sums) holds exactly
ENGINE_DEFECT = {"key": "text", "avoided": "flag", "what?": "text", "when?": "text", "avoided_by?": "text",
                 "upstream?": "text", "evidence?": "text"}  # pipeline/engines/vllm_defects.py: Defect.summary
CELL = {"score": "number", "n": "count"}
# a suite's own table (its hooks' summarize): the long-context one per length x needle depth, with the lengths skipped;
# a generated visual suite's per bin of one difficulty axis (evals/visual/common.py: by_difficulty)
SUITE_TABLE = {"by_length_and_depth?": {"*": {"*": CELL}}, "lengths_skipped?": [{"length": "count", "reason": "text"}],
               "by_difficulty?": {"axis": "text", "bins": {"*": CELL}}}
SUMMARY = {"status?": ("text", None), "reason?": ("text", None), "engine?": ("text", None), "available?": "count",
           "checkpoint?": ("text", None),  # the weights it was scored on (pipeline/checkpoints/fingerprint.py)
           "engine_defects?": [ENGINE_DEFECT],
           # a suite's own table (its hooks' summarize: pipeline/settings/suites.py)
           "table?": SUITE_TABLE}
COMMAND = "quantize eval models/{model} --suite {suite}"  # what writes them again
NO_ITEMS = "\n"  # a suite not run (or not applicable): no item; not an empty file (DVC: "WARNING: ... is empty")


def lines_path(out_dir: Path | str, suite: str) -> Path:
    return Path(out_dir) / f"{suite}.jsonl"


def write_results(out_dir: Path | str, suite: str, lines: list[dict], summary: dict) -> Path:
    """<out_dir>/<suite>.jsonl (the lines, in order) and <suite>.json (the summary), together atomically."""
    out_dir = Path(out_dir)
    path = lines_path(out_dir, suite)
    write_together({path: "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines) or NO_ITEMS,
                    out_dir / f"{suite}.json": json_text(summary)})  # both or neither: a refused write changes none
    return path


def read_summary(path: Path | str) -> dict | None:
    """A <suite>.json, checked for what the report uses of it; None when absent."""
    return read_checked_json(Path(path), SUMMARY, COMMAND)


def read_lines(path: Path | str) -> dict[str, dict]:
    """{item id: result line} of one results/<model>/<suite>.jsonl, every line checked, its values in their
    domain included (`check_domain`); a duplicate id, or a line that is not a result is a UserError naming
    the file and the line."""
    path = Path(path)
    items: dict[str, dict] = {}
    first_line: dict[str, str] = {}
    def spec_of(item: dict) -> dict:
        return DOCUMENT_LINE if "loglikelihood" in item else SAMPLED_LINE if "samples" in item else RESULT_LINE

    for where, item in read_checked_lines(path, spec_of, COMMAND, "result line"):
        check_domain(path, where, item)
        item_id = str(item["id"])
        if item_id in first_line:
            raise UserError(f"{path}{where}: id {item_id[:80]!r} is already on line {first_line[item_id][1:]}; "
                            "each item must appear once: delete the duplicate line, or run "
                            f"`{fix_command(path, COMMAND)}` again into an empty results folder")
        first_line[item_id] = where
        items[item_id] = item
    return items  # empty for a suite that does not apply (its <suite>.json says why)


def check_domain(path: Path, where: str, item: dict) -> None:
    """What the types cannot say: a document's log-likelihood is at most 0 and leaves a perplexity that a float
    holds (per token at least -MAX_NLL_PER_TOKEN); a right/wrong item is correct exactly when it scores 1
    (`correct` is `score >= 1` as `quantize eval` writes it, the score a share in [0, 1])."""
    if "loglikelihood" in item:
        tokens, loglikelihood = item["n_tokens"], item["loglikelihood"]
        if tokens > MAX_DOCUMENT_TOKENS:
            raise problem(path, where, f"n_tokens: {tokens:.3g} tokens in one document, more than a float counts "
                                       f"exactly ({MAX_DOCUMENT_TOKENS:.3g})", COMMAND)
        if loglikelihood > 0:
            raise problem(path, where, f"loglikelihood: {loglikelihood:g} is above 0: a log-likelihood is the log of "
                                       "a probability, at most 0", COMMAND)
        if -loglikelihood / tokens > MAX_NLL_PER_TOKEN:
            raise problem(path, where, f"loglikelihood: {loglikelihood:g} over {tokens} tokens is "
                                       f"{loglikelihood / tokens:.4g} per token, below -{MAX_NLL_PER_TOKEN}: a "
                                       f"perplexity above e^{MAX_NLL_PER_TOKEN}, past what any model scores and what a "
                                       "float holds", COMMAND)
    elif "samples" in item:
        check_samples(path, where, item)
    elif item["correct"] != (item["score"] == 1):
        raise problem(path, where, f"correct: {str(item['correct']).lower()} with score {item['score']:g}: an item is "
                                   "correct exactly when it scores 1", COMMAND)
    for holder, key in [(item, "cut"), *((sample, f"samples[{i}].cut") for i, sample in enumerate(item.get("samples") or []))]:
        if holder.get("cut") not in CUT_WHERE:
            raise problem(path, where, f"{key}: {holder['cut']!r} is not where a budget cuts an answer: "
                                       "\"reasoning\", \"answer\" or null", COMMAND)


def check_samples(path: Path, where: str, item: dict) -> None:
    """An item answered k times: at least one sample, each correct exactly when it scores 1, the line's score their
    mean (avg@k), `pass_at_k` whether any sample is right, and `correct` (null, as `quantize eval` writes it for k > 1)
    when given, the line's score being 1."""
    samples = item["samples"]
    if not samples:
        raise problem(path, where, "samples: an empty list: an item answered k times holds its k samples", COMMAND)
    for number, sample in enumerate(samples):
        if sample["correct"] != (sample["score"] == 1):
            raise problem(path, where, f"samples[{number}].correct: {str(sample['correct']).lower()} with score "
                                       f"{sample['score']:g}: a sample is correct exactly when it scores 1", COMMAND)
    mean = sum(sample["score"] for sample in samples) / len(samples)
    if abs(item["score"] - mean) > 1e-9:
        raise problem(path, where, f"score: {item['score']:g} is not the mean of its {len(samples)} samples' scores "
                                   f"({mean:g}, avg@k)", COMMAND)
    right = any(sample["correct"] for sample in samples)
    if item.get("pass_at_k", right) != right:
        raise problem(path, where, f"pass_at_k: {str(item['pass_at_k']).lower()} where "
                                   f"{'a sample is' if right else 'no sample is'} correct", COMMAND)
    if item["correct"] is not None and item["correct"] != (item["score"] == 1):
        raise problem(path, where, f"correct: {str(item['correct']).lower()} with score {item['score']:g}: an item is "
                                   "correct exactly when it scores 1", COMMAND)
