"""Perplexity suites: documents whose every token the model scores (lm-eval loglikelihood_rolling).

Text we may ship, paired per document (each has an `id`; the verdict compares the variant with the
base document by document):

- `quant_ppl_chat`: the user's own held-out conversations (`holdout.jsonl`, written by `quantize
  calib`: the turns and the reference reply), rendered with the checkpoint's chat template exactly as
  calibration renders them. The pipeline passes `data` (the file) and `model_dir` (whose template).
- `quant_ppl_book`: Alice's Adventures in Wonderland (public domain, ../long_context/alice29.txt),
  from chapter I on, paragraphs unwrapped and grouped into documents of about BOOK_CHARS characters.
- `quant_ppl_gsm8k`: GSM8K test questions with their reference solutions (../math, MIT), the
  calculator annotations (<<6*3=18>>) removed.
- `quant_ppl_humaneval`: HumanEval prompts with their canonical solutions (../code, MIT): whole functions.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

EVALS = Path(__file__).resolve().parent.parent
BOOK = EVALS / "long_context" / "alice29.txt"
GSM8K = EVALS / "math" / "gsm8k_test.jsonl"
HUMANEVAL = EVALS / "code" / "HumanEval.jsonl.gz"
BOOK_CHARS = 1000  # a document closes at the first paragraph end past this many characters
ANNOTATION = re.compile(r"<<[^<>]*>>")


def _dataset(rows: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_target(doc):
    return doc["text"]


def book_documents(text: str, size: int = BOOK_CHARS) -> list[str]:
    """The book from its first chapter, one paragraph per blank-line-separated block (hard wraps
    joined), consecutive paragraphs grouped until a document passes `size` characters."""
    body = text[text.index("CHAPTER I"):]
    paragraphs = [" ".join(line.strip() for line in block.splitlines() if line.strip())
                  for block in re.split(r"\n\s*\n", body)]
    documents, current = [], []
    for paragraph in filter(None, paragraphs):
        current.append(paragraph)
        if sum(len(p) + 1 for p in current) >= size:
            documents.append("\n".join(current))
            current = []
    if current:
        documents.append("\n".join(current))
    return documents


def load_book(**_):
    documents = book_documents(BOOK.read_text(encoding="utf-8"))
    return _dataset([{"id": f"alice-{i:03d}", "text": text} for i, text in enumerate(documents)])


def gsm8k_text(row: dict) -> str:
    solution, _, final = row["answer"].rpartition("####")
    return f"{row['question']}\n{ANNOTATION.sub('', solution).strip()}\nThe answer is {final.strip()}."


def load_gsm8k(**_):
    rows = [json.loads(line) for line in GSM8K.read_text(encoding="utf-8").splitlines() if line.strip()]
    return _dataset([{"id": f"gsm8k-test-{i:04d}", "text": gsm8k_text(row)} for i, row in enumerate(rows)])


def load_humaneval(**_):
    with gzip.open(HUMANEVAL, "rt", encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    return _dataset([{"id": f"humaneval-{int(row['task_id'].split('/')[1]):03d}",
                      "text": row["prompt"] + row["canonical_solution"]} for row in rows])


def render_conversation(tokenizer, messages: list[dict]) -> str:
    """As calibration renders a conversation (pipeline/stages/quantize.py `_render`): the chat
    template without a generation prompt, or the turns joined by newlines when there is none."""
    if getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError

        try:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        except TemplateError:
            pass
    return "\n".join(m["content"] for m in messages)


def load_holdout(data: str | None = None, model_dir: str | None = None, **_):
    if not data or not model_dir:
        raise ValueError("quant_ppl_chat needs metadata `data` (holdout.jsonl from `quantize calib`) and "
                         "`model_dir` (whose chat template renders it); `quantize eval` passes both")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = []
    for line in Path(data).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        reference = [{"role": "assistant", "content": row["reference"]}] if row.get("reference") else []
        rows.append({"id": str(row["id"]), "text": render_conversation(tokenizer, row["messages"] + reference)})
    return _dataset(rows)


def process_results(doc, results):
    """Word- and byte-level perplexity as lm-eval's own perplexity tasks report them; the pipeline
    reads each document's log-likelihood and token count from its result line."""
    (loglikelihood,) = results
    text = doc["text"]
    words, size = len(re.split(r"\s+", text.strip())), len(text.encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, size),
            "bits_per_byte": (loglikelihood, size)}
