"""What to ship, in one sentence: verdict.json's `headline` (the report's first line, the first line `quantize
show-verdict` prints) and `decisions` (each variant's label and what it rests on, in the order the page shows them).

A GO whose decision rests on fewer suites than the base ran (`--fail-on incomplete` fails it) is labelled
"GO, incomplete" everywhere, never a plain GO, and is never said to ship: only a plain GO is (facts.ships, what the
model cards and the gate read too). Variants come GO first (complete, then incomplete), then INCONCLUSIVE, then
NO-GO, then any other entry verdict.json holds (e.g. a variant not built), each group in the order verdict.json
lists them.

    Ship awq-w4a16: GO on 2 accuracy suites and 4 perplexity suites; rtn-w4a16 NO-GO on ppl-book.
    Ship none yet: fp8-w8a8 GO, incomplete, on 4 perplexity suites (math, code not run); awq-w4a16 NO-GO on ppl-book.
    Ship none: awq-w4a16 and rtn-w4a16 INCONCLUSIVE, not settled on ppl-code.

What each decision counted, is NO-GO or not settled on and rests on is pipeline/verdict/facts.py's.

Nothing here reads a file: it reads the verdict `decide` wrote (pipeline/verdict/decision.py) and the base's
config.json the report stage hands it (whether the base is synthetic: pipeline/verdict/synthetic.py).
"""

from __future__ import annotations

import pipeline.verdict.facts as facts
from pipeline.verdict.coverage import LABELS, coverage_line
from pipeline.verdict.facts import and_list  # noqa: F401  (the readers' "a, b and c")
from pipeline.verdict.intervals import GO, INCONCLUSIVE, NO_GO
from pipeline.verdict.synthetic import synthetic

GO_INCOMPLETE = "GO, incomplete"
ORDER = (GO, GO_INCOMPLETE, INCONCLUSIVE, NO_GO)  # anything else (not built, not evaluated, ...) comes after
SHIPPABLE = (GO,)  # what the headline, the gate and the cards say to ship: a plain GO only (facts.ships)


def label(entry: dict) -> str:
    """The decision as the reviewer reads it: "GO, incomplete" for a GO that rests on fewer suites than the base
    ran; any other entry's own decision (or state) as verdict.json gives it."""
    decision = str(entry.get("decision") or entry.get("state") or "no decision")
    if decision == GO and not facts.complete(entry):
        return GO_INCOMPLETE
    return decision


def ordered(variants: dict) -> list[str]:
    """The variants' names, GO first, then GO incomplete, INCONCLUSIVE, NO-GO and any other label."""
    rank = {name: ORDER.index(label(v)) if label(v) in ORDER else len(ORDER) for name, v in variants.items()}
    return sorted(variants, key=lambda name: rank[name])  # stable: verdict.json's order within a group


def _missing(entry: dict) -> str:
    """The suites the base ran that the variant's decision does not rest on, by state: "math, code not run"."""
    return "; ".join(f"{', '.join(suites)} {LABELS.get(state, str(state))}"
                     for state, suites in facts.missing(entry).items())


def rests(entry: dict) -> str:
    """What the decision rests on, without the decision: the coverage line ("on 4 perplexity suites; math, code
    not run; ..."), or for an entry that decided nothing (not built, ...) its why."""
    suites = facts.coverage_states(entry)
    return coverage_line("", suites).strip().lstrip(": ") if suites else str(entry.get("why") or entry.get("reason") or "")


def _rests_on(entry: dict) -> str:
    """"4 perplexity suites" or "2 accuracy suites and the judge": the first part of the coverage line."""
    return rests(entry).split(";")[0].removeprefix("on ")


def phrase(entry: dict) -> str:
    """What one variant's decision rests on, in the headline's words (without its name)."""
    name = label(entry)
    if name in (GO, GO_INCOMPLETE):
        missing = _missing(entry)
        return f"{name}, on {_rests_on(entry)} ({missing})" if missing else f"{name} on {_rests_on(entry)}"
    if name == NO_GO:
        return f"NO-GO on {', '.join(facts.nogo_on(entry)) or 'what it counted'}"
    if name == INCONCLUSIVE:
        open_ = facts.not_settled_on(entry)
        return f"INCONCLUSIVE, not settled on {', '.join(open_)}" if open_ else "INCONCLUSIVE, nothing counted"
    why = entry.get("why") or entry.get("reason")
    return f"{name}: {why}" if why else name


def _grouped(variants: dict, names: list[str]) -> list[str]:
    """"awq-w4a16 and rtn-w4a16 NO-GO on ppl-chat": variants with the same phrase named together."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(phrase(variants[name]), []).append(name)
    return [f"{and_list(members)} {text}" for text, members in groups.items()]


def headline(verdict: dict) -> str:
    """One sentence a reviewer can act on: which variant to ship (or none) and what each decision rests on."""
    variants = verdict.get("variants") or {}
    names = ordered(variants)
    if not names:
        return "Ship none: no variant was decided."
    synthetic = verdict.get("synthetic")
    ship = [] if synthetic else [n for n in names if facts.ships(variants[n])]
    rest = [n for n in names if n not in ship]
    if len(ship) == 1:
        parts = [f"Ship {ship[0]}: {phrase(variants[ship[0]])}"]
    elif ship:
        parts = [f"Ship any of {and_list(ship)}: " + "; ".join(_grouped(variants, ship))]
    elif synthetic:
        parts = [f"Ship none on this evidence: {synthetic.get('short') or synthetic.get('why')} (timing only: these "
                 "accuracy figures mean nothing); as computed"]
    elif any(label(variants[n]) == GO_INCOMPLETE for n in names):  # GO on fewer suites than the base ran: not yet
        parts = ["Ship none yet"]
    else:
        parts = ["Ship none"]
    text = parts[0] + (": " if not ship and rest else "; " if rest else "") + "; ".join(_grouped(variants, rest))
    return text.rstrip("; ") + "."


def decisions(verdict: dict) -> list[dict]:
    """verdict.json's `decisions`: per variant, in the page's order, its decision, its label and what it rests
    on (the coverage line, led by the label)."""
    variants = verdict.get("variants") or {}
    rows = []
    for name in ordered(variants):
        entry = variants[name]
        line = f"{label(entry)} {rests(entry)}" if facts.coverage_states(entry) else phrase(entry)
        rows.append({"variant": name, "decision": entry.get("decision"), "label": label(entry), "rests_on": line,
                     "why": entry.get("why") or ""})
    return rows


def with_headline(verdict: dict, base: dict | None, floor: float) -> dict:
    """The verdict opening with what to ship: `headline`, `synthetic` when the base's accuracy figures mean nothing
    (pipeline/verdict/synthetic.py: read off the base's scores and `base`, what its config.json says), and
    `decisions`."""
    found = synthetic(verdict["base"]["suites"], base, floor)
    verdict = {"headline": None, **({"synthetic": found} if found else {}), "decisions": None, **verdict}
    verdict["headline"], verdict["decisions"] = headline(verdict), decisions(verdict)
    return verdict
