"""The GSM8K scorer (evals/math/utils.py) on a corpus of tricky answers with the verdict each should
get, beside its peers: lm-eval's own gsm8k filters (strict-match, flexible-extract, read from the
installed task YAML and run through lm-eval's RegexFilter and exact_match) and math-verify on the
whole output. Ours must agree with every expected verdict; the peers' agreement is measured
(`peer_agreement`, printed by `python tests/test_math_scorer.py`) and their documented
differences are asserted."""

import importlib.util
from fractions import Fraction
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# (name, model output, reference answer, expected verdict)
CORPUS = [
    # the committed answer, in the many ways a model writes it
    ("plain", "Janet sells 16 - 3 - 4 = 9 eggs.\n9 * 2 = 18\nAnswer: 18", "18", True),
    ("dollars and cents", "She makes 9 * $2 = $18 a day.\nAnswer: $18.00", "18", True),
    ("dollar sign", "Answer: $18", "18", True),
    ("thousands separator", "Answer: 1,234", "1234", True),
    ("thousands and cents, unit", "Answer: 1,234.00 dollars", "1234", True),
    ("narrow no-break space separator", "Answer: 1\u202f234", "1234", True),
    ("latex thousands", "The total is \\boxed{1{,}234}.", "1234", True),
    ("gsm8k gold with comma", "Answer: 2,125", "2125", True),
    ("unicode minus", "The temperature falls to \u22125.\nAnswer: \u22125", "-5", True),
    ("ascii minus", "Answer: -5", "-5", True),
    ("unit after", "Answer: 18 apples", "18", True),
    ("unit glued", "Answer: 18km", "18", True),
    ("percent", "Answer: 25%", "25", True),
    ("decimal answer", "Answer: 18.5", "18.5", True),
    ("fraction", "Answer: 3/4", "0.75", True),
    ("latex fraction", "Answer: $\\frac{3}{4}$", "0.75", True),
    ("mixed number", "Answer: 1 1/2 cups", "1.5", True),
    ("zero", "Nothing is left.\nAnswer: 0", "0", True),
    ("bold marker", "**Answer:** 18", "18", True),
    ("bold answer", "Answer: **$18.00** per day.", "18", True),
    ("final answer heading", "### Final Answer: 18", "18", True),
    ("answer on the next line", "So she earns 18 dollars.\n\nAnswer:\n18", "18", True),
    ("boxed", "Therefore the answer is $\\boxed{18}$.", "18", True),
    ("boxed dollar", "\\[\\boxed{\\$18}\\]", "18", True),
    ("gsm8k hashes", "9 * 2 = 18\n#### 18", "18", True),
    ("sentence after the marker", "Answer: The farmer has 18 cows.", "18", True),
    # trailing working after the answer (the three cases and kin)
    ("working in parentheses", "Answer: 18 (calculated as 6 * 3)", "18", True),
    ("sentence after the number", "Answer: 18. So 18 apples for 3 friends.", "18", True),
    ("note after the answer", "Answer: 18\n\nNote: this assumes 2 weeks of 7 days.", "18", True),
    ("more working after", "Answer: 18 dollars. She makes 18 * 7 = 126 a week.", "18", True),
    ("equation, result last", "Answer: 6 * 3 = 18", "18", True),
    ("equation, result first", "Answer: 18 = 6 * 3", "18", True),
    ("variable", "Answer: x = 18", "18", True),
    ("answer-is phrasing", "So, the load time of the download is 160 minutes.\n\nThe answer is 160.", "160", True),
    ("answer-is with working", "So, the answer is 4 + 16 = 20.\n\nThe final answer is 20.", "20", True),
    ("answer-is colon and subtraction", "The answer is: 1000 - 400 = 600.", "600", True),
    ("nested markers", "So the net profit is $0.\n\nThe answer is: Answer: 0.", "0", True),
    # runaway continuations: the first committed answer counts
    ("runaway next question", "Answer: 18\n\nQuestion: Tom has 3 apples and eats 2. How many are left?\nAnswer: 1",
     "18", True),
    ("repeated then cut", "Answer: 18\nAnswer: 18\nAnswer: 18\nAnswer: 1", "18", True),
    ("repeated answer-is then cut", "The answer is 160.\n\nThe answer is 160.\n\nThe answer is 16", "160", True),
    # an answer corrected explicitly: the correction counts, unless it sits inside a runaway new question
    ("explicit correction", "Answer: 16\nWait, that is wrong. Answer: 18", "18", True),
    ("correction with actually", "The answer is 45.\n\nActually, I forgot the tip: 45 + 9 = 54.\nThe answer is 54.",
     "54", True),
    ("mistake owned and fixed", "Answer: 120\n\nI made a mistake in step 2: 8 * 12 = 96, not 120.\nAnswer: 96",
     "96", True),
    ("corrected away from the reference", "Answer: 30\nCorrection: she gave away 5 more, so Answer: 25", "30", False),
    ("check that confirms", "Answer: 72\nWait, let me check: 8 * 9 = 72. Yes.", "72", True),
    ("wait inside a runaway question",
     "Answer: 18\n\nQuestion: Wait times at a clinic average 3 hours. How long are 2 waits?\nAnswer: 6", "18", True),
    # nothing but the answer: no marker needed
    ("bare number", "42", "42", True),
    ("bare dollars and cents", "$1,250.00", "1250", True),
    ("bare euros", "€36", "36", True),
    ("bare with unit", "27 marbles.", "27", True),
    ("bare negative", "-12", "-12", True),
    ("bare degrees, unicode minus", "\u22127°C", "-7", True),
    ("bare fraction", "5/8", "0.625", True),
    ("bare decimal", "0.35", "0.35", True),
    ("bare whole with decimals", "64.0", "64", True),
    ("bare percent", "40%", "40", True),
    ("bare bold", "**96**", "96", True),
    ("bare mixed number", "2 3/4 pounds", "2.75", True),
    ("bare but wrong", "43", "42", False),
    ("unmarked working ending in a number", "Each box holds 12 pencils, so 5 boxes hold 5 * 12 = 60", "60", False),
    ("cut after a number mid-sentence", "First, 14 + 9 = 23 students. Then the", "23", False),
    # numbers in words, thousands with a plain space, powers of ten
    ("words", "Answer: fifty-six", "56", True),
    ("words, hundred and", "The answer is three hundred and twelve.", "312", True),
    ("words, thousands", "Answer: two thousand four hundred dollars", "2400", True),
    ("words but wrong", "Answer: fifteen", "16", False),
    ("decimal million", "Answer: $2.5 million", "2500000", True),
    ("plain space thousands", "Answer: 45 000", "45000", True),
    ("plain space thousands, currency", "Answer: $3 600 per month", "3600", True),
    ("power of ten", "Answer: 4.5 \u00d7 10^3", "4500", True),
    ("latex power of ten", "Answer: $2 \\times 10^{4}$", "20000", True),
    ("e notation", "Answer: 7.2e5", "720000", True),
    ("power of ten but wrong", "Answer: 4.5 \u00d7 10^2", "4500", False),
    # cut off at the token cap, or no final answer at all
    ("cut mid-sum", "Step 1: 2 + 2 = 4\nStep 2: Add the rest: 2 + 2 + 2 + 2", "8", False),
    ("cut at a step", "Step 5: 3 * 6 = 18 apples in all.\nStep 6: Determine", "18", False),
    ("no marker", "Janet sells 9 eggs at $2 each, so she makes 18 dollars every day.", "18", False),
    ("cut after the marker", "9 * 2 = 18\nAnswer:", "18", False),
    ("cut inside the box", "So the total is \\boxed{18", "18", False),
    ("final answer a bare sum, cut", "The final answer is: 15 + 20 + 20 + 4 +", "59", False),
    ("bare expression", "Answer: 2 + 2 + 2 + 2", "8", False),
    ("placeholder echoed", "I will write it as Answer: <number>", "18", False),
    ("empty", "", "18", False),
    # plain wrong answers
    ("wrong number", "9 * 2 = 18\nAnswer: 17", "18", False),
    ("off by a digit", "Answer: 18", "180", False),
    ("wrong decimal", "Answer: 18.5", "18", False),
    ("wrong after equation", "Answer: 6 * 3 = 24", "18", False),
]


