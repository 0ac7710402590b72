"""Where AWQ calibration time goes, per mapping and phase, before and after issue 36, on this machine (CPU):
our stage (`quantize awq`, X^T X search) on random GlmForCausalLM layers with GLM-4-9B's proportions, run
once with the code path before (awq_phases.old_path: one-by-one search, activations on the host) and once
with the current one, both profiled (awq_phases.py). Also checks that both write the same checkpoint.

GLM-4-9B's widths (4096 / 13696, 32 heads of 128, 2 KV heads) are too slow for a 2-core CPU (the X^T X
search alone is ~30 TFLOP per layer); `--width-divisor 4` (the default) keeps the proportions at a quarter
of the width: hidden 1024, intermediate 3456 (3424 rounded up to a multiple of the group, 128), 8 heads of
128, 2 KV heads.

    OMP_NUM_THREADS=1 python benchmarks/awq_profile.py [--layers 2] [--blocks 16] [--seq-len 512] [--runs 1]
    python benchmarks/awq_profile.py --width-divisor 1 --blocks 128 --batch 16 --kernels 40   # GLM-4-9B widths (a GPU);
                                            # then the last config under torch.profiler: its 40 costliest operators

Prints the markdown table (CPU seconds per layer on a CPU, synchronised wall seconds on a GPU) and writes
awq_profile.json into $OUT if set.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))


def glm_shapes(divisor: int, vocab: int, tokenizer) -> dict:
    from glm_shapes import GLM4_9B

    heads = max(GLM4_9B["num_attention_heads"] // divisor, 1)
    return {**GLM4_9B, "hidden_size": GLM4_9B["hidden_size"] // divisor,
            # rounded up to a multiple of 128, so group 128 divides down_proj's input as it does GLM-4-9B's
            "intermediate_size": -(-GLM4_9B["intermediate_size"] // divisor // 128) * 128, "num_attention_heads": heads,
            "num_key_value_heads": min(GLM4_9B["num_key_value_heads"], heads), "vocab_size": vocab,
            "pad_token_id": tokenizer.pad_token_id, "eos_token_id": tokenizer.eos_token_id,
            "bos_token_id": tokenizer.bos_token_id}


def build(root: Path, layers: int, divisor: int) -> tuple[Path, dict]:
    import torch
    from transformers import GlmConfig, GlmForCausalLM

    from tiny import tiny_tokenizer

    out = root / f"glm-div{divisor}-{layers}"
    tokenizer = tiny_tokenizer()
    shapes = glm_shapes(divisor, len(tokenizer), tokenizer)
    if not (out / "config.json").exists():
        torch.manual_seed(0)
        model = GlmForCausalLM(GlmConfig(num_hidden_layers=layers, dtype="bfloat16", **shapes)).to(torch.bfloat16)
        model.config.architectures = ["GlmForCausalLM"]
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    return out, shapes


def profile_run(name: str, model_dir: Path, calib: Path, out: Path, args) -> dict:
    import awq_phases
    from pipeline.stages.quantize import run as quantize_run

    shutil.rmtree(out, ignore_errors=True)
    variant = {"before": awq_phases.old_path, "ranked": awq_phases.ranked_forward}.get(name, contextlib.nullcontext)
    with variant(), awq_phases.profiled() as profile:
        info = quantize_run(model_dir, out, calib, "awq", group_size=args.group, batch_size=args.batch,
                            n_grid=args.n_grid).info
    errors = info["verify"]["layer_error"]["relative"]
    return {"rows": awq_phases.rows(profile, args.layers), "total_s": profile.total,
            "layer_error_mean": sum(errors) / len(errors), "layer_error_max": max(errors),
            "oneshot_cpu_s": info["seconds"]["oneshot_cpu"], "oneshot_s": info["seconds"]["oneshot"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width-divisor", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--n-grid", type=int, default=20)
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--runs", type=int, default=1, help="rounds of every config, alternating order")
    parser.add_argument("--configs", default="before,after",
                        help="before (the code before issue 36), after (the defaults now), ranked (after, plus the "
                             "attention's search ranked on a quarter of the batches: awq_phases.ranked_forward)")
    parser.add_argument("--root", type=Path, default=Path("/tmp/awq-profile"))
    parser.add_argument("--kernels", type=int, default=0,
                        help="then the last config once more under torch.profiler: its N costliest operators")
    args = parser.parse_args()
    import torch

    from awq_phases import table
    from gpu_awq_speed import write_blocks

    args.root.mkdir(parents=True, exist_ok=True)
    model_dir, shapes = build(args.root, args.layers, args.width_divisor)
    calib = write_blocks(args.root, args.blocks, args.seq_len, shapes["vocab_size"])
    configs = args.configs.split(",")
    results: dict[str, list[dict]] = {name: [] for name in configs}
    for run in range(args.runs):
        for name in (configs if run % 2 == 0 else configs[::-1]):
            results[name].append(profile_run(name, model_dir, calib, args.root / f"out-{name}", args))
            print(json.dumps({"config": name, "run": run, **{k: v for k, v in results[name][-1].items() if k != "rows"}}),
                  flush=True)
    identical = {f"{name} vs {configs[0]}": same_checkpoint(args.root / f"out-{configs[0]}", args.root / f"out-{name}")
                 for name in configs[1:]}
    unit = "GPU s" if torch.cuda.is_available() else "CPU s"
    print(f"\nAWQ W4A16 g{args.group} asym, n_grid {args.n_grid}, {args.blocks} x {args.seq_len} tokens, batch {args.batch}, "
          f"random GlmForCausalLM, {args.layers} layers, hidden {shapes['hidden_size']}, intermediate "
          f"{shapes['intermediate_size']}, {shapes['num_attention_heads']} heads / {shapes['num_key_value_heads']} KV, "
          f"{'GPU' if torch.cuda.is_available() else 'CPU'} ({os.cpu_count()} cores, {torch.get_num_threads()} threads), "
          f"{time.strftime('%Y-%m-%d')}, {args.runs} run(s) each, last run shown")
    print(table({name: rs[-1]["rows"] for name, rs in results.items()}, unit))
    for name, rs in results.items():
        totals = ", ".join(f"{r['total_s']:.1f}" for r in rs)
        print(f"{name}: calibration {totals} {unit}; layer error mean / max "
              f"{rs[-1]['layer_error_mean']:.5f} / {rs[-1]['layer_error_max']:.5f}")
    for pair, differ in identical.items():
        print(f"checkpoints {pair}: " + ("bit-identical" if not differ else f"{len(differ)} tensors differ, e.g. {differ[:3]}"))
    if args.kernels:
        print(kernel_table(configs[-1], model_dir, calib, args))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "awq_profile.json").write_text(json.dumps(
            {"args": {**vars(args), "root": str(args.root)}, "shapes": shapes, "results": results,
             "identical_checkpoints": {pair: not differ for pair, differ in identical.items()}}, indent=1))


def kernel_table(name: str, model_dir: Path, calib: Path, args) -> str:
    """One more run of `name` under torch.profiler: its `args.kernels` costliest operators by device time (CPU time
    without a GPU), the whole run's."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        profile_run(name, model_dir, calib, args.root / f"out-{name}-kernels", args)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return f"\n{name} under torch.profiler, by {key}:\n" + prof.key_averages().table(sort_by=key, row_limit=args.kernels)


def same_checkpoint(a: Path, b: Path) -> list[str]:
    """The tensors that differ between two checkpoints (none: bit-identical)."""
    import torch

    from conftest import read_tensors

    first, second = read_tensors(a), read_tensors(b)
    return [k for k in sorted(set(first) | set(second))
            if k not in first or k not in second or not torch.equal(first[k], second[k])]


if __name__ == "__main__":
    main()
