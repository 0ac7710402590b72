"""easy-VQA (test split, 100-item subset): one image, one question, a one-word answer; exact match
of the normalized first word (`normalize`).

The prompt carries lm-eval's `<image>` placeholder where the image goes; the engine replaces it
with the model's own image markup. A text-only model cannot take this suite: the pipeline reports
it "not applicable" (pipeline/engines/vision.py), never scores it 0.
"""

import json
import re
from pathlib import Path

HERE = Path(__file__).parent
DATA = HERE / "easy_vqa_test.jsonl"
PROMPT = "<image>\n{question}\nAnswer with a single word."


def load_easy_vqa(**_):
    import datasets

    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_image(doc):
    from PIL import Image

    with Image.open(HERE / doc["image"]) as image:
        return [image.convert("RGB")]


def doc_to_text(doc):
    return PROMPT.format(question=doc["question"])


def doc_to_target(doc):
    return doc["answer"]


LEAD_IN = re.compile(r"^(?:(?:final\s+)?answer\s*[:：-]|the\s+answer\s+is\s*:?|it\s+is|it's|this\s+is|that\s+is)\s*")
ARTICLES = {"a", "an", "the"}


def normalize(text: str) -> str:
    """The one-word answer a model committed to: its first line, lower case, without a lead-in
    ('Answer:', 'The answer is', 'It is'), punctuation or articles (as VQAv2's normalization drops
    them), then its first word. 'Yes, it does.' -> 'yes'; 'a triangle' -> 'triangle'; 'The shape is
    a circle' -> 'shape' (the suite asks for a single word; the first word is the answer given)."""
    line = text.strip().split("\n", 1)[0].lower().strip()
    line = LEAD_IN.sub("", re.sub(r"[*_`]", "", line))
    words = [w for w in re.sub(r"[^\w\s-]", " ", line).split() if w not in ARTICLES]
    return words[0] if words else ""


def process_results(doc, results):
    return {"exact_match": float(normalize(results[0]) == doc["answer"])}
