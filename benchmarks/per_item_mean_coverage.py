"""Coverage of the interval for the paired change in per-item means (k samples per item, avg@k), the verdict's
interval for a suite sampled k > 1 times per item (pipeline.verdict.intervals.per_item_mean_interval).

    python benchmarks/per_item_mean_coverage.py [--datasets 2000] [--margin 0.02] [--bootstrap] [--recheck 8]
        [--out FILE] [--json FILE]

Each simulated dataset draws n items from a population: item i's chance that the base answers it right is
q_i ~ Beta(mu * c, (1 - mu) * c) (mu: the base's accuracy; c the concentration: 0.5 puts most items near always
right or always wrong, as greedy answers are, 4 spreads them, 50 makes every item about equally hard), and the
variant's chance is q_i moved one of two ways:
- "shift": on the logit scale by a common shift plus item-to-item churn (normal, sd 0.5), the shift solved so that
  the population's mean change is the true change (0, -margin, -3 x margin);
- "broken": a share of items the variant never answers right (its chance 0), the rest unchanged: the skewed case
  where a few items carry the whole change (only for a true change below 0).
Each model then answers each item k times (binomial), the per-item means are avg@k, and the per-item differences
(variant minus base) are what the intervals see. The truth is the population's mean change, computed by quadrature.
Candidates (each 95 % nominal):
- t: Student's t on the per-item differences;
- t+floor: t widened at least to Tango's interval for no flip at this n (the partial-credit interval);
- t+skew+floor: t shifted toward the long tail by Johnson's (1978) correction, mu3 / (6 s^2 n), then widened
  to the floor;
- t+skew+cc+floor: that, each end moved out by 1 / n (one item's whole change: Tango's continuity correction);
- ours (t+cc+floor): the pipeline's per_item_mean_interval, t with the continuity correction, widened to the floor;
- BCa+floor (with --bootstrap, n <= 100 and k in 2, 8 only): scipy.stats.bootstrap's BCa interval (999
  resamples) widened to the floor.
At k = 1 the pipeline uses Tango's interval (benchmarks/interval_coverage.py); it is shown as "Tango" there.
"miss low" is the share of datasets whose lower end lies above the truth: with a true change at or below -margin
such a dataset may read GO wrongly (nominal 0.025). Monte Carlo error of a cell at 2,000 datasets: about 0.005.
Prints markdown; writes every cell to --json.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import numpy as np
from scipy import special, stats

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipeline.verdict.intervals import per_item_mean_interval, tango_interval  # noqa: E402

SIZES = (30, 100, 300, 1319)
SAMPLES = (1, 2, 4, 8, 16)
ACCURACIES = (0.25, 0.6, 0.9)
CONCENTRATIONS = (0.5, 4.0, 50.0)
CHURN = 0.5  # sd of the item-to-item change on the logit scale ("shift")
QUADRATURE = 4000  # Beta quantiles for the true change
HERMITE = 40


def population(mu: float, concentration: float) -> np.ndarray:
    """The base's chances at QUADRATURE equally likely quantiles of the item population."""
    return stats.beta.ppf((np.arange(QUADRATURE) + 0.5) / QUADRATURE, mu * concentration, (1 - mu) * concentration)


def _logit(q):
    q = np.clip(q, 1e-12, 1 - 1e-12)
    return np.log(q) - np.log1p(-q)


@functools.lru_cache(maxsize=None)
def shift_for(mu: float, concentration: float, change: float) -> float:
    """The logit shift whose population mean change (with CHURN) is `change`."""
    q = population(mu, concentration)
    nodes, weights = np.polynomial.hermite_e.hermegauss(HERMITE)
    weights = weights / weights.sum()
    logits = _logit(q)[:, None] + CHURN * nodes[None, :]

    def mean_change(shift):
        return float((special.expit(logits + shift) @ weights).mean() - q.mean())

    low, high = -20.0, 20.0
    for _ in range(80):
        mid = (low + high) / 2
        low, high = (mid, high) if mean_change(mid) < change else (low, mid)
    return (low + high) / 2


