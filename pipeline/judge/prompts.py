"""The judge's prompt templates (evals/judge/), how a held-out conversation is shown to it, and what its answer is
made of: the choices of each mode and, for a verdict read from log-probabilities, the text its reply is begun with."""

from __future__ import annotations

import re
from pathlib import Path

from pipeline.errors import UserError

TEMPLATES = Path(__file__).resolve().parent.parent.parent / "evals" / "judge"
REMINDER = {
    "pairwise": "Your reply did not end with a verdict in the required format. Reply with exactly one of "
                "[[A]], [[B]] or [[C]] and nothing else.",
    "reference": "Your reply did not contain a rating in the required format. Reply with exactly one rating "
                 "from [[1]] to [[5]] and nothing else.",
}

# The answers a mode's template asks for, [[X]] in its format: pairwise A (assistant A better), B, or C (a tie);
# reference a grade 1 to 5. Read from log-probabilities (pipeline/judge/client.py), the judge's reply is begun for it
# with the mode's cue, as the template says it must end, and each choice is scored as that text's continuation.
CHOICES = {"pairwise": ("A", "B", "C"), "reference": ("1", "2", "3", "4", "5")}
ANSWER_CUE = {"pairwise": "Final verdict: [[", "reference": "Rating: [["}


def render(template: str, **values: str) -> str:
    """Fills {name} placeholders in one pass, so braces inside answers are left alone."""
    return re.sub(r"\{(\w+)\}", lambda m: values.get(m.group(1), m.group(0)), template)


def conversation_text(messages: list[dict]) -> str:
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n\n".join(f"{m['role'].capitalize()}: {m['content']}" for m in messages)


def load_template(mode: str) -> str:
    path = TEMPLATES / f"{mode}.txt"
    if not path.exists():
        raise UserError(f"{path}: judge prompt missing; it ships with the project (evals/judge/)")
    return path.read_text(encoding="utf-8")
