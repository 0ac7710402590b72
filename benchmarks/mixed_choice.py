"""Which groups to keep in 8 bits: the sensitivity rankings against the easy answers, at the same bits (issue 45
item 4).

On the demo model (SmolLM2-135M-Instruct from .cache/demo, `quantize fetch-demo`; without it a tiny Llama built in
code), CPU: RTN W4A16 (group 64) everywhere, and the same groups at W8A16. Each ranking is made on one half of the
held-out conversations; each choice of groups to keep in 8 bits is then scored on the other half (never seen by a
ranking) as the mean per-token KL(base || variant):

- `restore`: `quantize sensitivity --measure restore` (one pass per group with only it restored), the `mixed`
  method's rule (pipeline/methods/mixed.py `choose`) filling the budget;
- `taylor`: `quantize sensitivity` (its default: one gradient for every group), the same rule;
- `ModelOpt-style`: the score of NVIDIA ModelOpt's `auto_quantize` (method "gradient"): per Linear, the sum over
  tokens of (dL/dY)^2 (dY)^2, dY its output change from the base's when its weights are quantized, L the base's
  next-token cross-entropy, summed over a group's Linears; a group's gain is its W4A16 score minus its W8A16
  score. ModelOpt itself is not run (it quantizes into its own formats); its documented score is computed here;
- `random`: the groups in a random order, filled into the same budget by the same rule (mean of 5 seeds);
- `first+last`: the first and the last decoder layer's groups (then the second and the second-to-last, ...),
  filled into the same budget by the same rule.

RTN quantizes each Linear on its own, so a group's W8A16 weights do not depend on which others are kept: each
choice is scored by swapping the chosen groups' W8A16 weights into the W4A16 model in memory. The peer: one real
`quantize mixed` checkpoint of the taylor choice, scored by `quantize kl` on the same half, gives the same KL.
Prints a table; writes benchmarks/results/mixed_choice_cpu.{json,md}. benchmarks/gpu_mixed.py runs the same
comparison at GLM-4-9B shapes on the H200 (`compare`).

    python benchmarks/mixed_choice.py [--budgets 4.25,4.5] [--sequences 8] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import os
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
MEASURES = ("taylor", "restore")  # `quantize sensitivity --measure`


def demo_base(path: Path) -> Path:
    from pipeline.stages import resave

    if GGUF.exists():
        resave.run(GGUF, path, "float16")
    else:
        from tiny import save_tiny_llama

        save_tiny_llama(path, num_hidden_layers=4)
    return path


def prepare(root: Path, sequences: int, build_base=demo_base, group_size: int = 64, seq_len: int = 256,
            num_blocks: int = 16, variants: bool = True) -> dict:
    """The base, its calibration blocks, the held-out halves, the RTN W4A16 and W8A16 variants (kept between runs)."""
    from pipeline.formats.holdout import read_holdout, write_holdout
    from pipeline.stages import calib
    from pipeline.stages.quantize import run as quantize_run

    root.mkdir(parents=True, exist_ok=True)
    paths = {k: root / k for k in ("base", "calib", "w4", "w8", "rank.jsonl", "eval.jsonl")}
    if not (paths["base"] / "config.json").exists():
        build_base(paths["base"])
    if not paths["eval.jsonl"].exists():
        calib.run(REPO / "calib_data" / "support_logs.jsonl", paths["calib"], paths["base"], seq_len=seq_len,
                  num_blocks=num_blocks, holdout=2 * sequences)
        held = read_holdout(paths["calib"] / "holdout.jsonl")
        write_holdout(paths["rank.jsonl"], held[::2])
        write_holdout(paths["eval.jsonl"], held[1::2])
    blocks = paths["calib"] / "calib.jsonl"
    if not variants:
        return paths
    if not paths["w4"].exists():
        quantize_run(paths["base"], paths["w4"], blocks, "rtn", group_size=group_size)
    if not paths["w8"].exists():  # W8A16 everywhere: the mixed method with every group kept (ranked alike)
        ranking = rank(paths, "taylor", sequences, 128)[0]
        write_ranking(root / "sensitivity-any.json", {**ranking, "groups": [
            {**g, "kl_removed": 1.0, "share_removed": 1.0} for g in ranking["groups"]]})
        quantize_run(paths["base"], paths["w8"], blocks, "mixed", base="rtn", max_bits=8, group_size=group_size,
                     sensitivity=root / "sensitivity-any.json")
    return paths


def write_ranking(path: Path, figures: dict) -> None:
    from pipeline.formats.sensitivity import write_sensitivity

    write_sensitivity(path, figures)


def rank(paths: dict, measure: str, sequences: int, max_tokens: int) -> tuple[dict, float]:
    """`quantize sensitivity --measure <measure>` of the W4A16 variant on the ranking half, and its seconds."""
    from pipeline.stages import sensitivity

    started = time.perf_counter()
    result = sensitivity.run(paths["base"], paths["w4"], paths["rank.jsonl"], paths["w4"].parent /
                             f"sensitivity-{measure}.json", sequences=sequences, max_tokens=max_tokens,
                             measure=measure)
    return result.figures, time.perf_counter() - started


def load(paths: dict, names, device: str):
    import torch

    from pipeline.checkpoints.loading import load_for_inference

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return [load_for_inference(paths[k], dtype, device=device if device == "cuda" else None).eval() for k in names]


def modelopt_gains(base, w4, w8, groups: list[dict], sequences: list[list[int]], batch_size: int = 4) -> dict:
    """Per group, ModelOpt's gradient score of its W4A16 weights minus that of its W8A16 weights: per Linear,
    sum over tokens and outputs of (dL/dY)^2 (dY)^2, L the base's next-token cross-entropy, dY = x (W_q - W)^T."""
    import torch

    device = next(base.parameters()).device
    for parameter in base.parameters():
        parameter.requires_grad_(False)
    owner = {m: g["name"] for g in groups for m in g["modules"]}
    gains, inputs, hooks = dict.fromkeys((g["name"] for g in groups), 0.0), {}, []

    def keep_input(name):
        def hook(module, args, output):
            inputs[name] = args[0].detach()
        return hook

    def score(name):
        def hook(module, grad_input, grad_output):
            x, g2 = inputs.pop(name).float(), grad_output[0].float() ** 2
            for sign, model in ((1.0, w4), (-1.0, w8)):
                change = x @ (model.get_submodule(name).weight.float() - module.weight.float()).T
                gains[owner[name]] += sign * float((g2 * change ** 2).double().sum())
        return hook

    for name in owner:
        module = base.get_submodule(name)
        hooks += [module.register_forward_hook(keep_input(name)), module.register_full_backward_hook(score(name))]
    hooks.append(base.get_input_embeddings().register_forward_hook(lambda m, a, out: out.requires_grad_()))
    try:
        for start in range(0, len(sequences), batch_size):
            batch = sequences[start:start + batch_size]
            ids = torch.nn.utils.rnn.pad_sequence([torch.tensor(s) for s in batch], batch_first=True).to(device)
            mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(s), dtype=torch.long) for s in batch],
                                                   batch_first=True).to(device)
            labels = ids.masked_fill(mask == 0, -100)
            base(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    return gains


def fill(order: list[dict], total: int, max_bits: float) -> list[str]:
    """The groups of `order` kept in 8 bits by the mixed method's rule: in order, each that still fits."""
    extra, kept = (max_bits - 4) * total, []
    for group in order:
        if 4 * group["weights"] <= extra + 1e-9 * total:
            extra -= 4 * group["weights"]
            kept.append(group["name"])
    return kept


def choices(rankings: dict[str, list[dict]], groups: list[dict], max_bits: float) -> dict[str, list[str]]:
    """Each ranking's choice by the mixed method's rule (`choose`), the random orders' and first+last's."""
    from pipeline.methods.mixed import choose

    total = sum(g["weights"] for g in groups)
    found = {}
    for measure, ranked in rankings.items():
        rows, _ = choose(ranked, max_bits)
        found[measure] = [r["name"] for r in rows if r["scheme"] == "W8A16"]
    for seed in range(SEEDS):
        order = list(groups)
        random.Random(seed).shuffle(order)
        found[f"random-{seed}"] = fill(order, total, max_bits)
    layers = sorted({g["layer"] for g in groups})
    ends = [layer for pair in zip(layers, reversed(layers)) for layer in pair][:len(layers)]
    found["first+last"] = fill([g for layer in ends for g in groups if g["layer"] == layer], total, max_bits)
    return found


def score(models, groups: list[dict], named: dict[str, list[str]], sequences: list[list[int]]) -> dict[str, float]:
    """Mean per-token KL(base || W4A16 with each choice's groups at W8A16) on the evaluation half."""
    from pipeline.scoring.token_kl import log_probs, token_kl

    base, w4, w8 = models
    device = next(base.parameters()).device
    modules_of = {g["name"]: g["modules"] for g in groups}
    sums, tokens = dict.fromkeys(named, 0.0), 0
    for start in range(0, len(sequences), 8):
        batch = sequences[start:start + 8]
        base_lp, mask = log_probs(base, batch, device)
        for name, kept in named.items():
            modules = [m for group in kept for m in modules_of[group]]
            saved = {m: w4.get_submodule(m).weight.data for m in modules}
            for m in modules:
                w4.get_submodule(m).weight.data = w8.get_submodule(m).weight.data
            kl, _ = token_kl(base_lp, log_probs(w4, batch, device)[0], mask)
            for m, weight in saved.items():
                w4.get_submodule(m).weight.data = weight
            sums[name] += float(kl.double().sum())
        tokens += int(mask.sum())
    return {name: value / tokens for name, value in sums.items()}


def bits(groups: list[dict], kept: list[str]) -> float:
    total = sum(g["weights"] for g in groups)
    return 4 + 4 * sum(g["weights"] for g in groups if g["name"] in kept) / total


def peer(paths: dict, ranking_file: Path, max_bits: float, sequences: int, max_tokens: int) -> float:
    """`quantize mixed` (RTN) from the taylor ranking at this budget, scored by `quantize kl` on the evaluation half."""
    from pipeline.stages import kl
    from pipeline.stages.quantize import run as quantize_run

    out = paths["w4"].parent / f"mixed-{max_bits:g}"
    shutil.rmtree(out, ignore_errors=True)
    quantize_run(paths["base"], out, paths["calib"] / "calib.jsonl", "mixed", base="rtn", max_bits=max_bits,
                 group_size=64, sensitivity=ranking_file)
    kl_mean = kl.run(paths["base"], out, paths["eval.jsonl"], out.parent / f"kl-{max_bits:g}.json",
                     sequences=sequences, max_tokens=max_tokens).figures["kl_mean"]
    shutil.rmtree(out, ignore_errors=True)
    return kl_mean


def compare(paths: dict, budgets: list[float], sequences: int, max_tokens: int, device: str = "cpu",
            with_peer: bool = True) -> dict:
    """Every ranking's and easy answer's choice at each budget, scored; the rankings' costs."""
    from transformers import AutoTokenizer

    from pipeline.scoring.token_kl import holdout_texts

    rankings, seconds = {}, {}
    for measure in MEASURES:
        figures, seconds[measure] = rank(paths, measure, sequences, max_tokens)
        rankings[measure] = figures["groups"]
    groups = rankings["taylor"]
    tokenizer = AutoTokenizer.from_pretrained(paths["base"])
    ranking_half = holdout_texts(tokenizer, paths["rank.jsonl"], max_tokens, sequences)
    evaluation_half = holdout_texts(tokenizer, paths["eval.jsonl"], max_tokens, sequences)
    models = load(paths, ("base", "w4", "w8"), device)
    started = time.perf_counter()
    gains = modelopt_gains(*models, groups, ranking_half)
    seconds["ModelOpt-style"] = time.perf_counter() - started
    rankings["ModelOpt-style"] = sorted(({**g, "kl_removed": gains[g["name"]]} for g in groups),
                                        key=lambda g: -g["kl_removed"])
    named = {"none (W4A16)": [], "all (W8A16)": [g["name"] for g in groups]}
    for budget in budgets:
        named.update({f"{budget:g}/{k}": v for k, v in choices(rankings, groups, budget).items()})
    kls = score(models, groups, named, evaluation_half)
    rows = []
    for budget in budgets:
        random_names = [f"{budget:g}/random-{s}" for s in range(SEEDS)]
        for choice in (*rankings, "random", "first+last"):
            picked = random_names if choice == "random" else [f"{budget:g}/{choice}"]
            row = {"budget": budget, "choice": f"random (mean of {SEEDS})" if choice == "random" else choice,
                   "groups": sum(len(named[n]) for n in picked) / len(picked),
                   "bits": sum(bits(groups, named[n]) for n in picked) / len(picked),
                   "kl": sum(kls[n] for n in picked) / len(picked), "w4_kl": kls["none (W4A16)"]}
            if choice == "random":
                row["random_kls"] = [kls[n] for n in picked]
            rows.append(row)
        if with_peer:  # the taylor row's choice, built and scored by the pipeline's own stages
            row = next(r for r in rows if r["budget"] == budget and r["choice"] == "taylor")
            row["peer_quantize_mixed_kl"] = peer(paths, paths["w4"].parent / "sensitivity-taylor.json", budget,
                                                 sequences, max_tokens)
    return {"groups": len(groups), "sequences_per_half": sequences, "max_tokens": max_tokens,
            "w4a16_kl": kls["none (W4A16)"], "w8a16_kl": kls["all (W8A16)"],
            "ranking_seconds": {k: round(v, 1) for k, v in seconds.items()}, "rows": rows,
            "chosen": {f"{b:g}": {m: named[f"{b:g}/{m}"] for m in rankings} for b in budgets}}


def describe(base: Path) -> str:
    """The base as its config.json says (a base built by an earlier run is kept: the demo's GGUF may be gone)."""
    config = json.loads((base / "config.json").read_text())
    shape = f"{config['model_type']}, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}"
    demo = (config["num_hidden_layers"], config["hidden_size"], config.get("vocab_size")) == (30, 576, 49152)
    return f"SmolLM2-135M-Instruct, the demo model ({shape})" if demo else f"a tiny model built in code ({shape})"


def table(rows: list[dict]) -> str:
    lines = ["| budget (bits) | choice | groups in 8 bits | bits per weight | mean KL | KL vs W4A16 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['budget']:g} | {r['choice']} | {r['groups']:g} | {r['bits']:.3f} | {r['kl']:.5f} | "
                     f"{r['kl'] / r['w4_kl']:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budgets", default="4.25,4.5")
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    paths = prepare(ROOT, args.sequences)
    result = {"model": describe(paths["base"]),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, CPU only", "date": time.strftime("%Y-%m-%d"),
              **compare(paths, budgets, args.sequences, args.max_tokens)}
    text = table(result["rows"])
    print(text)
    out = REPO / "benchmarks" / "results"
    (out / "mixed_choice_cpu.json").write_text(json.dumps(result, indent=2) + "\n")
    cost = ", ".join(f"{k} {v} s" for k, v in result["ranking_seconds"].items())
    (out / "mixed_choice_cpu.md").write_text(
        f"# Which groups to keep in 8 bits (benchmarks/mixed_choice.py)\n\n{result['model']}, RTN group 64, "
        f"{result['groups']} groups; ranked on {args.sequences} held-out conversations, scored on {args.sequences} "
        f"others ({args.max_tokens} tokens each). W4A16 KL {result['w4a16_kl']:.5f}, W8A16 everywhere "
        f"{result['w8a16_kl']:.5f}. Rankings took {cost} on {result['machine']} ({result['date']}).\n\n{text}\n")


if __name__ == "__main__":
    main()
