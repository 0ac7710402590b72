"""What the four generated visual suites share (evals/visual/<suite>/: charts, documents, small_text, counting).

Each suite is a generator and its seed: items are made when lm-eval loads the task, the same on every machine, each
seeded by its own suite, seed and index (an item never changes when the count around it does), never read from a
dataset. An item holds its question, its exact answer (`answer_type`: a number, compared as a number, or a text,
compared normalised), what its image is drawn from (`spec`, JSON: the image is drawn again from it, with Pillow and
the font Pillow ships, `ImageFont.load_default(size=...)`) and its difficulty (`difficulty`: font size, element
count, image size, ...), which the pipeline copies into the item's result line (pipeline/stages/evaluate.py) and the
suite's table groups by (`by_difficulty`: accuracy per bin of the suite's axis, the report's table per suite).

Items are ordered so that every run of consecutive items covers the difficulty bins in turn: a `limit` keeps every
bin. Options (params.yaml suites.<name>.options): `n_items` (default N_ITEMS) and `seed` (default SEED).
"""

from __future__ import annotations

import json
import random
import re
from collections import defaultdict
from decimal import Decimal, InvalidOperation
from functools import lru_cache

N_ITEMS = 200  # items per suite unless options.n_items says otherwise (params.yaml `limit` takes the first ones)
SEED = 0
MAX_ITEMS = 10_000
OPTIONS = {"n_items": f"items to generate, 1 to {MAX_ITEMS} (default {N_ITEMS})",
           "seed": f"the generator's seed, a whole number (default {SEED}): another seed, other items"}
INSTRUCTIONS = {"number": "Answer with the number only.", "text": "Answer with the text only."}
PROMPT = "<image>\n{question}\n{instruction}"
INK, PAPER = (20, 20, 20), (255, 255, 255)


@lru_cache(maxsize=None)
def font(px: int):
    """The font Pillow ships (Aileron Regular through FreeType, Pillow >= 10.1) at `px` pixels: no font file of the
    machine's, so an image is drawn alike wherever the same Pillow runs."""
    from PIL import ImageFont

    return ImageFont.load_default(size=px)


def text_width(text: str, px: int) -> int:
    return int(round(font(px).getlength(text)))


def item_rng(suite: str, seed: int, index: int) -> random.Random:
    return random.Random(f"{suite}:{seed}:{index}")


def generate(suite: str, make, n_items: int = N_ITEMS, seed: int = SEED) -> list[dict]:
    """The suite's items: make(rng, index) -> {question, answer, answer_type, difficulty, spec}, each given its id."""
    rows = []
    for index in range(int(n_items)):
        item = make(item_rng(suite, int(seed), index), index)
        rows.append({"id": f"{suite}-{int(seed)}-{index:04d}", "question": item["question"],
                     "answer": str(item["answer"]), "answer_type": item["answer_type"],
                     "difficulty": item["difficulty"], "spec": json.dumps(item["spec"], sort_keys=True)})
    return rows


def load(suite: str, make, n_items=N_ITEMS, seed=SEED):
    """lm-eval's custom_dataset: the generated items as the `test` split (n_items and seed from the task's metadata,
    text when they come from the command line)."""
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(generate(suite, make, int(n_items), int(seed)))})


def doc_to_text(doc) -> str:
    return PROMPT.format(question=doc["question"], instruction=INSTRUCTIONS[doc["answer_type"]])


def canvas(width: int, height: int):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (int(width), int(height)), PAPER)
    return image, ImageDraw.Draw(image)


# ------------------------------------------------------------------ scoring: the exact answer, right or wrong

LEAD_IN = re.compile(r"^(?:(?:final\s+)?answer\s*[:：-]|the\s+answer\s+is\s*:?|the\s+text\s+(?:reads|says|is)\s*:?|"
                     r"it\s+is|it's|this\s+is|that\s+is|there\s+are|there\s+is)\s*", re.IGNORECASE)
NUMBER = re.compile(r"[-−]?\d[\d,]*(?:\.\d+)?")
EDGES = "\"'`“”‘’.,;:!?()[]{}<>*_ "


