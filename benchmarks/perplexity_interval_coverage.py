"""Coverage of the perplexity suites' interval (pipeline.verdict.ratio_interval) at small numbers of documents.

Simulated documents of 100-600 tokens whose per-token rise in negative log-likelihood varies around a
true mean of 0.05 (between-document spread 0.005, 0.02, 0.05) plus token-level noise (sd 0.5 per token);
the interval should cover 0.05 in 95 % of datasets. Printed beside it, a jackknife variant of the same
ratio estimator (leave one document out), which is more conservative at small n. Monte Carlo error of
each cell at 2,000 datasets: about 0.005.

    python benchmarks/perplexity_interval_coverage.py [--datasets 2000]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.verdict import ratio_interval  # noqa: E402

TRUE_RISE = 0.05


def jackknife_interval(deltas: np.ndarray, tokens: np.ndarray, confidence: float) -> tuple[float, float, float]:
    from scipy.stats import t as student_t

    m = len(deltas)
    estimate = deltas.sum() / tokens.sum()
    leave_one_out = (deltas.sum() - deltas) / (tokens.sum() - tokens)
    se = math.sqrt((m - 1) / m * ((leave_one_out - leave_one_out.mean()) ** 2).sum())
    half = float(student_t.ppf(0.5 + confidence / 2, m - 1)) * se
    return estimate, estimate - half, estimate + half


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--datasets", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    spreads = (0.005, 0.02, 0.05)
    print(f"coverage of a 95 % interval for the per-token rise ({args.datasets} datasets per cell)")
    print("| documents | " + " | ".join(f"ratio t (ours), spread {s}" for s in spreads) + " | "
          + " | ".join(f"jackknife, spread {s}" for s in spreads) + " |")
    print("|---" * (1 + 2 * len(spreads)) + "|")
    for n in (3, 5, 8, 10, 20, 50):
        ours, jack = [], []
        for spread in spreads:
            hit_ours = hit_jack = 0
            for _ in range(args.datasets):
                tokens = rng.integers(100, 600, size=n).astype(float)
                rise = TRUE_RISE + rng.normal(0, spread, size=n)
                deltas = rise * tokens + rng.normal(0, 0.5, size=n) * np.sqrt(tokens)
                _, low, high = ratio_interval(deltas, tokens, 0.95)
                hit_ours += low <= TRUE_RISE <= high
                _, low, high = jackknife_interval(deltas, tokens, 0.95)
                hit_jack += low <= TRUE_RISE <= high
            ours.append(hit_ours / args.datasets)
            jack.append(hit_jack / args.datasets)
        print(f"| {n} | " + " | ".join(f"{c:.3f}" for c in ours + jack) + " |")


if __name__ == "__main__":
    main()
