"""Needle-in-a-haystack and multi-key retrieval over Alice's Adventures in Wonderland.

Items are generated, not stored: each one is seeded by its own id, so an item never changes
when the ladder around it does (other lengths skipped, more repeats), and the resume cache
keeps matching. lm-eval has no tokenizer here: a length is nominal, the whole prompt measured
as characters / `chars_per_token` (the pipeline passes the model tokenizer's ratio on this text
through the task metadata; 4.0 otherwise). Lengths that do not fit `max_context` (also from the
metadata) minus room for the answer are skipped, never truncated.

Scoring (`process_results`): `acc` reads the number the model committed to, the first number of at
least ANSWER_DIGITS digits in its output, thousands separators allowed (`4,829,317`), and compares it
with the needle's value. lm-eval's RULER scorer (`string_match_all`, the peer in
tests/test_scorer_corpora.py) instead counts the value anywhere in the output as a substring: an
output that lists every needle's number, or a longer number holding the value's digits, scores right
there and wrong here; one that writes the value with separators scores wrong there and right here.
`exact_match` stays the strict reading: the whole output is the value (a final period allowed).
"""

from __future__ import annotations

import random
import re
from pathlib import Path

HAYSTACK = Path(__file__).with_name("alice29.txt")
LENGTHS = (1024, 2048, 4096, 8192)
DEPTHS = (0, 25, 50, 75, 100)
KINDS = ("niah", "multikey")
REPEATS = 4
N_KEYS = 4  # needles in a multi-key item; one is asked for
CHARS_PER_TOKEN = 4.0
ANSWER_ROOM = 64  # tokens kept free for the chat template and the answer
SLACK = 1.05  # the ratio is measured on the book's opening; other windows tokenize a few % longer

KEYS = ("amber-falcon", "silver-otter", "crimson-maple", "quiet-harbor", "iron-lantern", "velvet-comet",
        "golden-thistle", "hollow-pine", "cobalt-river", "marble-owl", "scarlet-fern", "frozen-meadow")
INTRO = ("Below is a long text. Hidden in it are one or more special magic numbers, each for a name. "
         "Read it carefully; a question about it follows.\n\n<text>\n")
QUESTION = ("\n</text>\n\nWhat is the special magic number for {key} mentioned in the text? "
            "Answer with the number only.")
NEEDLE = "The special magic number for {key} is {value}. "


def haystack_text() -> str:
    return re.sub(r"\s+", " ", HAYSTACK.read_text(encoding="utf-8")).strip()


def fitting_lengths(lengths, max_context: int | None) -> tuple[list[int], list[int]]:
    """(kept, skipped): a length is kept when it (plus slack) and the answer room fit the context."""
    if not max_context:
        return list(lengths), []
    kept = [n for n in lengths if n * SLACK + ANSWER_ROOM <= max_context]
    return kept, [n for n in lengths if n not in kept]


def item_id(kind: str, length: int, depth: int, repeat: int) -> str:
    return f"{kind}-{length}-d{depth}-{repeat:02d}"


def _window(text: str, rng: random.Random, n_chars: int) -> str:
    """n_chars of the book from a seeded start, wrapping round to its beginning if needed."""
    start = rng.randrange(len(text))
    doubled = text + " " + text
    while len(doubled) < start + n_chars:
        doubled += " " + text
    window = doubled[start:start + n_chars]
    return window[window.find(" ") + 1:] if start else window  # start on a whole word


def _boundary(text: str, target: int) -> int:
    """The sentence end nearest to target (within 200 characters), else the nearest space."""
    ends = [m.end() for m in re.finditer(r"[.!?'] ", text[max(0, target - 200):target + 200])]
    if ends:
        offset = max(0, target - 200)
        return min((offset + e for e in ends), key=lambda p: abs(p - target))
    space = text.rfind(" ", 0, target)
    return space + 1 if space >= 0 else 0


def _insert(text: str, fraction: float, needle: str) -> tuple[str, int]:
    at = 0 if fraction <= 0 else len(text) if fraction >= 1 else _boundary(text, round(fraction * len(text)))
    if at and text[at - 1] != " ":
        text, at = text[:at] + " " + text[at:], at + 1
    return text[:at] + needle + text[at:], at


def make_item(kind: str, length: int, depth: int, repeat: int, chars_per_token: float = CHARS_PER_TOKEN,
              text: str | None = None) -> dict:
    rng = random.Random(item_id(kind, length, depth, repeat))
    text = text or haystack_text()
    n_keys = N_KEYS if kind == "multikey" else 1
    keys = rng.sample(KEYS, n_keys)
    values = [str(v) for v in rng.sample(range(1_000_000, 10_000_000), n_keys)]
    needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
    fixed = len(INTRO) + len(QUESTION.format(key=keys[0])) + sum(map(len, needles))
    context = _window(text, rng, max(0, round(length * chars_per_token) - fixed))
    for needle in needles[1:]:  # distractors first, anywhere; the asked needle last, at its depth
        context, _ = _insert(context, rng.random(), needle)
    context, offset = _insert(context, depth / 100, needles[0])
    return {
        "id": item_id(kind, length, depth, repeat), "kind": kind, "nominal_tokens": length, "depth": depth,
        "key": keys[0], "value": values[0], "keys": keys, "context": context,
        "needle_offset": offset, "needle": needles[0],
    }


def generate(lengths=LENGTHS, depths=DEPTHS, kinds=KINDS, repeats=REPEATS, chars_per_token=CHARS_PER_TOKEN):
    """Every item of the ladder, ordered by length, then kind, depth and repeat."""
    text = haystack_text()
    return [make_item(kind, length, depth, repeat, chars_per_token, text)
            for length in lengths for kind in kinds for depth in depths for repeat in range(repeats)]


def load_long_context(lengths=LENGTHS, depths=DEPTHS, kinds=KINDS, repeats=REPEATS, max_context=None,
                      chars_per_token=CHARS_PER_TOKEN, **_):
    """lm-eval's custom_dataset: the ladder, less the lengths beyond max_context."""
    import datasets

    max_context = int(max_context) if max_context else None  # from the CLI's --metadata it may be text
    kept, _ = fitting_lengths([int(n) for n in lengths], max_context)
    if not kept:
        raise ValueError(f"long_context: no length of the ladder {list(lengths)} fits a context of {max_context} "
                         f"tokens (each needs 5% slack and {ANSWER_ROOM} tokens for the answer); "
                         "the suite does not apply")
    rows = generate(kept, depths, kinds, int(repeats), float(chars_per_token))
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return INTRO + doc["context"] + QUESTION.format(key=doc["key"])


def doc_to_target(doc):
    return doc["value"]


ANSWER_DIGITS = 5  # every value is a 7-digit number; shorter numbers in an answer are ordinals, counts or years
NUMBER = re.compile(r"\d{1,3}(?:[,. \u202f\u00a0]\d{3})+(?!\d)|\d+")


def committed_value(output: str) -> str | None:
    """The digits of the first number of at least ANSWER_DIGITS digits in the output, separators dropped."""
    for match in NUMBER.finditer(output):
        digits = re.sub(r"\D", "", match.group())
        if len(digits) >= ANSWER_DIGITS:
            return digits
    return None


def process_results(doc, results):
    output = results[0].strip()
    return {"acc": float(committed_value(output) == doc["value"]),
            "exact_match": float(output.rstrip(".") == doc["value"])}
