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
sys.path.insert(0, str(REPO / "benchmarks"))

from glm_shapes import GLM4_9B, GLM46V_FLASH_TEXT, GLM46V_FLASH_VISION  # noqa: E402



# GLM-4.6V-Flash (Glm4vForConditionalGeneration): its published text and vision towers as the whole run builds them
# (benchmarks/glm_shapes.py, the one place they are written), with GLM-4's pad and end-of-turn ids.
GLM46V_TEXT = {**GLM46V_FLASH_TEXT, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338]}
GLM46V_VISION = GLM46V_FLASH_VISION


def _random_model(arch: str, layers: int):
    import torch
    from transformers import Glm4vConfig, Glm4vForConditionalGeneration, GlmConfig, GlmForCausalLM

    with torch.device("cuda"):
        if arch == "glm4v":
            config = Glm4vConfig(text_config={**GLM46V_TEXT, "num_hidden_layers": layers},
                                 vision_config=GLM46V_VISION, tie_word_embeddings=False)
            return Glm4vForConditionalGeneration(config).to(torch.bfloat16)
        return GlmForCausalLM(GlmConfig(num_hidden_layers=layers, dtype="bfloat16", **GLM4_9B)).to(torch.bfloat16)


def build_model(root: Path, layers: int, arch: str = "glm") -> Path:
    import torch

    from tiny import tiny_tokenizer

    out = root / f"{arch}-random"
    if (out / "config.json").exists():
        return out
    started = time.perf_counter()
    model = _random_model(arch, layers)
    # the report's line at the top: the weights are random, its accuracy figures time the pipeline only
    # (config_json.synthetic_weights; resave carries the key into models/base)
    model.config.synthetic_weights = f"random bf16 weights at {arch.upper()} shapes, {layers} layers (benchmarks/gpu_quantize.py)"
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
    parser.add_argument("--arch", choices=["glm", "glm4v"], default="glm",
                        help="glm: GLM-4-9B shapes (GlmForCausalLM); glm4v: GLM-4.6V-Flash shapes (Glm4v)")
    args = parser.parse_args()
    import torch

    from pipeline.stages.quantize import run as quantize_run

    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    model = build_model(root, args.layers, args.arch)
    calib = write_blocks(root, args.blocks, args.seq_len)
    rows = []
    for method in args.methods.split(","):
        batches = [int(b) for b in args.batches.split(",")] if method == "awq" else [16]
        for batch in batches:
            torch.cuda.reset_peak_memory_stats()
            out = root / f"{args.arch}-{method}-b{batch}"
            started = time.perf_counter()
            if method == "awq":
                result = quantize_run(model, out, calib, "awq", group_size=128, batch_size=batch)
            else:
                result = quantize_run(model, out, calib, "fp8", batch_size=batch)
            wall = time.perf_counter() - started
            info = result.info
            rows.append({"method": method, "batch": batch, "wall_s": round(wall, 1), **info["seconds"],
                         "per_layer_s": round(info["seconds"]["calibrate"] / args.layers, 2),
                         "peak_gpu_gib": round((info.get("peak_gpu_bytes") or 0) / 2**30, 1),
                         "size_gib": round(info["size_bytes"] / 2**30, 2)})
            print(json.dumps(rows[-1]), flush=True)
            if os.environ.get("OUT"):
                Path(os.environ["OUT"], f"{args.arch}-{method}-b{batch}.quant.json").write_text(json.dumps(info, indent=2))
    shapes = "GLM-4.6V-Flash (Glm4v)" if args.arch == "glm4v" else "GLM-4-9B (Glm)"
    print(f"\n{shapes} shapes, {args.layers} layers, random bf16 weights, {args.blocks} x {args.seq_len} "
          f"calibration tokens, {torch.cuda.get_device_name()}")
    print("| method | calib batch | load s | calibrate s | s/layer | save s | total s | peak GPU GiB | size GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['batch']} | {r['load']} | {r['calibrate']} | {r['per_layer_s']} | {r['save']} "
              f"| {r['total']} | {r['peak_gpu_gib']} | {r['size_gib']} |")


if __name__ == "__main__":
    main()
