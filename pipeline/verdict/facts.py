"""What a decided variant's verdict means, derived once from its verdict.json entry (variants.<V>) and read by
every reader of it: the headline (pipeline/verdict/headline.py), the fix (fix.py), the report's first screen
(pipeline/report/screen.py), the gate (decision.py) and the model cards (pipeline/report/card_*.py).

    counted(entry)          what the decision counted: (suite, kind, decision) of the right/wrong suites, the
                            perplexity suites, the judge and speed at batch 1 (`counted_entries`: with their
                            figures; `counted_part`: one suite's)
    nogo_on(entry)          what it is NO-GO on (by kind: `nogo_by_kind`)
    not_settled_on(entry)   the counted suites whose interval settles neither way
    not_counted(entry)      {suite: why} of what is shown and not counted
    by_state(entry)         coverage by state: {state: [suite]}, over every suite (or only those the base ran)
    rests_on(entry)         what the decision rests on, in words
    incomplete_why(entry)   why a GO rests on fewer suites than the base ran (the gate's --fail-on incomplete)
    ships(entry)            whether this variant is one to ship: a plain GO, never a GO resting on fewer suites
                            than the base ran, an INCONCLUSIVE or a NO-GO
    unreachable(step)       a next step that asks for more items than its suite has (`next_steps.py` says so)

Nothing here reads a file, and nothing here writes words for one reader only: each reader phrases these facts.
"""

from __future__ import annotations

from pipeline.verdict.coverage import DECIDED, LABELS, NOT_APPLICABLE, NOT_COUNTED, NOT_RUN
from pipeline.verdict.intervals import GO, NO_GO

ACCURACY, PERPLEXITY, JUDGE, SPEED = "accuracy", "perplexity", "judge", "speed"
PARTS = (("suites", ACCURACY), ("perplexity", PERPLEXITY))  # verdict.json's part of an entry -> its kind
SPEED_SUITE = "speed at batch 1"  # what a counted speed regression is named as


def counted_entries(entry: dict, *kinds: str) -> list[tuple[str, str, dict]]:
    """(suite, kind, its part of the entry) of everything the variant's decision counted, right/wrong suites then
    perplexity suites (each by name), then the judge, then speed at batch 1 (a counted speed is a NO-GO); only those
    of `kinds` when given. The one reading of what was counted: every reader of the figures goes through it."""
    found = [(suite, kind, d) for part, kind in PARTS
             for suite, d in (entry.get(part) or {}).items() if isinstance(d, dict) and d.get("counted")]
    judge = entry.get("judge") or {}
    if judge.get("counted"):
        found.append((JUDGE, JUDGE, judge))
    speed = entry.get("speed") or {}
    if speed.get("counted"):
        found.append((SPEED_SUITE, SPEED, speed))
    return [row for row in found if not kinds or row[1] in kinds]


def counted_part(entry: dict, kind: str, suite: str) -> dict | None:
    """The suite's part of the entry (its figures) where the decision counted it as `kind`, else None."""
    return next((d for s, k, d in counted_entries(entry, kind) if s == suite), None)


def counted(entry: dict) -> list[tuple[str, str, str | None]]:
    """(suite, kind, decision) of everything the variant's decision counted (`counted_entries`)."""
    return [(suite, kind, NO_GO if kind == SPEED else d.get("decision")) for suite, kind, d in counted_entries(entry)]


def nogo_by_kind(entry: dict) -> dict[str, list[str]]:
    """{kind: suites} of what the decision is NO-GO on (accuracy, perplexity, judge, speed)."""
    found: dict[str, list[str]] = {}
    for suite, kind, decision in counted(entry):
        if decision == NO_GO:
            found.setdefault(kind, []).append(suite)
    return found


def nogo_on(entry: dict) -> list[str]:
    """The counted suites (and the judge, and speed at batch 1) the decision is NO-GO on."""
    return [suite for suite, _, decision in counted(entry) if decision == NO_GO]


def not_settled_on(entry: dict) -> list[str]:
    """The counted suites (and the judge) whose evidence settles neither way."""
    return [suite for suite, _, decision in counted(entry) if decision not in (GO, NO_GO)]


