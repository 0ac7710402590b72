"""Does calibrating AWQ in batches of blocks cost quality? KL from the base on held-out text.

Builds the AWQ variant of one model at several calibration batch sizes (same blocks, same
settings otherwise), then scores each against the base on held-out conversations: the mean
per-token KL(base || variant) per sequence, with a bootstrap interval, and the paired difference
of each batched run from batch 1 (its interval containing 0 = within the noise of batch 1).

    python benchmarks/awq_batching.py [--model models/base] [--calib calib_data/build] [--batches 1,16]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def per_sequence_kl(base, variant, sequences) -> list[float]:
    from pipeline.stages.kl import compare

    return [compare(base, variant, [seq])[0].mean().item() for seq in sequences]


def bootstrap(values, iterations: int = 2000, seed: int = 0) -> tuple[float, float]:
    import numpy as np

    rng = np.random.default_rng(seed)
    values = np.asarray(values)
    means = values[rng.integers(0, len(values), (iterations, len(values)))].mean(axis=1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=REPO / "models" / "base")
    parser.add_argument("--calib", type=Path, default=REPO / "calib_data" / "build")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--n-grid", type=int, default=10)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--root", type=Path, default=Path("/tmp/awq-batching"))
    args = parser.parse_args()
    import torch
    from transformers import AutoTokenizer

    from pipeline.scoring.token_kl import holdout_texts
    from pipeline.checkpoints.loading import load_for_inference
    from pipeline.stages.quantize import run as quantize_run

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sequences = holdout_texts(tokenizer, args.calib / "holdout.jsonl", args.max_tokens, args.sequences)
    base = load_for_inference(args.model, torch.float32).eval()
    rows, kls = [], {}
    for batch in [int(b) for b in args.batches.split(",")]:
        out = args.root / f"awq-b{batch}"
        started = time.perf_counter()
        result = quantize_run(args.model, out, args.calib / "calib.jsonl", "awq", group_size=args.group_size,
                         batch_size=batch, n_grid=args.n_grid)
        seconds = time.perf_counter() - started
        variant = load_for_inference(out, torch.float32).eval()
        kls[batch] = per_sequence_kl(base, variant, sequences)
        low, high = bootstrap(kls[batch])
        rows.append({"batch": batch, "awq_seconds": round(seconds, 1),
                     "calibrate_seconds": result.info["seconds"]["calibrate"],
                     "kl_mean": sum(kls[batch]) / len(kls[batch]), "kl_low": low, "kl_high": high})
        print(json.dumps(rows[-1]), flush=True)
    first = min(kls)
    print(f"\nAWQ W4A16 g{args.group_size}, n_grid {args.n_grid}, {args.model}; KL(base || variant) per token, "
          f"mean over {len(sequences)} held-out sequences of <= {args.max_tokens} tokens, 95 % bootstrap intervals")
    print("| calib batch | AWQ total s | calibrate s | mean KL [95 % CI] | change vs batch 1 [95 % CI] |")
    print("|---|---|---|---|---|")
    for row in rows:
        diffs = [b - a for a, b in zip(kls[first], kls[row["batch"]])]
        d_low, d_high = bootstrap(diffs)
        change = "–" if row["batch"] == first else f"{sum(diffs) / len(diffs):+.4f} [{d_low:+.4f}, {d_high:+.4f}]"
        print(f"| {row['batch']} | {row['awq_seconds']} | {row['calibrate_seconds']} | {row['kl_mean']:.4f} "
              f"[{row['kl_low']:.4f}, {row['kl_high']:.4f}] | {change} |")


if __name__ == "__main__":
    main()
