"""The long-context and VQA scorers on small corpora of tricky outputs with the verdict each should
get; the long-context one beside its peer, lm-eval's RULER scorer (string_match_all)."""

import importlib.util

import pytest

from conftest import REPO


def _load(path: str):
    spec = importlib.util.spec_from_file_location(path.replace("/", "_"), REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VALUE = "4829317"  # asked for amber-falcon; 7715204 is a distractor's value
LONG_CONTEXT = [
    ("number only", "4829317", True),
    ("final period", "4829317.", True),
    ("sentence", "The special magic number for amber-falcon is 4829317.", True),
    ("thousands separators", "4,829,317", True),
    ("thin-space separators", "4\u202f829\u202f317", True),
    ("bold", "**4829317**", True),
    ("short numbers first", "In chapter 2 of the text, the number for amber-falcon is 4829317.", True),
    ("runaway after the answer", "4829317\n\nThe special magic number for silver-otter is 7715204.", True),
    ("answer then a guess", "4829317, or maybe 7715204.", True),
    ("distractor's value", "7715204", False),
    ("every needle listed, wrong one first", "silver-otter: 7715204, amber-falcon: 4829317", False),
    ("longer number holding the digits", "48293170", False),
    ("cut off at the cap", "The special magic number for amber-falcon is 482931", False),
    ("no number", "I could not find a magic number for amber-falcon.", False),
    ("empty", "", False),
]


@pytest.mark.parametrize("name,output,expected", LONG_CONTEXT, ids=[c[0] for c in LONG_CONTEXT])
def test_long_context_scorer(name, output, expected):
    scorer = _load("evals/long_context/utils.py")
    assert scorer.process_results({"value": VALUE}, [output])["acc"] == float(expected)


def test_long_context_against_lm_evals_ruler_scorer():
    """RULER counts the value as a substring anywhere: it agrees with us except where it gives credit
    to a list of every needle or to a longer number, and denies it to separators."""
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all

    scorer = _load("evals/long_context/utils.py")
    disagree = {name for name, output, expected in LONG_CONTEXT
                if bool(string_match_all(postprocess_pred([output]), [[VALUE]])) != expected}
    assert disagree == {"thousands separators", "thin-space separators", "every needle listed, wrong one first",
                        "longer number holding the digits"}
    assert all(scorer.process_results({"value": VALUE}, [o])["acc"] == float(e) for _, o, e in LONG_CONTEXT)


VQA = [  # (output, gold, expected)
    ("triangle", "triangle", True),
    ("Triangle.", "triangle", True),
    (" answer: triangle", "triangle", True),
    ("Answer: Triangle", "triangle", True),
    ("**Triangle**", "triangle", True),
    ("a triangle", "triangle", True),
    ("It is a triangle.", "triangle", True),
    ("The answer is: yes", "yes", True),
    ("Yes, it does.", "yes", True),
    ("No.", "no", True),
    ("teal\n\nQuestion: what color is the circle?\nAnswer: red", "teal", True),
    ("circle", "triangle", False),
    ("blue triangle", "triangle", False),
    ("The shape is a circle.", "circle", False),
    ("yes", "no", False),
    ("Nope", "no", False),
    ("", "yes", False),
]


@pytest.mark.parametrize("output,gold,expected", VQA, ids=[f"{i}-{c[0][:20]}" for i, c in enumerate(VQA)])
def test_vqa_scorer(output, gold, expected):
    scorer = _load("evals/vqa/utils.py")
    assert scorer.process_results({"answer": gold}, [output])["exact_match"] == float(expected)
