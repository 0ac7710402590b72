"""The verdict on real (tiny) variants: a copy of the base is GO with no flips, a 2-bit
round-to-nearest variant is NO-GO. The tiny Llama is first trained for a few seconds on a
digit-copy task so that the base has something to lose."""

import json
import random
import shutil

import pytest
import torch

from pipeline.stages import evaluate
from pipeline.verdict import intervals, paired
from test_kl import rtn_copy
from tiny import save_tiny_llama, tiny_tokenizer

TASK_YAML = """task: quant_selftest_copy
custom_dataset: !function utils.load
output_type: generate_until
test_split: test
doc_to_text: "Repeat this digit: {{digit}}"
doc_to_target: "{{digit}}"
process_results: !function utils.score
generation_kwargs: {until: [], do_sample: false, max_gen_toks: 2}
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
metadata: {version: 1.0}
"""
TASK_UTILS = """import datasets, random
def load(**_):
    rng = random.Random(7)
    rows = [{"id": f"copy-{i:03d}", "digit": str(rng.randrange(10))} for i in range(120)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
def score(doc, results):
    return {"acc": float(results[0].strip()[:1] == doc["digit"])}
"""


def train_copy_model(path, build=save_tiny_llama, steps: int = 300, device: str = "cpu", lr: float = 3e-3, **shape):
    """~300 AdamW steps on 'Repeat this digit: d' -> 'd': enough for a 2-layer model to learn it.
    `build` and `shape` pick the architecture and size (the GPU benchmark trains bigger ones)."""
    from transformers import AutoModelForCausalLM

    build(path, dtype=torch.float32, **shape)
    tok = tiny_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(0)
    torch.manual_seed(0)
    for _ in range(steps):
        digits = [str(rng.randrange(10)) for _ in range(32)]
        texts = [tok.apply_chat_template([{"role": "user", "content": f"Repeat this digit: {d}"},
                                          {"role": "assistant", "content": d}], tokenize=False) for d in digits]
        batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
    model.half().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def copy_suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("evals")
    (root / "selftest").mkdir()
    (root / "selftest" / "copy.yaml").write_text(TASK_YAML)
    (root / "selftest" / "utils.py").write_text(TASK_UTILS)
    return root


def run_suite(model, name, out, evals_dir, monkeypatch):
    monkeypatch.setattr(evaluate, "EVALS_DIR", evals_dir)
    evaluate.run(model, suite="copy", task="quant_selftest_copy", variant=name, out_dir=out,
                 max_new_tokens=2, batch_size=60)
    return {l["id"]: l for l in map(json.loads, (out / "copy.jsonl").read_text().splitlines())}


def test_copy_is_go_and_two_bit_rtn_is_no_go(tmp_path, copy_suite, monkeypatch):
    base_dir = train_copy_model(tmp_path / "base")
    base = run_suite(base_dir, "base", tmp_path / "r" / "base", copy_suite, monkeypatch)
    base_score = sum(i["score"] for i in base.values()) / len(base)
    assert base_score > 0.6, f"training did not take: base scores {base_score:.2f}"

    copy = run_suite(shutil.copytree(base_dir, tmp_path / "copy"), "copy", tmp_path / "r" / "copy", copy_suite, monkeypatch)
    same = paired.compare_suite(base, copy, variant="copy", suite="copy", margin=0.05, floor_ceiling=0)
    assert same.decision == intervals.GO and same.delta == 0
    assert same.right_to_wrong == [] and same.wrong_to_right == []

    broken = run_suite(rtn_copy(base_dir, tmp_path / "w2", bits=2), "w2", tmp_path / "r" / "w2", copy_suite, monkeypatch)
    worse = paired.compare_suite(base, broken, variant="w2", suite="copy", margin=0.05, floor_ceiling=0)
    assert worse.decision == intervals.NO_GO, worse.reasons
    assert len(worse.right_to_wrong) > 20 and worse.p_value < 0.001
