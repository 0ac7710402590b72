"""judge.jsonl: one line per held-out prompt the judge saw, written beside judge.json by `quantize judge`
(pipeline/judge/) and read by `quantize report`, which recomputes judge.json's figures from these lines
(pipeline/verdict/judge.py: pairwise_figures, reference_figures).

What the figures use of a line, checked here: pairwise mode, the pair's `outcome` (win, tie or loss from the
variant's side, or unjudged), whether its two orders agreed (`consistent`: null exactly when unjudged; a win
or a loss needs both orders to agree, a disagreement is a tie), `unjudged_reason`, `length_diff` (variant
answer minus base answer, characters) and, with the control run, the same of `control`; reference mode, the
`grade` (1-5, null exactly when unjudged) and `outcome` (graded or unjudged).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.formats.checked_json import problem, read_checked_lines

PAIR = {"outcome": "text", "consistent": ("flag", None)}
PAIRWISE_LINE = {**PAIR, "unjudged_reason": ("text", None), "length_diff": "number", "control?": PAIR}
REFERENCE_LINE = {"outcome": "text", "grade": ("count", None), "unjudged_reason": ("text", None), "length_diff": "number"}
PAIR_OUTCOMES = ("win", "tie", "loss", "unjudged")
COMMAND = "quantize judge models/{model}"  # what writes it again


def read_judge_lines(path: Path | str, mode: str) -> list[dict]:
    """Every line of a judge.jsonl written in `mode` (pairwise or reference), checked; the first line that does not
    hold is a UserError naming the file, the line and the field."""
    path = Path(path)
    pairwise = mode == "pairwise"
    lines = []
    for where, line in read_checked_lines(path, lambda _: PAIRWISE_LINE if pairwise else REFERENCE_LINE, COMMAND,
                                          "judge line"):
        if pairwise:
            _check_pair(path, where, line, "")
            if "control" in line:
                _check_pair(path, where, line["control"], "control.")
            if lines and ("control" in line) != ("control" in lines[0]):
                raise problem(path, where, "control: on some lines and not on others: a control run judges every "
                                           "prompt", COMMAND)
        else:
            _check_graded(path, where, line)
        lines.append(line)
    return lines


def _check_pair(path: Path, where: str, pair: dict, key: str) -> None:
    outcome, consistent = pair["outcome"], pair["consistent"]
    if outcome not in PAIR_OUTCOMES:
        raise problem(path, where, f"{key}outcome: {outcome[:40]!r} is none of {', '.join(PAIR_OUTCOMES)}", COMMAND)
    if (consistent is None) != (outcome == "unjudged"):
        raise problem(path, where, f"{key}consistent: {'null' if consistent is None else str(consistent).lower()} with "
                                   f"outcome {outcome}: null exactly when the pair is unjudged", COMMAND)
    if outcome in ("win", "loss") and consistent is False:
        raise problem(path, where, f"{key}outcome: a {outcome} whose two orders disagree; a pair the judge decides "
                                   "differently with the answers swapped is a tie", COMMAND)


def _check_graded(path: Path, where: str, line: dict) -> None:
    outcome, grade = line["outcome"], line["grade"]
    if outcome not in ("graded", "unjudged"):
        raise problem(path, where, f"outcome: {outcome[:40]!r} is neither graded nor unjudged", COMMAND)
    if grade is not None and not 1 <= grade <= 5:
        raise problem(path, where, f"grade: {grade} is not a grade of 1 to 5", COMMAND)
    if (grade is None) != (outcome == "unjudged"):
        raise problem(path, where, f"grade: {'null' if grade is None else grade} with outcome {outcome}: null exactly "
                                   "when the answer is unjudged", COMMAND)