def simulate(rng, n, k, mu, concentration, shape, change, datasets):
    """(per-item differences (datasets x n), the true mean change)."""
    base_q = rng.beta(mu * concentration, (1 - mu) * concentration, size=(datasets, n))
    if shape == "shift":
        shift = shift_for(mu, concentration, change)
        variant_q = special.expit(_logit(base_q) + shift + CHURN * rng.normal(size=(datasets, n)))
        truth = change
    else:  # broken: a share of items never right any more
        share = -change / mu
        variant_q = np.where(rng.random((datasets, n)) < share, 0.0, base_q)
        truth = -share * mu
    deltas = (rng.binomial(k, variant_q) - rng.binomial(k, base_q)) / k
    return deltas, truth


def candidates(deltas: np.ndarray, k: int, confidence: float, bootstrap: bool, rng) -> dict[str, tuple]:
    n = deltas.shape[1]
    mean, sd = deltas.mean(axis=1), deltas.std(axis=1, ddof=1)
    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / np.sqrt(n)
    floor_low, floor_high = tango_interval(0, 0, n, confidence)
    third = (n / ((n - 1) * (n - 2))) * ((deltas - mean[:, None]) ** 3).sum(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        skew_shift = np.where(sd > 0, third / (6 * sd ** 2 * n), 0.0)

    def widened(low, high):
        return np.minimum(low, mean + floor_low), np.maximum(high, mean + floor_high)

    cc = 1 / n  # one item's whole change, the continuity correction of Tango's interval and McNemar's test
    found = {"t": (mean - half, mean + half), "t+floor": widened(mean - half, mean + half),
             "t+skew+floor": widened(mean + skew_shift - half, mean + skew_shift + half),
             "t+skew+cc+floor": widened(mean + skew_shift - half - cc, mean + skew_shift + half + cc),
             "ours (t+cc+floor)": per_item_mean_interval(deltas, confidence)}
    if k == 1:
        found["Tango"] = tango_interval((deltas > 0).sum(axis=1), (deltas < 0).sum(axis=1), n, confidence)
    if bootstrap and n <= 100 and k in (2, 8):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = stats.bootstrap((deltas,), np.mean, axis=1, confidence_level=confidence, n_resamples=999,
                                     method="BCa", rng=rng, vectorized=True, batch=100)
        low, high = result.confidence_interval
        low, high = np.where(np.isnan(low), mean, low), np.where(np.isnan(high), mean, high)
        found["BCa+floor"] = widened(low, high)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", type=int, default=2000, help="simulated datasets per cell")
    parser.add_argument("--margin", type=float, default=0.02, help="verdict.margins.accuracy's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bootstrap", action="store_true", help="also BCa (slow; n <= 100, k in 2, 8)")
    parser.add_argument("--recheck", type=int, default=0, help="simulate ours' lowest N cells again, 10 x the datasets")
    parser.add_argument("--out", help="also write the markdown to this file")
    parser.add_argument("--json", help="write every cell to this JSON file")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    started = time.perf_counter()
    cells = []
    for n in SIZES:
        for k in SAMPLES:
            for mu in ACCURACIES:
                for concentration in CONCENTRATIONS:
                    for shape, change in (("shift", 0.0), ("shift", -args.margin), ("shift", -3 * args.margin),
                                          ("broken", -args.margin), ("broken", -3 * args.margin)):
                        deltas, truth = simulate(rng, n, k, mu, concentration, shape, change, args.datasets)
                        for name, (low, high) in candidates(deltas, k, 0.95, args.bootstrap, rng).items():
                            low, high = np.asarray(low, dtype=float), np.asarray(high, dtype=float)
                            cells.append({"n": n, "k": k, "base_accuracy": mu, "concentration": concentration,
                                          "shape": shape, "true_change": truth, "interval": name,
                                          "coverage": float(((low <= truth + 1e-12) & (truth - 1e-12 <= high)).mean()),
                                          "miss_low": float((low > truth + 1e-12).mean()),
                                          "miss_high": float((high < truth - 1e-12).mean()),
                                          "go": float((low > -args.margin).mean()),
                                          "width": float((high - low).mean())})
            print(f"n={n} k={k} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    text = "\n".join(table(cells, args) + recheck(cells, args, rng))
    text += f"\n\n{time.perf_counter() - started:.0f} s\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    if args.json:
        head = json.dumps({"datasets": args.datasets, "margin": args.margin, "seed": args.seed,
                           "machine": platform.machine(), "date": time.strftime("%Y-%m-%d")})[:-1]
        rows = ",\n".join(json.dumps({k: round(v, 6) if isinstance(v, float) else v for k, v in c.items()},
                                      separators=(",", ":")) for c in cells)
        Path(args.json).write_text(f'{head}, "cells": [\n{rows}\n]}}\n', encoding="utf-8")  # one cell a line


def recheck(cells: list[dict], args, rng) -> list[str]:
    """The --recheck settings where ours covered least, simulated again with 10 x the datasets (in chunks), so that
    the lowest cells are read without the Monte Carlo error their minimum picks up."""
    worst = sorted((c for c in cells if c["interval"].startswith("ours")), key=lambda c: c["coverage"])[:args.recheck]
    if not worst:
        return []
    lines = ["", f"The {len(worst)} settings where ours covered least, again over {10 * args.datasets} datasets "
                 f"(standard error about {(0.95 * 0.05 / (10 * args.datasets)) ** 0.5:.4f}):", "",
             "| n | k | base accuracy | concentration | shape | true change | first run | again | miss low again |",
             "|---|---|---|---|---|---|---|---|---|"]
    for c in worst:
        hits = low_misses = 0
        change = c["true_change"]
        for _ in range(10):
            deltas, truth = simulate(rng, c["n"], c["k"], c["base_accuracy"], c["concentration"], c["shape"],
                                     _nominal(change, args.margin), args.datasets)
            low, high = per_item_mean_interval(deltas, 0.95)
            hits += int(((low <= truth + 1e-12) & (truth - 1e-12 <= high)).sum())
            low_misses += int((low > truth + 1e-12).sum())
        total = 10 * args.datasets
        c["recheck"] = {"datasets": total, "coverage": hits / total, "miss_low": low_misses / total}
        lines.append(f"| {c['n']} | {c['k']} | {c['base_accuracy']} | {c['concentration']} | {c['shape']} "
                     f"| {c['true_change']:+.3f} | {c['coverage']:.3f} | {hits / total:.4f} | {low_misses / total:.4f} |")
    return lines


def _nominal(truth: float, margin: float) -> float:
    """The grid's change (0, -margin, -3 x margin) a cell's true change was drawn for."""
    return min((0.0, -margin, -3 * margin), key=lambda change: abs(change - truth))


def table(cells: list[dict], args) -> list[str]:
    """Per n and k, each candidate's lowest coverage over the 45 settings (with its highest miss-low share), the
    settings below 0.95 beyond Monte Carlo error, and its GO rate at no true change (what its width costs)."""
    names = list(dict.fromkeys(c["interval"] for c in cells))
    error = (0.95 * 0.05 / args.datasets) ** 0.5  # Monte Carlo standard error of a cell at 0.95
    lines = [f"Per-item-mean interval coverage, 95 % nominal, {args.datasets} simulated datasets per cell, margin "
             f"{args.margin} (seed {args.seed}; {platform.machine()}, {time.strftime('%Y-%m-%d')}).", "",
             "Per n and k, over the 45 settings (base accuracy x item spread x change): the lowest coverage (the "
             "highest miss-low share in brackets, nominal 0.025) · the settings whose coverage lies below 0.95 beyond "
             f"Monte Carlo error (by more than 2.33 standard errors, {2.33 * error:.3f}) · the GO rate when nothing "
             "changed (shift 0, mean over its 9 settings: what the width costs).", "",
             "| n | k | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for n in SIZES:
        for k in SAMPLES:
            row = []
            for name in names:
                mine = [c for c in cells if c["n"] == n and c["k"] == k and c["interval"] == name]
                if not mine:
                    row.append("–")
                    continue
                worst = min(mine, key=lambda c: c["coverage"])
                null = [c["go"] for c in mine if c["shape"] == "shift" and c["true_change"] == 0.0]
                below = sum(c["coverage"] < 0.95 - 2.33 * error for c in mine)
                row.append(f"{worst['coverage']:.3f} ({max(c['miss_low'] for c in mine):.3f}) · {below} · "
                           f"{np.mean(null):.2f}")
            lines.append(f"| {n} | {k} | " + " | ".join(row) + " |")
    for name in names:
        worst = min((c for c in cells if c["interval"] == name), key=lambda c: c["coverage"])
        lines.append("")
        lines.append(f"{name}: lowest {worst['coverage']:.3f} at n {worst['n']}, k {worst['k']}, base accuracy "
                     f"{worst['base_accuracy']}, concentration {worst['concentration']}, {worst['shape']}, true change "
                     f"{worst['true_change']:+.3f}")
    return lines


if __name__ == "__main__":
    main()
