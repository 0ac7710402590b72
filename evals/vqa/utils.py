"""easy-VQA (test split, 100-item subset): one image, one question, a one-word answer; exact match.

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


def normalize(text: str) -> str:
    """Lower case, no 'Answer:' lead, no surrounding spaces or punctuation."""
    text = re.sub(r"^\s*answer\s*:", "", text.strip().lower())
    return text.strip().strip(".!,;:'\"` ").strip()


def process_results(doc, results):
    return {"exact_match": float(normalize(results[0]) == doc["answer"])}
