"""Whether a suite's token budget fits the model: how many of each model's answers max_new_tokens cut, and where
(inside the reasoning, inside the answer: the result lines' `cut`, pipeline/scoring/result_lines.py; an item of k
samples counts each sample). A suite whose base has more than verdict.max_cut_share of its answers cut inside the
reasoning scored the budget, not the model: it is shown, not counted, with what to raise (`budget_why`), as a suite
whose base sits at the floor is.
"""

from __future__ import annotations

from pipeline.verdict.figures import share

BUDGET_TOO_SMALL = "budget too small for this model"


def _answers(items: dict[str, dict]) -> list[dict]:
    """Every answer of a suite's lines: an item's samples, else the item."""
    return [answer for line in items.values() for answer in (line.get("samples") or [line])]


def cut_counts(items: dict[str, dict]) -> dict | None:
    """{n, reasoning, answer, thinking} of a suite's lines: answers, those cut inside the reasoning, inside the
    answer, and whether any was generated thinking; None for lines that record no cut (likelihood suites, lines
    written before answers recorded it)."""
    if not any("cut" in line for line in items.values()):
        return None
    answers = _answers(items)
    return {"n": len(answers), "reasoning": sum(a.get("cut") == "reasoning" for a in answers),
            "answer": sum(a.get("cut") == "answer" for a in answers),
            "thinking": any(line.get("thinking") for line in items.values())}


def budget_table(results: dict[str, dict[str, dict[str, dict]]], max_cut_share: float) -> dict[str, dict]:
    """verdict.json's `budgets`: {suite: {models: {model: cut_counts and the share cut}, too_small: budget_why or
    None}} of every suite whose lines record cuts, the base first."""
    table: dict[str, dict] = {}
    for model in sorted(results, key=lambda name: name != "base"):
        for suite, items in sorted(results[model].items()):
            counts = cut_counts(items)
            if counts is not None:
                cut = counts["reasoning"] + counts["answer"]
                entry = table.setdefault(suite, {"models": {}, "too_small": None})
                entry["models"][model] = {**counts, "share": cut / counts["n"] if counts["n"] else None}
                if model == "base":
                    entry["too_small"] = budget_why(items, suite, max_cut_share)
    return table


def budget_why(base_items: dict[str, dict], suite: str, max_cut_share: float) -> str | None:
    """Why a suite is not counted when the base's answers are cut inside the reasoning beyond max_cut_share, else
    None."""
    counts = cut_counts(base_items)
    if not counts or not counts["n"]:
        return None
    cut = counts["reasoning"] / counts["n"]
    if cut <= max_cut_share:
        return None
    return (f"{BUDGET_TOO_SMALL} ({share(cut)} of the base's items cut inside the reasoning): raise "
            f"suites.{suite}.thinking_max_new_tokens")
