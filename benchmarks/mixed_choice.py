"""Which groups to keep in 8 bits: the sensitivity ranking against the easy answers, at the same bits (issue 45 item 4).

On the demo model (SmolLM2-135M-Instruct from .cache/demo, `quantize fetch-demo`; without it a tiny Llama built in
code), CPU: RTN W4A16 (group 64) everywhere, and the same groups at W8A16. `quantize sensitivity` ranks the W4A16
variant's groups on one half of the held-out conversations; each choice of groups to keep in 8 bits is then scored
on the other half (never seen by the ranking) as the mean per-token KL(base || variant):

- `sensitivity`: the `mixed` method's choice (pipeline/methods/mixed.py `choose`) from the ranking;
- `random`: the groups in a random order, filled into the same budget by the same rule (mean of 5 seeds);
- `first+last`: the first and the last decoder layer's groups (then the second and the second-to-last, ...),
  filled into the same budget by the same rule.

RTN quantizes each Linear on its own, so a group's W8A16 weights do not depend on which others are kept: each
choice is scored by swapping the chosen groups' W8A16 weights into the W4A16 model in memory. The peer: one real
`quantize mixed` checkpoint of the sensitivity choice, scored by `quantize kl` on the same half, gives the same KL.
Prints a table; writes benchmarks/results/mixed_choice_cpu.{json,md}.

    python benchmarks/mixed_choice.py [--budgets 4.25,4.5] [--sequences 16] [--max-tokens 256]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
ROOT = Path("/tmp/mixed-choice")
GGUF = REPO / ".cache" / "demo" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SEEDS = 5


def prepare(args) -> dict:
    """The base, its calibration blocks, the held-out halves, the W4A16 and W8A16 variants, the ranking."""
    from pipeline.formats.holdout import read_holdout, write_holdout
    from pipeline.stages import calib, resave, sensitivity
    from pipeline.stages.quantize import run as quantize_run

    paths = {k: ROOT / k for k in ("base", "calib", "w4", "w8", "rank.jsonl", "eval.jsonl", "sensitivity.json")}
    if not paths["base"].exists():
        if GGUF.exists():
            resave.run(GGUF, paths["base"], "float16")
        else:
            from tiny import save_tiny_llama

            save_tiny_llama(paths["base"], num_hidden_layers=4)
    if not paths["calib"].exists():
        calib.run(REPO / "calib_data" / "support_logs.jsonl", paths["calib"], paths["base"], seq_len=256,
                  num_blocks=16, holdout=2 * args.sequences)
        held = read_holdout(paths["calib"] / "holdout.jsonl")
        write_holdout(paths["rank.jsonl"], held[::2])
        write_holdout(paths["eval.jsonl"], held[1::2])
    blocks = paths["calib"] / "calib.jsonl"
    if not paths["w4"].exists():
        quantize_run(paths["base"], paths["w4"], blocks, "rtn", group_size=64)
    started = time.perf_counter()
    result = sensitivity.run(paths["base"], paths["w4"], paths["rank.jsonl"], paths["sensitivity.json"],
                             sequences=args.sequences, max_tokens=args.max_tokens)
    paths["sensitivity_seconds"] = time.perf_counter() - started
    if not paths["w8"].exists():  # every ranked group kept: W8A16 everywhere
        quantize_run(paths["base"], paths["w8"], blocks, "mixed", base="rtn", max_bits=8, group_size=64,
                     sensitivity=paths["sensitivity.json"])
    paths["ranking"] = result.figures
    return paths


def fill(order: list[dict], total: int, max_bits: float) -> list[str]:
    """The groups of `order` kept in 8 bits by the mixed method's rule: in order, each that still fits."""
    extra, kept = (max_bits - 4) * total, []
    for group in order:
        if 4 * group["weights"] <= extra + 1e-9 * total:
            extra -= 4 * group["weights"]
            kept.append(group["name"])
    return kept


def choices(groups: list[dict], max_bits: float) -> dict[str, list[str]]:
    from pipeline.methods.mixed import choose

    total = sum(g["weights"] for g in groups)
    rows, _ = choose(groups, max_bits)
    found = {"sensitivity": [r["name"] for r in rows if r["scheme"] == "W8A16"]}
    for seed in range(SEEDS):
        order = list(groups)
        random.Random(seed).shuffle(order)
        found[f"random-{seed}"] = fill(order, total, max_bits)
    layers = sorted({g["layer"] for g in groups})
    ends = [layer for pair in zip(layers, reversed(layers)) for layer in pair][:len(layers)]
    found["first+last"] = fill([g for layer in ends for g in groups if g["layer"] == layer], total, max_bits)
    return found


