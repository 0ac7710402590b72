"""FP8 on a small trained MoE (the GLM-4.5V / 4.6V layout), on the CPU: what the MoE scheme costs in accuracy.

A Glm4vMoe with a 3-layer text tower (one dense layer, two MoE layers of 8 routed experts top-2 plus a shared
expert, hidden 128) is trained for a few hundred AdamW steps on the shipped support conversations (language
modelling, vision tower unused), then quantized by `quantize fp8` three ways:

- `mixed` (the MoE default): dense and attention Linears static per-tensor, experts dynamic per-token;
- `dynamic`: every Linear dynamic per-token (what vLLM's fused MoE also takes);
- `static`: every Linear static per-tensor (the dense default: vLLM 0.24 refuses it for a MoE at load).

Each against the base, on held-out conversations never used for calibration: `quantize kl` (mean KL, top-1
agreement) and the perplexity suite (`quantize eval --suite ppl-chat`, token perplexity from its result lines).
Prints a table; writes benchmarks/results/moe_fp8_accuracy_cpu.{json,md}.

    python benchmarks/moe_fp8_accuracy_cpu.py [--steps 300]
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
ROOT = Path("/tmp/moe-fp8-accuracy")
TEXT = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, n_routed_experts=8, num_experts_per_tok=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=3, first_k_dense_replace=1,
            max_position_embeddings=1024,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [4, 2, 2]})


def train(path: Path, steps: int) -> dict:
    import torch

    from pipeline.checkpoints.loading import load_model
    from tiny import glm_vision_tokenizer, save_tiny_glm4v_moe

    save_tiny_glm4v_moe(path, dtype=torch.float32, text=TEXT)
    tok = glm_vision_tokenizer()
    lines = (REPO / "calib_data" / "support_logs.jsonl").read_text(encoding="utf-8").splitlines()
    texts = [tok.apply_chat_template([{"role": t["role"] if t["role"] != "agent" else "assistant",
                                       "content": t["content"]} for t in json.loads(l)["turns"]][:4], tokenize=False)
             for l in lines[:600]]
    model = load_model(path, torch.float32).train()
    optim = torch.optim.AdamW(model.parameters(), lr=2e-3)
    rng, losses, started = random.Random(0), [], time.perf_counter()
    torch.manual_seed(0)
    for _ in range(steps):
        batch = tok(rng.sample(texts, 16), return_tensors="pt", padding=True, truncation=True, max_length=192,
                    add_special_tokens=False)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(float(loss))
    model.eval().half().save_pretrained(path)
    return {"steps": steps, "loss_first": round(losses[0], 3), "loss_last10": round(sum(losses[-10:]) / 10, 3),
            "seconds": round(time.perf_counter() - started, 1)}


def token_perplexity(results_file: Path) -> float:
    rows = [json.loads(l) for l in results_file.read_text().splitlines() if l.strip()]
    loglik = sum(r["loglikelihood"] for r in rows)
    tokens = sum(r["n_tokens"] for r in rows)
    return math.exp(-loglik / tokens)


def main() -> None:
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 300
    from pipeline.stages import calib
    from pipeline.stages import evaluate
    from pipeline.stages import kl
    from pipeline.stages.quantize import run as quantize_run

    ROOT.mkdir(parents=True, exist_ok=True)
    base = ROOT / "base"
    results: dict = {"date": time.strftime("%Y-%m-%d"), "machine": "CPU (2 cores)", "model": TEXT}
    results["training"] = train(base, steps)
    print("trained:", results["training"], flush=True)
    data = ROOT / "calib"
    calib.run(REPO / "calib_data" / "support_logs.jsonl", data, base, seq_len=128, num_blocks=32, holdout=48)
    holdout = data / "holdout.jsonl"
    variants = {"base": base}
    for name, settings in (("mixed", {"activations": "static"}), ("dynamic", {"activations": "dynamic"})):
        variants[name] = quantize_run(base, ROOT / name, data / "calib.jsonl", "fp8", **settings).out
    # every Linear static: the recipe the dense default would give a MoE (vLLM refuses it at load)
    from dataclasses import replace

    from pipeline.methods import fp8
    from pipeline.methods.recipe import Recipe
    from pipeline.stages import quantize as stage

    dense = fp8.recipe(fp8.Params(method="fp8", activations="static"), replace(stage.read_target(base), moe=False))
    static = Recipe(dense.modifiers, "FP8 W8A8 (static activations everywhere)", {"activations": "static everywhere"})
    variants["static"] = stage.quantize(fp8, static, base, ROOT / "static", data / "calib.jsonl", batch_size=32).out
    rows = {}
    for name, model in variants.items():
        summary = evaluate.run(model, suite="ppl-chat", task="quant_ppl_chat", variant=name,
                               out_dir=ROOT / f"ppl-{name}", options={"data": str(holdout)}).summary
        row = {"perplexity": round(token_perplexity(ROOT / f"ppl-{name}" / "ppl-chat.jsonl"), 4),
               "documents": summary.get("n")}
        if name != "base":
            k = kl.run(base, model, holdout, ROOT / f"kl-{name}.json", sequences=48, max_tokens=256).summary
            row.update(kl_mean=round(k["kl_mean"], 5), top1_agreement=round(k["top1_agreement"], 4), tokens=k["tokens"])
        rows[name] = row
    base_ppl = rows["base"]["perplexity"]
    for row in rows.values():
        row["perplexity_change"] = round(row["perplexity"] / base_ppl - 1, 4)
    results["variants"] = rows
    out = REPO / "benchmarks" / "results"
    (out / "moe_fp8_accuracy_cpu.json").write_text(json.dumps(results, indent=1))
    lines = [f"FP8 on a small trained Glm4vMoe (CPU, {results['date']}, one run; trained {steps} steps, loss "
             f"{results['training']['loss_first']} -> {results['training']['loss_last10']})", "",
             "| variant | mean KL | top-1 agreement | token perplexity | change vs base |", "|---|---|---|---|---|"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row.get('kl_mean', '-')} | {row.get('top1_agreement', '-')} | {row['perplexity']} | "
                     f"{row['perplexity_change']:+.2%} |")
    (out / "moe_fp8_accuracy_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
