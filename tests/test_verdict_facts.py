"""Issue 65 item 3 (the verdict part) and issue 69 items 5 and 6: what a decision means is derived once
(pipeline/verdict/facts.py) and every reader (headline, first screen, fix, gate, cards) reads it; only a plain GO is
said to ship; no next step asks for more items than the suite has."""

import json
from pathlib import Path

import numpy as np

from pipeline.settings.params import Params
from pipeline.verdict import facts, intervals, perplexity as perplexity_verdict
from pipeline.verdict.headline import headline
from pipeline.verdict.next_steps import next_steps, suite_size
from conftest import TINY_PARAMS
from test_perplexity_verdict import documents, simulated

REPO = Path(__file__).resolve().parent.parent


def example_verdict(which: str = "example") -> dict:
    return json.loads((REPO / "reports" / which / "verdict.json").read_text())


def test_the_facts_of_the_example_are_those_its_entries_hold():
    variants = example_verdict()["variants"]
    fp8, awq, mixed = variants["fp8-w8a8"], variants["awq-w4a16"], variants["rtn-w4a16-mixed"]
    assert facts.nogo_on(awq) == ["ppl-book", "ppl-code", "ppl-math"]
    assert facts.nogo_by_kind(awq) == {"perplexity": ["ppl-book", "ppl-code", "ppl-math"]}
    assert facts.not_settled_on(mixed) == ["ppl-book", "ppl-code", "ppl-math"]
    assert facts.missing(fp8) == {"not run": ["math", "code"]}
    assert facts.not_counted(fp8) == {"judge": "unreliable: the judge contradicts itself with the answers swapped"}
    assert facts.rests_on(fp8).startswith("decided on ppl-chat, ppl-book, ppl-math and ppl-code; math and code not run")
    assert not facts.ships(fp8) and not facts.complete(fp8)  # GO on fewer suites than the base ran


def test_only_a_plain_go_is_said_to_ship_and_the_headline_reads_the_same_fact():
    """Issue 69 item 5: the example's headline said "Ship fp8-w8a8" for a GO resting on 4 of the 6 suites the base
    ran, while its card said not to publish it."""
    verdict = example_verdict()
    text = headline(verdict)
    assert text.startswith("Ship none yet: fp8-w8a8 GO, incomplete, on 4 perplexity suites (math, code not run);")
    assert not any(facts.ships(v) for v in verdict["variants"].values())
    whole = {**verdict["variants"]["fp8-w8a8"], "coverage": {**verdict["variants"]["fp8-w8a8"]["coverage"],
                                                            "complete": True}}
    assert facts.ships(whole) and headline({"variants": {"fp8-w8a8": whole}}).startswith("Ship fp8-w8a8: GO")


def _open_suite(available):
    rng = np.random.default_rng(0)
    base, near, tokens = simulated(rng, 4, rise=0.05, spread=0.05)
    return perplexity_verdict.compare_perplexity(documents(base, tokens), documents(near, tokens), variant="v",
                                                 suite="ppl-book", margin=0.05, available=available)


def test_no_next_step_asks_for_more_documents_than_the_suite_has():
    """Issue 69 item 6: "about 2093 documents would settle it" on a suite of 164."""
    unknown = _open_suite(None)
    needed = unknown.documents_to_settle
    assert unknown.decision == intervals.INCONCLUSIVE and needed > 10
    assert f"about {needed} paired documents would likely settle it" in unknown.sentence
    small = _open_suite(needed - 1)
    assert f"cannot be settled on this suite ({needed - 1} documents)" in small.sentence
    assert f"about {needed} paired documents" not in small.sentence + " ".join(small.reasons)
    params = Params.model_validate(TINY_PARAMS)
    [step] = next_steps("v", [], {"ppl-book": small}, None, {}, params)
    assert step["needed"] is None and step["commands"] == [] and step["available"] == needed - 1
    assert "cannot be settled on this suite" in step["text"] and "--limit" not in step["text"]
    [step] = next_steps("v", [], {"ppl-book": _open_suite(needed)}, None, {}, params)
    assert step["needed"] == needed and f"--limit {needed}" in step["commands"][0]  # the suite holds them: asked


def test_the_suite_size_is_what_quantize_eval_recorded_for_both_models():
    summaries = {"base": {"ppl-code": {"available": 164}}, "v": {"ppl-code": {"available": 170}}, "w": {}}
    assert suite_size(summaries, "v", "ppl-code") == 164
    assert suite_size(summaries, "w", "ppl-code") == 164 and suite_size(summaries, "v", "math") is None


def test_what_was_counted_is_read_in_one_place():
    """Issue 65.3: the readers of a verdict (the headline, the fix, the next steps, the first screen, the recovery
    table, the cards) learn what a decision counted through pipeline/verdict/facts.py, never by reading an entry's
    `counted` flag themselves: only facts.py and the modules that set it (the judge's, speed's and the coverage it
    is derived from) name it."""
    import re

    setters = {"facts.py", "coverage.py", "judge.py", "speed.py"}
    reads = re.compile(r"""\.get\(["']counted["']\)|\[["']counted["']\]""")
    found = [f"{p.relative_to(REPO)}:{n}" for folder in ("verdict", "report")
             for p in sorted((REPO / "pipeline" / folder).glob("*.py")) if p.name not in setters
             for n, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert found == []


def test_coverage_by_state_is_read_in_one_place():
    """Issue 65.3: what each suite's state is (decided, not counted and why, not run, ...) is read off an entry through
    facts.py (coverage_states, by_state, whys, missing, rests_on), never by a reader's own walk of its coverage."""
    import re

    reads = re.compile(r"""\.get\(["']coverage["']\)\s*or\s*\{\}\)\.get\(["']suites["']\)|\[["']coverage["']\]\[["']suites["']\]""")
    found = [f"{p.relative_to(REPO)}:{n}" for folder in ("verdict", "report")
             for p in sorted((REPO / "pipeline" / folder).glob("*.py")) if p.name not in ("facts.py", "coverage.py")
             for n, line in enumerate(p.read_text().splitlines(), 1) if reads.search(line)]
    assert found == []