def score(paths: dict, named: dict[str, list[str]], args) -> dict[str, float]:
    """Mean per-token KL(base || W4A16 with each choice's groups at W8A16) on the evaluation half."""
    import torch
    from transformers import AutoTokenizer

    from pipeline.checkpoints.loading import load_for_inference
    from pipeline.scoring.token_kl import holdout_texts, log_probs, token_kl

    groups = {g["name"]: g["modules"] for g in paths["ranking"]["groups"]}
    base, w4, w8 = (load_for_inference(paths[k], torch.float32).eval() for k in ("base", "w4", "w8"))
    sequences = holdout_texts(AutoTokenizer.from_pretrained(paths["base"]), paths["eval.jsonl"], args.max_tokens,
                              args.sequences)
    sums, tokens = dict.fromkeys(named, 0.0), 0
    for start in range(0, len(sequences), 8):
        batch = sequences[start:start + 8]
        base_lp, mask = log_probs(base, batch, "cpu")
        for name, kept in named.items():
            modules = [m for group in kept for m in groups[group]]
            saved = {m: w4.get_submodule(m).weight.data for m in modules}
            for m in modules:
                w4.get_submodule(m).weight.data = w8.get_submodule(m).weight.data
            kl, _ = token_kl(base_lp, log_probs(w4, batch, "cpu")[0], mask)
            for m, weight in saved.items():
                w4.get_submodule(m).weight.data = weight
            sums[name] += float(kl.double().sum())
        tokens += int(mask.sum())
    return {name: value / tokens for name, value in sums.items()}


def bits(groups: list[dict], kept: list[str]) -> float:
    total = sum(g["weights"] for g in groups)
    return 4 + 4 * sum(g["weights"] for g in groups if g["name"] in kept) / total


def peer(paths: dict, max_bits: float, args) -> float:
    """`quantize mixed` (RTN) at this budget, scored by `quantize kl` on the evaluation half."""
    from pipeline.stages import kl
    from pipeline.stages.quantize import run as quantize_run

    out = ROOT / f"mixed-{max_bits:g}"
    shutil.rmtree(out, ignore_errors=True)
    quantize_run(paths["base"], out, paths["calib"] / "calib.jsonl", "mixed", base="rtn", max_bits=max_bits,
                 group_size=64, sensitivity=paths["sensitivity.json"])
    return kl.run(paths["base"], out, paths["eval.jsonl"], ROOT / f"kl-{max_bits:g}.json", sequences=args.sequences,
                  max_tokens=args.max_tokens).figures["kl_mean"]


def table(rows: list[dict]) -> str:
    lines = ["| budget (bits) | choice | groups in 8 bits | bits per weight | mean KL | KL vs W4A16 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget']:g} | {r['choice']} | {r['groups']} | {r['bits']:.3f} | {r['kl']:.5f} | "
                     f"{r['kl'] / r['w4_kl']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="4.25,4.5")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    ROOT.mkdir(parents=True, exist_ok=True)
    paths = prepare(args)
    groups = paths["ranking"]["groups"]
    budgets = [float(b) for b in args.budgets.split(",")]
    named = {"none (W4A16)": [], "all (W8A16)": [g["name"] for g in groups]}
    for budget in budgets:
        named.update({f"{budget:g}/{k}": v for k, v in choices(groups, budget).items()})
    kls = score(paths, named, args)
    rows = []
    for budget in budgets:
        random_kls = [kls[f"{budget:g}/random-{s}"] for s in range(SEEDS)]
        random_bits = [bits(groups, named[f"{budget:g}/random-{s}"]) for s in range(SEEDS)]
        for choice, kl, b, n in (
                ("sensitivity", kls[f"{budget:g}/sensitivity"], bits(groups, named[f"{budget:g}/sensitivity"]),
                 len(named[f"{budget:g}/sensitivity"])),
                (f"random (mean of {SEEDS})", sum(random_kls) / SEEDS, sum(random_bits) / SEEDS,
                 sum(len(named[f"{budget:g}/random-{s}"]) for s in range(SEEDS)) / SEEDS),
                ("first+last", kls[f"{budget:g}/first+last"], bits(groups, named[f"{budget:g}/first+last"]),
                 len(named[f"{budget:g}/first+last"]))):
            rows.append({"budget": budget, "choice": choice, "groups": n, "bits": b, "kl": kl,
                         "w4_kl": kls["none (W4A16)"]})
        rows[-3]["random_kls"] = random_kls
        rows[-3]["peer_quantize_mixed_kl"] = peer(paths, budget, args)
    result = {"model": str(GGUF.name if GGUF.exists() else "tiny Llama (no demo model on disk)"),
              "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, CPU only",
              "groups": len(groups), "sequences_per_half": args.sequences, "max_tokens": args.max_tokens,
              "w4a16_kl": kls["none (W4A16)"], "w8a16_kl": kls["all (W8A16)"],
              "sensitivity_seconds": round(paths["sensitivity_seconds"], 1), "rows": rows,
              "chosen": {f"{b:g}": named[f"{b:g}/sensitivity"] for b in budgets}}
    text = table(rows)
    print(text)
    out = REPO / "benchmarks" / "results"
    (out / "mixed_choice_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "mixed_choice_cpu.md").write_text(
        f"# Which groups to keep in 8 bits (benchmarks/mixed_choice.py)\n\n{result['model']}, RTN group 64, "
        f"{result['groups']} groups; ranked on {args.sequences} held-out conversations, scored on {args.sequences} "
        f"others ({args.max_tokens} tokens each). W4A16 KL {result['w4a16_kl']:.5f}, W8A16 everywhere "
        f"{result['w8a16_kl']:.5f}; the ranking took {result['sensitivity_seconds']} s on {result['machine']}.\n\n"
        f"{text}\n")


if __name__ == "__main__":
    main()
