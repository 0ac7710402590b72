"""Coverage of the perplexity suites' interval (pipeline.verdict.perplexity.ratio_interval) at small numbers of documents.

Simulated documents of 100-600 tokens whose per-token rise in negative log-likelihood varies around a
true mean of 0.05 (between-document spread 0.005, 0.02, 0.05) plus token-level noise (sd 0.5 per token);
the interval should cover 0.05 in 95 % of datasets. The per-document rises are drawn four ways:
normal; Student t with 3 degrees of freedom (heavy tails); contaminated (one document in ten with five
times the spread); skewed (a centred lognormal, sigma 0.5: a few documents hurt much more than the rest).
Each at the same spread (standard deviation). Beside ours (HC2 error, Bell-McCaffrey degrees of freedom),
the interval it replaced (the linearized HC1 error with t at m - 1). Also printed: how often the upper end
falls below the truth, the error that turns into a wrong GO (nominal 0.025). Monte Carlo error of each
cell at 2,000 datasets: about 0.005.

    python benchmarks/perplexity_interval_coverage.py [--datasets 2000]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.verdict.perplexity import ratio_interval  # noqa: E402

TRUE_RISE = 0.05
SPREADS = (0.005, 0.02, 0.05)
SIZES = (3, 4, 5, 8, 10, 20, 50)


def previous_interval(deltas: np.ndarray, tokens: np.ndarray, confidence: float) -> tuple[float, float, float]:
    """The interval before 2026-12-01: the ratio estimator's linearized (HC1) error, t at m - 1."""
    from scipy.stats import t as student_t

    m = len(deltas)
    total = tokens.sum()
    estimate = deltas.sum() / total
    se = math.sqrt(m / (m - 1) * ((deltas - estimate * tokens) ** 2).sum()) / total
    half = float(student_t.ppf(0.5 + confidence / 2, m - 1)) * se
    return estimate, estimate - half, estimate + half


def standard_draws(rng: np.random.Generator, shape: str, n: int) -> np.ndarray:
    """n draws of mean 0 and standard deviation 1 from the named shape."""
    if shape == "normal":
        return rng.normal(size=n)
    if shape == "heavy-tailed (t3)":
        return rng.standard_t(3, size=n) / math.sqrt(3)
    if shape == "contaminated":
        return rng.normal(size=n) * np.where(rng.random(n) < 0.1, 5.0, 1.0) / math.sqrt(0.9 + 0.1 * 25)
    if shape == "skewed (lognormal)":
        s = 0.5
        return (rng.lognormal(0, s, size=n) - math.exp(s * s / 2)) / math.sqrt((math.exp(s * s) - 1) * math.exp(s * s))
    raise ValueError(shape)


SHAPES = ("normal", "heavy-tailed (t3)", "contaminated", "skewed (lognormal)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--datasets", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    print(f"coverage of a 95 % interval for the per-token rise ({args.datasets} datasets per cell); "
          "in brackets: share of upper ends below the truth (a wrong GO's error, nominal 0.025)")
    print()
    print("| per-document rises | documents | " + " | ".join(f"ours, spread {s}" for s in SPREADS) + " | "
          + " | ".join(f"previous, spread {s}" for s in SPREADS) + " |")
    print("|---" * (2 + 2 * len(SPREADS)) + "|")
    lowest = {"ours": 1.0, "previous": 1.0}
    for shape in SHAPES:
        for n in SIZES:
            cells = {"ours": [], "previous": []}
            for spread in SPREADS:
                hits = {"ours": [0, 0], "previous": [0, 0]}
                for _ in range(args.datasets):
                    tokens = rng.integers(100, 600, size=n).astype(float)
                    rise = TRUE_RISE + spread * standard_draws(rng, shape, n)
                    deltas = rise * tokens + rng.normal(0, 0.5, size=n) * np.sqrt(tokens)
                    for name, interval in (("ours", ratio_interval), ("previous", previous_interval)):
                        _, low, high = interval(deltas, tokens, 0.95)
                        hits[name][0] += low <= TRUE_RISE <= high
                        hits[name][1] += high < TRUE_RISE
                for name, (covered, below) in hits.items():
                    coverage = covered / args.datasets
                    lowest[name] = min(lowest[name], coverage)
                    cells[name].append(f"{coverage:.3f} ({below / args.datasets:.3f})")
            print(f"| {shape} | {n} | " + " | ".join(cells["ours"] + cells["previous"]) + " |", flush=True)
    print()
    print(f"lowest coverage: ours {lowest['ours']:.3f}, previous {lowest['previous']:.3f}")


if __name__ == "__main__":
    main()
