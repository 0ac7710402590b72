"""GSM8K, zero-shot chat prompt; scored by math-verify plus a strict numeric match."""

import json
import re
from pathlib import Path

DATA = Path(__file__).with_name("gsm8k_test.jsonl")
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")

PROMPT = (
    "Solve this math problem. Think step by step, then write the final answer "
    "on the last line as 'Answer: <number>'.\n\n{question}"
)


def load_gsm8k(**_):
    import datasets

    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    for index, row in enumerate(rows):
        row["id"] = f"gsm8k-test-{index:04d}"
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_text(doc):
    return PROMPT.format(question=doc["question"])


def gold(doc) -> str:
    return doc["answer"].split("####")[-1].strip().replace(",", "")


def doc_to_target(doc):
    return gold(doc)


def final_number(text: str) -> str | None:
    """The number after 'Answer:' if present, else the last number in the output."""
    tail = text.rsplit("Answer:", 1)[-1] if "Answer:" in text else text
    numbers = NUMBER.findall(tail)
    if not numbers:
        return None
    value = numbers[-1].replace(",", "").rstrip(".")
    return value[:-2] if value.endswith(".00") else value


def _same_number(a: str | None, b: str) -> bool:
    try:
        return a is not None and float(a) == float(b)
    except ValueError:
        return False


def process_results(doc, results):
    output = results[0]
    target = gold(doc)
    strict = _same_number(final_number(output), target)
    try:
        from math_verify import parse, verify

        verified = bool(verify(parse(target), parse(output.rsplit("Answer:", 1)[-1])))
    except Exception:  # math-verify gives up on odd text; the strict match still stands
        verified = False
    return {"acc": float(strict or verified), "strict_match": float(strict), "math_verify": float(verified)}