@pytest.fixture(scope="module")
def math_utils():
    spec = importlib.util.spec_from_file_location("math_utils", REPO / "evals" / "math" / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_corpus_is_big_enough_and_balanced():
    assert len(CORPUS) >= 40 and len({name for name, *_ in CORPUS}) == len(CORPUS)
    assert 10 <= sum(1 for *_, expected in CORPUS if not expected) <= len(CORPUS) - 10


@pytest.mark.parametrize("name,output,target,expected", CORPUS, ids=[c[0] for c in CORPUS])
def test_scorer_gives_the_expected_verdict(math_utils, name, output, target, expected):
    assert math_utils.is_correct(output, target) is expected, math_utils.final_answer(output)
    doc = {"answer": f"working\n#### {target}", "question": "q"}
    assert math_utils.process_results(doc, [output])["acc"] == float(expected)


def test_committed_values(math_utils):
    assert math_utils.final_answer("Answer: 3/4") == Fraction(3, 4)
    assert math_utils.final_answer("Answer: $1,234.50.") == Fraction("1234.5")
    assert math_utils.final_answer("Answer: \\dfrac{36}{2}") == 18
    assert math_utils.final_answer("no marker 18") is None


# ---------------------------------------------------------------- peers

def _lm_eval_gsm8k():
    """lm-eval's own gsm8k task config: its two filters and its exact_match settings."""
    import lm_eval
    import yaml

    return yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml").read_text())


def lm_eval_verdicts(output: str, target: str) -> dict[str, bool]:
    """strict-match and flexible-extract exactly as lm-eval runs them: RegexFilter + take_first on the
    response, then exact_match against the reference solution (which ends '#### <answer>')."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters.extraction import RegexFilter

    config = _lm_eval_gsm8k()
    metric = config["metric_list"][0]
    options = {k: metric[k] for k in ("regexes_to_ignore", "ignore_case", "ignore_punctuation")}
    verdicts = {}
    for pipeline in config["filter_list"]:
        regex = next(step for step in pipeline["filter"] if step["function"] == "regex")
        extractor = RegexFilter(regex_pattern=regex["regex_pattern"], group_select=regex.get("group_select", 0))
        extracted = list(extractor.apply([[output]], [{}]))[0][0]  # take_first: the one response
        score = exact_match_hf_evaluate(predictions=[extracted], references=[f"working\n#### {target}"], **options)
        verdicts[pipeline["name"]] = bool(score["exact_match"])
    return verdicts


def math_verify_verdict(output: str, target: str) -> bool:
    from math_verify import parse, verify

    try:
        return bool(verify(parse(target), parse(output)))
    except Exception:
        return False


def peer_agreement(math_utils) -> dict[str, dict]:
    """{scorer: {"agree": count, "disagree": [case names]}} over the corpus."""
    table = {name: {"agree": 0, "disagree": []} for name in ("ours", "strict-match", "flexible-extract", "math-verify")}
    for name, output, target, expected in CORPUS:
        verdicts = {"ours": math_utils.is_correct(output, target), **lm_eval_verdicts(output, target),
                    "math-verify": math_verify_verdict(output, target)}
        for scorer, verdict in verdicts.items():
            if verdict == expected:
                table[scorer]["agree"] += 1
            else:
                table[scorer]["disagree"].append(name)
    return table


def test_peers_run_as_lm_eval_does_and_differ_where_the_docstring_says(math_utils):
    assert lm_eval_verdicts("The answer is 18.\n#### 18", "18") == {"strict-match": True, "flexible-extract": True}
    assert lm_eval_verdicts("Answer: 18", "18") == {"strict-match": False, "flexible-extract": True}
    table = peer_agreement(math_utils)
    assert table["ours"]["disagree"] == []
    flexible = set(table["flexible-extract"]["disagree"])
    # the last number anywhere: trailing working, runaway text and cut-off outputs fool it
    assert {"note after the answer", "working in parentheses", "runaway next question", "cut after the marker",
            "no marker"} <= flexible
    assert "gsm8k hashes" not in table["strict-match"]["disagree"]
    assert len(table["strict-match"]["disagree"]) > len(CORPUS) / 3  # our prompt asks for Answer:, not ####
    # math-verify on the whole output scores cut-off and unmarked working (the demo's 6 capped "right" items)
    assert {"cut mid-sum", "cut after the marker", "no marker"} <= set(table["math-verify"]["disagree"])


if __name__ == "__main__":
    spec = importlib.util.spec_from_file_location("math_utils", REPO / "evals" / "math" / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for scorer, row in peer_agreement(module).items():
        print(f"{scorer}: {row['agree']}/{len(CORPUS)} agree; disagree on: {', '.join(row['disagree']) or '-'}")