def coverage_states(entry: dict) -> dict[str, dict]:
    """coverage.suites of the entry: {suite: {state, kind, decision, why, ...}} ({} for an entry that decided nothing)."""
    return (entry.get("coverage") or {}).get("suites") or {}


def by_state(entry: dict, *, base_ran_only: bool = False) -> dict[str, list[str]]:
    """Coverage by state: {state: [suite]} in coverage's order; `base_ran_only`: the suites the base ran only."""
    states = coverage_states(entry)
    suites = (entry.get("coverage") or {}).get("base_ran") or [] if base_ran_only else list(states)
    found: dict[str, list[str]] = {}
    for suite in suites:
        found.setdefault((states.get(suite) or {}).get("state"), []).append(suite)
    return found


def decided_on(entry: dict) -> list[str]:
    """The suites (and the judge) the decision rests on."""
    return by_state(entry).get(DECIDED, [])


def missing(entry: dict) -> dict[str, list[str]]:
    """{state: suites} of the suites the base ran that the decision does not rest on (not run, not counted, ...)."""
    return {state: suites for state, suites in by_state(entry, base_ran_only=True).items() if state != DECIDED}


def whys(entry: dict, *states: str) -> dict[str, str]:
    """{suite: why} of the suites (the judge included) in any of `states`, with the verdict's own why (else the
    state's label)."""
    return {suite: str(e.get("why") or e.get("label") or e.get("state")) for suite, e in coverage_states(entry).items()
            if e.get("state") in states}


def not_counted(entry: dict) -> dict[str, str]:
    """{suite: why} of what is shown and not counted (the judge included), with the verdict's own why."""
    return whys(entry, NOT_COUNTED)


def and_list(items) -> str:
    """"a", "a and b", "a, b and c" ("" for none)."""
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}" if items else ""


RESTS_WORDS = {NOT_RUN: "not run on this model", NOT_COUNTED: LABELS[NOT_COUNTED], NOT_APPLICABLE: LABELS[NOT_APPLICABLE]}


def rests_on(entry: dict, name=str, words: dict[str, str] | None = None) -> str:
    """What the decision rests on, in plain words: "decided on ppl-chat and ppl-book; math and code not run on this
    model; the judge shown, not counted" (`name`: how a reader names a suite; `words`: how it says each state)."""
    words = {**RESTS_WORDS, **(words or {})}
    shown = {state: [name(s) for s in suites] for state, suites in by_state(entry).items()}
    parts = [f"decided on {and_list(shown[DECIDED])}" if shown.get(DECIDED) else "nothing decided"]
    parts += [f"{and_list(shown[state])} {words[state]}" for state in words if shown.get(state)]
    return "; ".join(parts)


def incomplete_why(entry: dict) -> str:
    """Why a variant's decision rests on fewer suites than the base ran, in a few words: "decided on 4 of the 6 suites
    the base ran; math not run; code not run"."""
    ran = (entry.get("coverage") or {}).get("base_ran") or []
    states = coverage_states(entry)
    left = [s for s in ran if (states.get(s) or {}).get("state") != DECIDED]
    return (f"decided on {len(ran) - len(left)} of the {len(ran)} suites the base ran; "
            + "; ".join(f"{s} {LABELS[states[s]['state']]}" for s in left))


def complete(entry: dict) -> bool:
    """Whether the decision rests on every suite the base ran (coverage.complete; an entry without one: True)."""
    return (entry.get("coverage") or {}).get("complete") is not False


def ships(entry: dict) -> bool:
    """Whether the variant is one to ship: GO on every suite the base ran. A GO on fewer (GO, incomplete), an
    INCONCLUSIVE, a NO-GO or an entry that decided nothing is not."""
    return entry.get("decision") == GO and complete(entry)


def unreachable(step: dict) -> bool:
    """Whether a next step asks for more items than its suite has (`available`, when the results recorded it)."""
    available, needed = step.get("available"), step.get("needed")
    return isinstance(available, int) and isinstance(needed, int) and needed > available
