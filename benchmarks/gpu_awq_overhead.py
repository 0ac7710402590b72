"""GPU: does our AWQ stage cost more per layer than llm-compressor called directly?

Same machine, same process, same random GLM-4-9B-shaped layers, same recipe and calibration
(128 x 512 tokens, batch 1): `llmcompressor.oneshot` called directly, timed around the call,
against our `awq.run`'s calibrate time. Each at two depths, so the per-layer cost is the slope
(time(deep) - time(shallow)) / (deep - shallow) and fixed costs (tracing, data preparation) drop out.

    python benchmarks/gpu_awq_overhead.py [--depths 4,12] [--blocks 128] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))


def direct(model_dir: Path, blocks: list[list[int]], group: int) -> float:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.core import active_session
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.methods import awq
    from pipeline.stages.quantize import read_target

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to("cuda")
    modifiers = awq.recipe(awq.Params(method="awq", group_size=group), read_target(model_dir)).modifiers
    data = Dataset.from_dict({"input_ids": blocks, "attention_mask": [[1] * len(b) for b in blocks]})
    started = time.perf_counter()
    oneshot(model=model, processor=AutoTokenizer.from_pretrained(model_dir), dataset=data,
            recipe=modifiers,
            num_calibration_samples=len(blocks), max_seq_length=len(blocks[0]), batch_size=1,
            shuffle_calibration_samples=False)
    seconds = time.perf_counter() - started
    del model
    active_session().reset()
    torch.cuda.empty_cache()
    return seconds


def ours(model_dir: Path, calib: Path, out: Path, group: int) -> float:
    from pipeline.stages.quantize import run as quantize_run

    return quantize_run(model_dir, out, calib, "awq", group_size=group, batch_size=1).info["seconds"]["calibrate"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", default="4,12")
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--root", type=Path, default=Path("/tmp/awq-overhead"))
    args = parser.parse_args()
    import shutil

    from benchmarks.gpu_quantize import build_model, write_blocks

    args.root.mkdir(parents=True, exist_ok=True)
    calib = write_blocks(args.root, args.blocks, args.seq_len)
    blocks = [json.loads(line)["input_ids"] for line in calib.read_text().splitlines()]
    times: dict[str, dict[int, float]] = {"direct": {}, "ours": {}}
    for depth in [int(d) for d in args.depths.split(",")]:
        model_dir = build_model(args.root / f"d{depth}", depth)
        times["direct"][depth] = direct(model_dir, blocks, 128)
        times["ours"][depth] = ours(model_dir, calib, args.root / f"d{depth}-awq", 128)
        print(json.dumps({"depth": depth, "direct_s": times["direct"][depth], "ours_s": times["ours"][depth]}),
              flush=True)
        shutil.rmtree(args.root / f"d{depth}")
    shallow, deep = sorted(times["direct"])
    print(f"\nAWQ W4A16 g128 asym, batch 1, {args.blocks} x {args.seq_len} tokens, GLM-4-9B-shaped layers, "
          f"random bf16 weights")
    print(f"| how | calibrate {shallow} layers | calibrate {deep} layers | s / layer (slope) | fixed s |")
    print("|---|---|---|---|---|")
    for how, t in times.items():
        slope = (t[deep] - t[shallow]) / (deep - shallow)
        print(f"| {how} | {t[shallow]:.1f} | {t[deep]:.1f} | {slope:.2f} | {t[shallow] - slope * shallow:.1f} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "awq_overhead.json").write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