def committed(output: str) -> str:
    """What the model committed to: its first non-empty line, markdown emphasis and a lead-in ('Answer:', 'The answer
    is', 'The text reads') dropped."""
    line = next((l for l in output.strip().splitlines() if l.strip()), "")
    return LEAD_IN.sub("", re.sub(r"[*_`]", "", line).strip()).strip()


def number_in(text: str) -> Decimal | None:
    """The first number of the text (thousands separators and a leading currency sign allowed), else None."""
    match = NUMBER.search(text)
    if match is None:
        return None
    try:
        return Decimal(match.group().replace(",", "").replace("−", "-"))
    except InvalidOperation:
        return None


def squashed(text: str) -> str:
    """Lower case, spaces collapsed, quotes and punctuation at either end dropped: 'XK-4821.' -> 'xk-4821'."""
    return " ".join(text.lower().split()).strip(EDGES)


def is_right(doc, output: str) -> bool:
    said = committed(output)
    if doc["answer_type"] == "number":
        value = number_in(said)
        return value is not None and value == Decimal(doc["answer"])
    return squashed(said) == squashed(doc["answer"])


def process_results(doc, results):
    return {"exact_match": float(is_right(doc, results[0]))}


# ------------------------------------------------------------------ hooks: options, and the table by difficulty

def options_problem(options: dict) -> str | None:
    for key, value in options.items():
        if key not in OPTIONS:
            return f"{key}: unknown option; use {', '.join(OPTIONS)}"
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{key}: give a whole number ({OPTIONS[key]})"
    if not 1 <= options.get("n_items", N_ITEMS) <= MAX_ITEMS:
        return f"n_items: give {OPTIONS['n_items']}"
    return None


def by_difficulty(lines: list[dict], axis: str) -> dict:
    """{"axis": axis, "bins": {value: {"n", "score"}}}: the mean score of the lines per value of their difficulty's
    `axis`, in the axis's order; a line without it is a ValueError naming its id."""
    groups: dict = defaultdict(list)
    for line in lines:
        value = (line.get("difficulty") or {}).get(axis) if isinstance(line.get("difficulty"), dict) else None
        if value is None:
            raise ValueError(f"line {str(line.get('id'))[:80]!r} has no difficulty.{axis}, so its bin is unknown; "
                             "score the suite again (its lines carry each item's difficulty)")
        groups[value].append(float(line["score"]))
    order = sorted(groups, key=lambda v: (not isinstance(v, (int, float)), v if isinstance(v, (int, float)) else str(v)))
    return {"axis": axis, "bins": {str(v): {"n": len(groups[v]), "score": sum(groups[v]) / len(groups[v])}
                                   for v in order}}


def table(lines: list[dict], axis: str) -> dict:
    """What the suite keeps in <suite>.json as `table` (and the report recomputes from the lines)."""
    return {"by_difficulty": by_difficulty(lines, axis)}


def bench_images(suite: str, make, render, n: int, seed: int = SEED) -> list[dict]:
    """The first n items as the bench sends them: {"image": PIL image at the suite's own size, "question", "suite"}."""
    return [{"image": render(json.loads(item["spec"])), "question": doc_to_text(item).split("\n", 1)[1],
             "suite": suite} for item in generate(suite, make, n, seed)]


def functions(suite: str, make, render, axis: str) -> tuple:
    """A suite's task and hook functions from its generator (make), its drawing (render) and its table's axis:
    (load, doc_to_image, doc_to_target, summarize, table_from_lines, bench_images)."""

    def load_items(n_items=N_ITEMS, seed=SEED, **_):
        return load(suite, make, n_items, seed)

    def doc_to_image(doc):
        return [render(json.loads(doc["spec"]))]

    def doc_to_target(doc):
        return doc["answer"]

    def summarize(lines, metadata):
        return table(lines, axis)

    def table_from_lines(lines):
        return table(lines, axis)

    def images_for_bench(n: int) -> list[dict]:
        return bench_images(suite, make, render, n)

    return load_items, doc_to_image, doc_to_target, summarize, table_from_lines, images_for_bench
