"""CPU variant of gpu_awq_speed.py on the real demo model: time *and* quality, side by side.

SmolLM2-135M (the demo base, `quantize fetch-demo` + `resave`), the demo's calibration blocks
(16 x 256 tokens, `quantize calib`), W4A16 g64 asymmetric, n_grid 20 for every run:

- llm-compressor's `oneshot` at its defaults (batch 1), called directly;
- llm-compressor at our batch size;
- our stage (`awq.run`, X^T X search), and our stage with llm-compressor's search;
- `ours-before`: our stage with the X^T X search as it was before issue 36 (benchmarks/awq_phases.old_path);
- `ours-ranked`: our stage with the attention's search ranked on a quarter of the batches (awq_phases.ranked_forward;
  needs --batch small enough for 2+ batches, e.g. 4).

Quality: per-token KL(base || variant) on held-out conversations (mean per sequence, 95 % bootstrap
interval) and each run's paired difference from the default's (an interval containing 0: within the
noise of the default). Time: wall seconds of each calibration, and the CPU seconds of llm-compressor's
oneshot call in this process (run it with OMP_NUM_THREADS=1: on a shared machine the CPU time holds
steady where the wall time moves by tens of percent with the other jobs).

    python benchmarks/awq_speed_cpu.py [--model models/base] [--calib calib_data/build] [--batch 16]
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
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))


def llmc_direct(model_dir: Path, blocks, batch: int, n_grid: int, group: int, out: Path) -> tuple[float, float]:
    """llm-compressor's oneshot on the model as loaded (float32 on CPU, as our stage calibrates),
    saved in float16 like ours so both checkpoints differ only by the calibration."""
    import torch
    from llmcompressor import oneshot
    from llmcompressor.core import active_session
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.methods import awq
    from pipeline.quantize.calibrate import calibration_dataset
    from pipeline.quantize.compat import patch_cpu_pin_memory
    from pipeline.stages.quantize import _copy_side_files, _set_dtype, read_target

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    settings = awq.Params(method="awq", group_size=group, n_grid=n_grid, search="forward")
    patch_cpu_pin_memory()  # without an accelerator llm-compressor's pin_memory raises; a no-op there
    started, cpu_started = time.perf_counter(), time.process_time()
    oneshot(model=model, processor=AutoTokenizer.from_pretrained(model_dir), dataset=calibration_dataset(blocks),
            recipe=awq.recipe(settings, read_target(model_dir)).modifiers,
            num_calibration_samples=len(blocks), max_seq_length=len(blocks[0]), batch_size=batch,
            shuffle_calibration_samples=False)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    _set_dtype(model, torch.float16, torch.float32)
    model.save_pretrained(out, save_compressed=True)
    _copy_side_files(model_dir, out)
    del model
    active_session().reset()
    return seconds, cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=REPO / "models" / "base")
    parser.add_argument("--calib", type=Path, default=REPO / "calib_data" / "build")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--n-grid", type=int, default=20)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--configs", default="default,llmc-batch,ours,ours-forward")
    parser.add_argument("--root", type=Path, default=Path("/tmp/awq-speed-cpu"))
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    import awq_phases
    from awq_batching import bootstrap, per_sequence_kl
    from pipeline.formats.calib_blocks import read_blocks
    from pipeline.scoring.token_kl import holdout_texts
    from pipeline.checkpoints.loading import load_for_inference
    from pipeline.stages.quantize import run as quantize_run

    args.root.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sequences = holdout_texts(tokenizer, args.calib / "holdout.jsonl", args.max_tokens, args.sequences)
    blocks = read_blocks(args.calib / "calib.jsonl")
    base = load_for_inference(args.model, torch.float32).eval()
    rows, kls = {}, {}
    labels = {"default": ("llm-compressor oneshot", 1, "forward"),
              "llmc-batch": ("llm-compressor oneshot", args.batch, "forward"),
              "ours": ("quantize awq (awq.run)", args.batch, "gram"),
              "ours-forward": ("quantize awq, llm-compressor's search", args.batch, "forward"),
              "ours-before": ("quantize awq before issue 36", args.batch, "gram"),
              "ours-ranked": ("quantize awq, attention ranked on 1/4 of the batches", args.batch, "gram")}
    for name in args.configs.split(","):
        who, batch, search = labels[name]
        out = args.root / name
        shutil.rmtree(out, ignore_errors=True)
        if name.startswith("ours"):
            variant = {"ours-before": awq_phases.old_path, "ours-ranked": awq_phases.ranked_forward}.get(
                name, contextlib.nullcontext)
            with variant():
                info = quantize_run(args.model, out, args.calib / "calib.jsonl", "awq", group_size=args.group_size,
                                    batch_size=batch, n_grid=args.n_grid, search=search).info
            seconds, cpu_seconds = info["seconds"]["calibrate"], info["seconds"]["oneshot_cpu"]
        else:
            seconds, cpu_seconds = llmc_direct(args.model, blocks, batch, args.n_grid, args.group_size, out)
        variant = load_for_inference(out, torch.float32).eval()
        kls[name] = per_sequence_kl(base, variant, sequences)
        del variant
        low, high = bootstrap(kls[name])
        rows[name] = {"who": who, "batch": batch, "search": search, "calibrate_s": round(seconds, 1), "cpu_s": round(cpu_seconds, 1),
                      "kl_mean": sum(kls[name]) / len(kls[name]), "kl_low": low, "kl_high": high}
        print(json.dumps({"config": name, **rows[name]}), flush=True)

    reference = "default" if "default" in kls else next(iter(kls))
    print(f"\nAWQ W4A16 g{args.group_size} asym, n_grid {args.n_grid}, {len(blocks)} x {len(blocks[0])} calibration "
          f"tokens, {args.model} (SmolLM2-135M), CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads), "
          f"{time.strftime('%Y-%m-%d')}; KL(base || variant) per token, mean over {len(sequences)} held-out sequences "
          f"of <= {args.max_tokens} tokens, 95 % bootstrap intervals")
    print(f"| run | batch | search | calibrate s (wall) | oneshot CPU s | speed-up vs {reference} (CPU s) "
          f"| mean KL [95 % CI] | change vs {reference} [95 % CI] |")
    print("|---|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        diffs = [b - a for a, b in zip(kls[reference], kls[name])]
        d_low, d_high = bootstrap(diffs)
        change = "–" if name == reference else f"{sum(diffs) / len(diffs):+.4f} [{d_low:+.4f}, {d_high:+.4f}]"
        speedup = rows[reference]["cpu_s"] / row["cpu_s"]
        print(f"| {row['who']} | {row['batch']} | {row['search']} | {row['calibrate_s']} | {row['cpu_s']} | {speedup:.2f}x | "
              f"{row['kl_mean']:.4f} [{row['kl_low']:.4f}, {row['kl_high']:.4f}] | {change} |")
    for other in ("ours-before", "ours-ranked"):
        if "ours" in rows and other in rows:
            from conftest import read_tensors

            a, b = read_tensors(args.root / "ours"), read_tensors(args.root / other)
            differ = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
            print(f"ours vs {other} checkpoint: " + ("bit-identical" if not differ and len(a) == len(b)
                                                     else f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "awq_speed_cpu.json").write_text(json.dumps({"rows": rows, "kl": kls}, indent=1))


if __name__ == "__main__":
    main()
