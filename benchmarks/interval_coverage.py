"""Coverage of the verdict's intervals: the old percentile bootstrap against Tango's score interval
with continuity correction (pipeline.verdict.intervals.tango_interval), on the same simulated datasets.

    python benchmarks/interval_coverage.py [--datasets 1000] [--margin 0.03] [--no-exact] [--out FILE]

Three tables: right/wrong suites (n 10..1319; true change 0, -margin, -3 x margin; discordance rates
from one-directional flips to common ones, including rates where most small samples have no flip),
the judge's win rate (n 4..200), and partial-credit scores (2 or 4 sub-answers per item). "GO" is the
share of datasets whose interval's lower end clears -margin: with a true change of -margin or worse
every GO is a false one (a 95 % interval allows 2.5 %). "exact" is the new interval's coverage summed
over every possible outcome (no simulation error). The bootstrap is the pipeline's old one (2000
resamples, percentile), drawn as multinomial counts of the paired differences, which is what
resampling items with replacement gives. Prints markdown; nothing is asserted.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
from scipy.stats import t as student

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.verdict.intervals import tango_interval  # noqa: E402

RESAMPLES = 2000


def bootstrap_interval(values: np.ndarray, counts: np.ndarray, rng, confidence: float = 0.95) -> np.ndarray:
    """Percentile bootstrap of the mean for datasets given as counts over `values` (rows: datasets).
    Identical (up to the random stream) to resampling the items with replacement."""
    n = int(counts[0].sum())
    alpha = (1 - confidence) / 2
    out = np.empty((len(counts), 2))
    unique, inverse = np.unique(counts, axis=0, return_inverse=True)
    for row, observed in enumerate(unique):
        draws = rng.multinomial(n, observed / n, size=RESAMPLES)
        means = draws @ values / n
        out[inverse.ravel() == row] = np.quantile(means, [alpha, 1 - alpha])
    return out


def exact_tango(n: int, p_up: float, p_down: float, truth_on_change_scale: float, to_scale=lambda d: d) -> float:
    """Coverage of Tango's interval summed over every (improved, worsened) outcome of n pairs."""
    from scipy.special import gammaln

    up, down = np.meshgrid(np.arange(n + 1), np.arange(n + 1), indexing="ij")
    keep = up + down <= n
    up, down = up[keep].astype(float), down[keep].astype(float)
    rest = n - up - down

    def log_term(k, p):
        return np.where(k > 0, k * np.log(p), 0.0) if p > 0 else np.where(k > 0, -np.inf, 0.0)

    log_p = (gammaln(n + 1) - gammaln(up + 1) - gammaln(down + 1) - gammaln(rest + 1)
             + log_term(up, p_up) + log_term(down, p_down) + log_term(rest, 1 - p_up - p_down))
    prob = np.exp(log_p)
    live = prob > 1e-13
    low, high = tango_interval(up[live], down[live], n)
    low, high = to_scale(low), to_scale(high)
    truth = truth_on_change_scale
    return float(prob[live][(low <= truth + 1e-12) & (truth - 1e-12 <= high)].sum())


def covered(interval_low, interval_high, truth) -> float:
    return float(((interval_low <= truth + 1e-12) & (truth - 1e-12 <= interval_high)).mean())


def right_wrong_table(args, rng) -> list[str]:
    m = args.margin
    rows = ["| n | true change | discordance | P(no flip) | bootstrap coverage | bootstrap GO | Tango-cc coverage "
            "| Tango-cc GO | Tango-cc exact |", "|---|---|---|---|---|---|---|---|---|"]
    values = np.array([1.0, -1.0, 0.0])
    for n in (10, 30, 100, 300, 1319):
        for change in (0.0, -m, -3 * m):
            for discordance in sorted({abs(change), 0.02, 0.1, 0.3} - {0.0}):
                if discordance < abs(change):
                    continue
                p_down = (discordance - change) / 2
                p_up = p_down + change
                counts = rng.multinomial(n, [p_up, p_down, 1 - p_up - p_down], size=args.datasets)
                boot = bootstrap_interval(values, counts, rng)
                low, high = tango_interval(counts[:, 0], counts[:, 1], n)
                exact = f"{exact_tango(n, p_up, p_down, change):.3f}" if args.exact else "–"
                rows.append(f"| {n} | {change:+.2f} | {discordance:.2f} | {(1 - discordance) ** n:.2f} "
                            f"| {covered(boot[:, 0], boot[:, 1], change):.3f} | {(boot[:, 0] > -m).mean():.3f} "
                            f"| {covered(low, high, change):.3f} | {(low > -m).mean():.3f} | {exact} |")
    return rows


