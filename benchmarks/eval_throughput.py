"""Generated tokens/s of the hf engine on the demo model's math prompts, by batch size and decoding.

    python benchmarks/eval_throughput.py [--model models/base] [--items 50] [--new 128]

Decodings: `dynamic` and `static` are transformers' own caches with its SDPA attention; `grouped`
is the hf engine's grouped-query attention (pipeline/engines/decoding.py) on the dynamic cache;
`engine` is what the hf engine runs: grouped attention and a preallocated cache.

Prints a table; nothing is asserted (performance goals live here, not in tests).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def prompts(tokenizer, n: int) -> list[str]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("math_utils", REPO / "evals" / "math" / "utils.py")
    utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(utils)
    rows = [json.loads(l) for l in (REPO / "evals" / "math" / "gsm8k_test.jsonl").read_text().splitlines()[:n]]
    return [tokenizer.apply_chat_template([{"role": "user", "content": utils.doc_to_text(r)}], tokenize=False,
                                          add_generation_prompt=True) for r in rows]


def measure(model, tokenizer, texts, batch: int, new: int, decoding: str, order: str = "sorted") -> float:
    from pipeline.engines.decoding import GROUPED_SDPA, preallocated_cache

    model.set_attn_implementation(GROUPED_SDPA if decoding in ("grouped", "engine") else "sdpa")
    generated, started = 0, time.perf_counter()
    if order == "sorted":  # as the engine does: similar lengths share a batch, less padding
        texts = sorted(texts, key=len, reverse=True)
    for i in range(0, len(texts), batch):
        inputs = tokenizer(texts[i:i + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        cache = {"cache_implementation": "static"} if decoding == "static" else {}
        if decoding == "engine":
            cache = {"past_key_values": preallocated_cache(model, inputs["input_ids"].shape[1] + new)}
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, **cache)
        generated += (out.shape[1] - inputs["input_ids"].shape[1]) * out.shape[0]
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="models/base")
    parser.add_argument("--items", type=int, default=50)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batches", default="1,8,25,50")
    parser.add_argument("--decodings", default="dynamic,static,grouped,engine")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--orders", default="sorted", help="sorted (by prompt length, as the engine does), unsorted")
    parser.add_argument("--compile", action="store_true", help="also each setting with torch.compile on the forward")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from pipeline.checkpoints.loading import load_for_inference

    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    texts = prompts(tokenizer, args.items)
    rows = []
    for dtype in args.dtypes.split(","):
        model = load_for_inference(args.model, getattr(torch, dtype)).eval()
        for compiled in (False, True) if args.compile else (False,):
            if compiled:
                model.forward = torch.compile(model.forward, dynamic=True)
            for decoding in args.decodings.split(","):
                for order in args.orders.split(","):
                    for batch in map(int, args.batches.split(",")):
                        sample = texts[:4] if batch == 1 else texts
                        rate = measure(model, tokenizer, sample, batch, args.new, decoding, order)
                        setting = f"{dtype}{' compiled' if compiled else ''}"
                        rows.append((setting, decoding, order, batch, len(sample), rate))
                        print(f"{setting} {decoding:8s} {order} batch {batch:3d}: {rate:7.1f} tok/s", flush=True)
    print("\n| weights | decoding | prompt order | batch | prompts | generated tok/s |\n|---|---|---|---|---|---|")
    for setting, decoding, order, batch, n, rate in rows:
        print(f"| {setting} | {decoding} | {order} | {batch} | {n} | {rate:.0f} |")
    print(f"\nmodel {args.model}, {args.new} new tokens per prompt, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
