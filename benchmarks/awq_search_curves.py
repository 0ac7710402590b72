"""Can the attention's 20 forward passes be cut without changing AWQ's choice? (issue 36)

llm-compressor's forward search scores every grid candidate by the parent module's output error over all calibration
tokens (for the attention: 20 candidates + 1 reference pass, about half our stage's time on the H200 and on the CPU).
A cheaper search keeps the exhaustive choice only if it can tell the winner without scoring all of them. This script
records, for every mapping that goes through that search, in a real `quantize awq` run:

- each candidate's exact loss (llm-compressor's, as the search computes it) and where the curve over the duo-scaling
  ratios has local minima: a jagged curve defeats a local search (golden section, walking downhill);
- each candidate's loss under an X^T X proxy (the balance Linears stacked, their weight error in the Gram metric of
  their shared input, as `awq_gram.py` scores single-Linear mappings; float32), and the exhaustive winner's rank in
  the proxy's order: the shortlist a "rank by the proxy, rescore the best K exactly" search would need to keep it.

    python benchmarks/awq_search_curves.py [--model models/base] [--calib calib_data/build/calib.jsonl] [--n-grid 20]

Needs the demo's base and calibration blocks (`quantize fetch-demo && dvc repro resave calib`). Prints a summary and a
table per mapping; writes awq_search_curves.json into $OUT (or --out).
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


def local_minima(losses: list[float]) -> list[int]:
    """Indices i of the duo-scaling part of the grid (1..n-1; 0 is the identity scale) where the loss is no higher
    than at either neighbour."""
    duo = losses[1:]
    return [i + 1 for i in range(len(duo))
            if (i == 0 or duo[i] <= duo[i - 1]) and (i == len(duo) - 1 or duo[i] <= duo[i + 1])]


def record_searches(records: list[dict]):
    """GramAWQModifier patched for one run: the forward-searched mappings' inputs accumulated as X^T X, and each search
    recorded (exact losses from llm-compressor's own search, proxy losses beside them). The choice is not changed."""
    import torch

    import pipeline.methods.awq_gram as awq_gram
    from pipeline.methods.awq_gram import GramAWQModifier

    setup, search = GramAWQModifier._setup_activation_cache_hooks, GramAWQModifier._compute_best_scale
    grams: dict = {}

    def setup_with_grams(self):
        setup(self)
        for mapping in self._resolved_mappings:
            def hook(module, args, output, name=mapping.smooth_name):
                x = args[0].detach()
                entry = grams.setdefault(name, [None, 0])
                entry[0] = awq_gram._gram_update(entry[0], x)
                entry[1] += x.reshape(-1, x.shape[-1]).shape[0]
            self.register_hook(mapping.activation_hook_target or mapping.balance_layers[0], hook, "forward")

    def recorded_search(self, mapping, fp16_outputs, orig_layer_weights):
        gram, tokens = grams.pop(mapping.smooth_name)
        layers = mapping.balance_layers
        device = layers[0].weight.device
        x_sum, count = self._smooth_activation_stats[mapping.smooth_name]
        x_mean = x_sum.to(device) / count.to(device)
        w_mean = self._compute_layer_means(layers).to(device) if self.duo_scaling else None
        grid = self._get_grid_search_params()
        scales = torch.stack([awq_gram._candidate_scales(x_mean, w_mean, ratio, duo) for ratio, duo in grid])
        stacked = torch.cat([orig_layer_weights[layer] for layer in layers]).to(device)
        proxy = awq_gram._stacked_losses(stacked, scales, gram.to(device), tokens, layers[0].quantization_scheme.weights,
                                         1)
        self._ranking_losses = []  # GramAWQModifier._compute_loss appends every candidate's exact loss here
        try:
            chosen = search(self, mapping, fp16_outputs, orig_layer_weights)
        finally:
            exact, self._ranking_losses = self._ranking_losses, None
        winner = min(range(len(exact)), key=lambda i: (exact[i], i))
        order = sorted(range(len(proxy)), key=lambda i: (proxy[i], i))
        records.append({"mapping": mapping.smooth_name, "parent": mapping.parent_name, "grid": grid, "exact": exact,
                        "proxy": proxy, "winner": winner, "proxy_best": order[0], "winner_rank_in_proxy": order.index(winner),
                        "local_minima": local_minima(exact)})
        return chosen

    GramAWQModifier._setup_activation_cache_hooks = setup_with_grams
    GramAWQModifier._compute_best_scale = recorded_search
    return lambda: (setattr(GramAWQModifier, "_setup_activation_cache_hooks", setup),
                    setattr(GramAWQModifier, "_compute_best_scale", search))


def summary(records: list[dict], n_grid: int) -> list[str]:
    ranks = sorted(r["winner_rank_in_proxy"] for r in records)
    jagged = sum(len(r["local_minima"]) > 1 for r in records)
    kinds = sorted({r["mapping"].rsplit(".", 1)[-1] for r in records})
    lines = [f"{len(records)} mappings searched by forward passes ({', '.join(kinds)}), n_grid {n_grid}",
             f"- loss curve over the duo-scaling ratios with more than one local minimum: {jagged} of {len(records)}",
             f"- exhaustive winner = the proxy's best: {sum(r == 0 for r in ranks)} of {len(records)}; its rank in the "
             f"proxy's order: median {ranks[len(ranks) // 2]}, max {ranks[-1]} (0 = best)"]
    for keep in (3, 5, 8):
        kept = sum(r["winner"] == 0 or r["winner_rank_in_proxy"] < keep for r in records)
        lines.append(f"- a shortlist of the proxy's best {keep} (+ the identity) keeps the winner in {kept} of {len(records)} "
                     "mappings")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "models/base")
    parser.add_argument("--calib", type=Path, default=REPO / "calib_data/build/calib.jsonl")
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--n-grid", type=int, default=20)
    parser.add_argument("--root", type=Path, default=Path("/tmp/awq-search-curves"))
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    args = parser.parse_args()
    from pipeline.stages.quantize import run as quantize_run

    records: list[dict] = []
    restore = record_searches(records)
    started = time.perf_counter()
    try:
        quantize_run(args.model, args.root / "out", args.calib, "awq", group_size=args.group, batch_size=args.batch,
                     n_grid=args.n_grid)
    finally:
        restore()
    print(f"\n{args.model} ({time.strftime('%Y-%m-%d')}, {time.perf_counter() - started:.0f} s)")
    print("\n".join(summary(records, args.n_grid)))
    print("\n| mapping | winner | proxy's best | winner's rank in the proxy | local minima (duo part) |\n|---|---|---|---|---|")
    for r in records:
        print(f"| {r['mapping']} | {r['winner']} | {r['proxy_best']} | {r['winner_rank_in_proxy']} | {r['local_minima']} |")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "awq_search_curves.json").write_text(json.dumps(
            {"args": {k: str(v) for k, v in vars(args).items()}, "records": records}, indent=1))


if __name__ == "__main__":
    main()
