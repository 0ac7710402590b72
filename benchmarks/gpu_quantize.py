"""GPU benchmark: `quantize awq` / `quantize fp8` end to end on random-weight GLM-4-9B shapes.

Runs on the GPU machine (see README, "GPU figures"): builds a GlmForCausalLM with
glm-4-9b's shapes and random bf16 weights, writes calibration blocks of random token ids
(time and memory do not depend on the values), then times our stages (load, calibrate, save,
verify) at calibration batch 1 and batched. Prints a table; details go to $OUT if set.

    python benchmarks/gpu_quantize.py [--layers 40] [--blocks 128] [--seq-len 512] [--batches 1,16]
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

GLM4_9B = dict(
    vocab_size=151552, hidden_size=4096, intermediate_size=13696, num_attention_heads=32,
    num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.5, max_position_embeddings=131072,
    rms_norm_eps=1.5625e-07, attention_bias=True, rope_theta=5000000.0, pad_token_id=151329,
    eos_token_id=[151329, 151336, 151338], tie_word_embeddings=False,
)


def build_model(root: Path, layers: int) -> Path:
    import torch
    from transformers import GlmConfig, GlmForCausalLM

    from tiny import tiny_tokenizer

    out = root / "glm4-9b-random"
    if (out / "config.json").exists():
        return out
    started = time.perf_counter()
    config = GlmConfig(num_hidden_layers=layers, dtype="bfloat16", **GLM4_9B)
    with torch.device("cuda"):
        model = GlmForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tiny_tokenizer().save_pretrained(out)  # only for verify's generate; ids stay in range
    del model
    torch.cuda.empty_cache()
    print(f"built {out} ({layers} layers) in {time.perf_counter() - started:.0f} s", flush=True)
    return out


def write_blocks(root: Path, blocks: int, seq_len: int) -> Path:
    import random

    rng = random.Random(0)
    path = root / "calib.jsonl"
    with open(path, "w") as handle:
        for i in range(blocks):
            ids = [rng.randrange(1000, 150000) for _ in range(seq_len)]
            handle.write(json.dumps({"block": i, "input_ids": ids}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--blocks", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--methods", default="awq,fp8")
    parser.add_argument("--root", default="/tmp/gpu-bench")
    args = parser.parse_args()
    import torch

    from pipeline.quantize import awq, fp8

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    model = build_model(root, args.layers)
    calib = write_blocks(root, args.blocks, args.seq_len)
    rows = []
    for method in args.methods.split(","):
        batches = [int(b) for b in args.batches.split(",")] if method == "awq" else [16]
        for batch in batches:
            torch.cuda.reset_peak_memory_stats()
            out = root / f"{method}-b{batch}"
            started = time.perf_counter()
            if method == "awq":
                result = awq.run(model, out, calib, group_size=128, batch_size=batch)
            else:
                result = fp8.run(model, out, calib, batch_size=batch)
            wall = time.perf_counter() - started
            info = result.info
            rows.append({"method": method, "batch": batch, "wall_s": round(wall, 1), **info["seconds"],
                         "per_layer_s": round(info["seconds"]["calibrate"] / args.layers, 2),
                         "peak_gpu_gib": round((info.get("peak_gpu_bytes") or 0) / 2**30, 1),
                         "size_gib": round(info["size_bytes"] / 2**30, 2)})
            print(json.dumps(rows[-1]), flush=True)
            if os.environ.get("OUT"):
                Path(os.environ["OUT"], f"{method}-b{batch}.quant.json").write_text(json.dumps(info, indent=2))
    print(f"\nGLM-4-9B shapes, {args.layers} layers, random bf16 weights, {args.blocks} x {args.seq_len} "
          f"calibration tokens, {torch.cuda.get_device_name()}")
    print("| method | calib batch | load s | calibrate s | s/layer | save s | total s | peak GPU GiB | size GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['batch']} | {r['load']} | {r['calibrate']} | {r['per_layer_s']} | {r['save']} "
              f"| {r['total']} | {r['peak_gpu_gib']} | {r['size_gib']} |")


if __name__ == "__main__":
    main()