def judge_table(args, rng) -> list[str]:
    rows = ["| judged pairs | P(win, tie, loss) | true win rate | bootstrap coverage | Tango-cc coverage "
            "| Tango-cc exact |", "|---|---|---|---|---|---|"]
    values = np.array([1.0, 0.5, 0.0])
    for n in (4, 6, 10, 30, 100, 200):
        for win, tie, loss in [(0.5, 0.0, 0.5), (0.3, 0.4, 0.3), (0.1, 0.8, 0.1), (0.6, 0.3, 0.1), (0.05, 0.15, 0.8)]:
            truth = win + tie / 2
            counts = rng.multinomial(n, [win, tie, loss], size=args.datasets)
            boot = bootstrap_interval(values, counts, rng)
            low, high = tango_interval(counts[:, 0], counts[:, 2], n)
            exact = (f"{exact_tango(n, win, loss, truth, lambda d: 0.5 + d / 2):.3f}" if args.exact else "–")
            rows.append(f"| {n} | ({win:.2f}, {tie:.2f}, {loss:.2f}) | {truth:.3f} "
                        f"| {covered(boot[:, 0], boot[:, 1], truth):.3f} "
                        f"| {covered(0.5 + low / 2, 0.5 + high / 2, truth):.3f} | {exact} |")
    return rows


def partial_credit_table(args, rng) -> list[str]:
    """Each item has k sub-answers, each flipping like a right/wrong item; the score is the share right,
    so the per-item change is a multiple of 1/k in [-1, 1] and the true mean change is p_up - p_down."""
    m = args.margin
    rows = ["| sub-answers | n | true change | discordance (per sub-answer) | bootstrap coverage | bootstrap GO "
            "| t coverage | t GO | t widened to no-flip Tango-cc: coverage | GO |", "|---|---|---|---|---|---|---|---|---|---|"]
    for k in (2, 4):
        values = np.arange(-k, k + 1) / k  # the possible per-item changes
        for n in (10, 30, 100, 300):
            for change in (0.0, -m, -3 * m):
                for discordance in sorted({abs(change), 0.1, 0.3} - {0.0}):
                    if discordance < abs(change):
                        continue
                    p_down = (discordance - change) / 2
                    p_up = p_down + change
                    sub = rng.multinomial(k, [p_up, p_down, 1 - p_up - p_down], size=(args.datasets, n))
                    deltas = (sub[..., 0] - sub[..., 1]) / k
                    counts = np.stack([(deltas == v).sum(axis=1) for v in values], axis=1)
                    boot = bootstrap_interval(values, counts, rng)
                    mean, sd = deltas.mean(axis=1), deltas.std(axis=1, ddof=1)
                    half = student.ppf(0.975, n - 1) * sd / np.sqrt(n)
                    floor_low, floor_high = tango_interval(0, 0, n)
                    low, high = np.minimum(mean - half, mean + floor_low), np.maximum(mean + half, mean + floor_high)
                    rows.append(f"| {k} | {n} | {change:+.2f} | {discordance:.2f} "
                                f"| {covered(boot[:, 0], boot[:, 1], change):.3f} | {(boot[:, 0] > -m).mean():.3f} "
                                f"| {covered(mean - half, mean + half, change):.3f} | {(mean - half > -m).mean():.3f} "
                                f"| {covered(low, high, change):.3f} | {(low > -m).mean():.3f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=1000, help="simulated datasets per setting")
    parser.add_argument("--margin", type=float, default=0.03)
    parser.add_argument("--no-exact", dest="exact", action="store_false", help="skip the exact coverage column")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the tables to this markdown file")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    lines = [f"Interval coverage, 95 % nominal, {args.datasets} simulated datasets per setting, margin {args.margin} "
             f"(seed {args.seed}; {platform.machine()}, {time.strftime('%Y-%m-%d')}).", "",
             "Right/wrong suites (paired change in accuracy, variant minus base):", ""]
    lines += right_wrong_table(args, rng)
    lines += ["", "Judge win rate ((wins + ties / 2) / judged pairs):", ""]
    lines += judge_table(args, rng)
    lines += ["", "Partial-credit scores (k sub-answers per item; pipeline.verdict.intervals.partial_credit_interval is the last pair "
              "of columns; t alone is [0, 0] when nothing changed):", ""]
    lines += partial_credit_table(args, rng)
    lines += ["", f"{time.perf_counter() - started:.0f} s"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
