"""Reading a judge's answers: the strict [[A]]/[[B]]/[[C]] verdict and [[1]]-[[5]] grade parsers of its replies, the
likeliest choice of its log-probabilities, one order's
outcome from the variant's side and a pair's outcome from its two orders (the figures over all pairs: pipeline/verdict/judge.py)."""

from __future__ import annotations

import re

VERDICT = re.compile(r"\[\[([ABC])\]\]")
GRADE = re.compile(r"\[\[([1-5])\]\]")
# The two orders of a pair: which side the variant's answer sits on.
ORDERS = (("base-first", False), ("variant-first", True))


def parse_verdict(text: str) -> str | None:
    """'A', 'B' or 'C' when the text holds exactly one distinct [[X]] verdict; else None."""
    found = set(VERDICT.findall(text or ""))
    return found.pop() if len(found) == 1 else None


def parse_grade(text: str) -> int | None:
    found = set(GRADE.findall(text or ""))
    return int(found.pop()) if len(found) == 1 else None


def likeliest(logprobs: dict[str, float]) -> str | None:
    """The choice whose continuation has the highest log-probability (lm-eval's multiple-choice `acc`); None when
    two or more share the highest (no single likeliest choice)."""
    best = max(logprobs.values())
    top = [choice for choice, logprob in logprobs.items() if logprob == best]
    return top[0] if len(top) == 1 else None


def order_outcome(verdict: str | None, variant_is_a: bool) -> str | None:
    """The verdict of one order from the variant's side: win, tie, loss (None: unjudged)."""
    if verdict is None:
        return None
    if verdict == "C":
        return "tie"
    return "win" if (verdict == "A") == variant_is_a else "loss"


def combine(first: str | None, second: str | None) -> tuple[str, bool | None]:
    """Outcome of a pair from its two orders, and whether they agreed (None: not both judged)."""
    if first is None or second is None:
        return "unjudged", None
    if first == second:
        return first, True
    return "tie", False
