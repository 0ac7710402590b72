"""GPU benchmark: GLM-4.6V (Glm4vMoeForConditionalGeneration) built, quantized and served through our stages.

The GLM-4.6V MoE at its real widths (hidden 4096, 96 query / 8 KV heads of 128, 128 routed experts top-8 of
moe_intermediate 1408 plus a shared expert, dense intermediate 10944, GLM's vocabulary, a 24-block vision
tower at 1536) at reduced depth (2 text layers: one dense, one MoE), random bf16 weights, GLM's image and video
tokens, processors and chat template (tests/tiny.py: the same fixture CI runs on the hf engine).

One part per device call (each must end within 10 minutes); the machine keeps /tmp between calls:

    python benchmarks/gpu_glm46v_vllm.py build   # base; FP8 (static dense, dynamic experts, per-head FP8 KV); AWQ
    python benchmarks/gpu_glm46v_vllm.py serve   # per variant, one vLLM start: `quantize bench` + `quantize eval
                                                 # --suite vqa`, both through the vLLM engine
    python benchmarks/gpu_glm46v_vllm.py check   # vLLM's own view (offline LLM): quant method and dtype of every
                                                 # visual.* linear, and the KV scales per head
    python benchmarks/gpu_glm46v_vllm.py train   # a small Glm4v trained on easy-VQA, its AWQ and FP8 (GPU or CPU;
                                                 # trained on the CPU and carried, `agreement` starts at the comparison)
    python benchmarks/gpu_glm46v_vllm.py agreement [--models base,awq,fp8]  # greedy VQA answers through hf and
                                                 # through vLLM, item by item, per vLLM configuration (AGREEMENT_RUNS:
                                                 # eager as shipped, eager and compiled with our defect settings)

The quantization stack runs in this process (PYTHONPATH=/tmp/site); vLLM with its own PYTHONPATH (VLLM_SITE,
/tmp/vsite). Each part prints a table last and writes $OUT/<part>.json; `serve` also writes
$OUT/gpu_glm46v_vllm.json (per variant: served or not, vLLM's version, speed, VQA items/s and score), the
file kept as benchmarks/results/gpu_glm46v_vllm.json. `--tiny` runs build and serve on the CPU against
tests/openai_server.py with the tiny fixture, to check this script before it travels.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_steps import step as record_step  # noqa: E402
from gpu_vllm import VLLM_ENV, calib_blocks, free_gpu, keep, vllm_offline  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
OUT = Path(os.environ.get("OUT", "/tmp/gpu-glm46v-out"))
TINY = "--tiny" in sys.argv
ROOT = Path("/tmp/glm46v-tiny" if TINY else "/tmp/glm46v")
SERVER = {"server_command": ([sys.executable, str(REPO / "tests" / "openai_server.py")] if TINY else
                             ["python3", "-m", "vllm.entrypoints.cli.main", "serve"]),
          "server_env": {} if TINY else VLLM_ENV, "start_timeout": 600}
SERVING = {"max_model_len": 4096, "gpu_memory_utilization": 0.85, "batch_size": 64, "dtype": "bfloat16"}
# GLM-4.6V (GLM-4.5V layout) at reduced depth: 2 text layers (first_k_dense_replace 1: one dense, one MoE)
TEXT = dict(vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=2, num_attention_heads=96,
            num_key_value_heads=8, head_dim=128, moe_intermediate_size=1408, n_routed_experts=128,
            num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            max_position_embeddings=65536, rms_norm_eps=1e-5, attention_bias=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "mrope_section": [8, 12, 12]})
VISION = dict(depth=24, hidden_size=1536, num_heads=12, intermediate_size=10944, out_hidden_size=4096, patch_size=14,
              image_size=336, spatial_merge_size=2, temporal_patch_size=2)
VARIANTS = ("base", "fp8", "awq")


def step(results: dict, part: str, name: str, fn):
    record_step(results, OUT / f"{part}.json", name, fn)


def models() -> dict[str, Path]:
    return {name: ROOT / name for name in VARIANTS}


# ---------------------------------------------------------------- build

def build() -> dict:
    import torch

    from pipeline.stages.quantize import run as quantize_run
    from tiny import save_tiny_glm4v_moe

    results: dict = {"date": time.strftime("%Y-%m-%d")}
    paths = models()
    built = {n for n, p in paths.items() if (p / "config.json").exists()}  # a run cut short resumes here
    results["already built"] = sorted(built)
    if "base" in built:
        pass
    elif TINY:
        step(results, "build", "base (tiny)", lambda: str(save_tiny_glm4v_moe(paths["base"])))
    else:
        step(results, "build", "base (GLM-4.6V widths, 2 text layers, 24-block vision, random bf16)",
             lambda: str(save_tiny_glm4v_moe(paths["base"], dtype=torch.bfloat16, text=TEXT, vision=VISION,
                                             device="cuda")))
    free_gpu()
    blocks = calib_blocks(16, 64 if TINY else 256, 380)  # token ids inside the tokenizer
    if "fp8" not in built:
        step(results, "build", "FP8 W8A8 (static dense, dynamic experts) + FP8 KV per head", lambda: quantize_run(
            paths["base"], paths["fp8"], blocks, "fp8", batch_size=16).info)
    free_gpu()
    if "awq" not in built:
        step(results, "build", "AWQ W4A16 (group size auto: 64, 10944 = 64 x 171)", lambda: quantize_run(
            paths["base"], paths["awq"], blocks, "awq", group_size=32 if TINY else "auto", batch_size=16,
            n_grid=4 if TINY else 20).info)
    free_gpu()
    return results


# ---------------------------------------------------------------- serve: one vLLM start per variant

def serve(names: list[str]) -> dict:
    """Per variant one vLLM server (through VLLMEngine, as the stages start it), shared by `quantize bench` and
    `quantize eval --suite vqa` in this process: make_engine hands both the running engine."""
    import pipeline.engines as engines
    from pipeline.stages import bench
    from pipeline.stages import evaluate

    results: dict = {"date": time.strftime("%Y-%m-%d")}
    table: dict = {"date": time.strftime("%Y-%m-%d"), "machine": "one H200" if not TINY else "CPU (tiny)",
                   "model": "GLM-4.6V layout at real widths, 2 text layers (1 dense + 1 MoE of 128 experts top-8), "
                            "24-block vision tower, random bf16", "variants": {}}
    original = engines.make_engine
    for name in names:
        path = models()[name]
        row: dict = {"served": False}
        table["variants"][name] = row
        if not (path / "config.json").exists():
            row["error"] = "not built"
            continue
        quant = json.loads((path / "quant.json").read_text()) if (path / "quant.json").exists() else {}
        row["scheme"] = quant.get("scheme", "bf16")
        engine_box: dict = {}

        def start(n=name, p=path):
            from pipeline.engines.vllm import Settings

            engine_box["engine"] = original("vllm", p, Settings(**SERVING, **SERVER), log_path=ROOT / f"{n}.vllm.log")
            return engine_box["engine"].describe()

        step(results, "serve", f"{name}: vLLM start", start)
        engine = engine_box.get("engine")
        keep(ROOT / f"{name}.vllm.log")
        if engine is None:
            row["error"] = (results.get(f"{name}: vLLM start") or {}).get("error")
            continue
        row.update(served=True, vllm_version=engine.version, start_s=engine.server.start_seconds)
        engine.close, real_close = (lambda: None), engine.close
        engines.make_engine = lambda *a, **k: engine  # noqa: E731 - the running server for both stages
        try:
            step(results, "serve", f"{name}: quantize bench", lambda p=path, n=name: bench.run(
                p, ROOT / f"bench-{n}.json", engine="vllm", concurrency=[1, 2] if TINY else [1, 16, 64],
                input_len=16 if TINY else 128, output_len=8 if TINY else 128, requests_per_level=2,
                request_rates=[], **SERVING, **SERVER).figures)
            bench_json = ROOT / f"bench-{name}.json"
            if bench_json.exists():
                levels = json.loads(bench_json.read_text())["workloads"]["fixed"]["levels"]
                row["tokens_per_s"] = {str(l["concurrency"]): round(l["output_tokens_per_s"], 1) for l in levels}
                row["ttft_ms_p50"] = {str(l["concurrency"]): round(l["ttft_ms"]["median"], 1) for l in levels}
                row["tpot_ms_mean"] = {str(l["concurrency"]): round((l["tpot_ms_stats"] or {}).get("mean", 0), 2)
                                       for l in levels}
                keep(bench_json)
            summary = step(results, "serve", f"{name}: quantize eval --suite vqa", lambda p=path, n=name: evaluate.run(
                p, suite="vqa", task="quant_vqa", variant=n, out_dir=ROOT / f"vqa-{n}", engine="vllm",
                limit=8 if TINY else 100, max_new_tokens=8 if TINY else 16, **SERVING, **SERVER).figures)
            vqa = results.get(f"{name}: quantize eval --suite vqa") or {}
            if "items_per_second" in vqa:
                row["vqa"] = {k: vqa.get(k) for k in ("n", "score", "items_per_second", "generate_seconds")}
            del summary
        finally:
            engines.make_engine = original
            real_close()
            free_gpu()
        (OUT / "gpu_glm46v_vllm.json").write_text(json.dumps(table, indent=1, default=str))
    return results | {"table": table}


# ---------------------------------------------------------------- check: vLLM's own view of the checkpoint

def check(names: list[str]) -> dict:
    results: dict = {"date": time.strftime("%Y-%m-%d")}
    for name in names:
        path = models()[name]
        if not (path / "config.json").exists():
            continue
        step(results, "check", f"{name}: vLLM's visual.* linears and KV scales", lambda p=path: vllm_offline(
            {"model": str(p), "llm": {"enforce_eager": True, "max_model_len": 2048, "gpu_memory_utilization": 0.6,
                                      "kv_cache_dtype": "fp8" if "fp8" in p.name else "auto"},
             "scales": True, "visual": True}))
        entry = results.get(f"{name}: vLLM's visual.* linears and KV scales") or {}
        if "visual" in entry:
            methods = sorted({v["quant_method"] for v in entry["visual"].values()})
            dtypes = sorted({v["dtype"] for v in entry["visual"].values()})
            entry["visual_summary"] = {"linears": len(entry["visual"]), "quant_methods": methods, "dtypes": dtypes}
            entry["kv_scale_shapes"] = sorted({len(v["k"]) for v in (entry.get("scales") or {}).values()})
        free_gpu()
    return results


# ---------------------------------------------------------------- agreement: hf vs vLLM on a trained vision model

SMALL_TEXT = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                      "partial_rotary_factor": 0.5,
                                                                      "mrope_section": [4, 6, 6]})
SMALL_VISION = dict(depth=2, hidden_size=128, num_heads=2, intermediate_size=512, out_hidden_size=256, patch_size=14,
                    image_size=336, spatial_merge_size=2, temporal_patch_size=2)


def train_vqa(path: Path, steps: int, device: str) -> dict:
    """A small Glm4v trained on the shipped easy-VQA items (prompt as `quantize eval` renders it, then the answer):
    a vision model whose greedy answers are not near-ties, so engine agreement means something."""
    import random

    import torch

    from pipeline.stages import evaluate
    from pipeline.checkpoints.loading import load_model
    from pipeline.engines.vision import ImagePrompter
    from tiny import save_tiny_glm4v

    save_tiny_glm4v(path, dtype=torch.float32, text=SMALL_TEXT, vision=SMALL_VISION)
    probe = ROOT / "vqa-prompts"
    evaluate.run(path, suite="vqa", task="quant_vqa", variant="probe", out_dir=probe, engine="hf", max_new_tokens=1,
                 batch_size=50, limit=8 if TINY else None)
    sys.path.insert(0, str(REPO / "evals" / "vqa"))
    import utils as vqa_utils  # evals/vqa/utils.py: the suite's own data and images

    docs = {str(d["id"]): d for d in vqa_utils.load_easy_vqa()["test"]}
    items = []
    for line in (probe / "vqa.jsonl").read_text().splitlines():
        row = json.loads(line)
        doc = docs.get(str(row["id"])) or docs[str(row["id"]).rsplit("-", 1)[-1]]
        items.append((row["prompt"], vqa_utils.doc_to_image(doc), doc["answer"]))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    prompter = ImagePrompter(path, tok)
    model = load_model(path, torch.float32).to(device).train()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rng, losses = random.Random(0), []
    for _ in range(steps):
        batch = rng.sample(items, min(16, len(items)))
        inputs = prompter.encode([p + a + tok.eos_token for p, _, a in batch], [i for _, i, _ in batch])
        labels = inputs["input_ids"].clone()
        for row, (p, images, _) in enumerate(batch):  # loss on the answer and EOS only
            prompt_len = len(prompter.encode([p], [images])["input_ids"][0])
            pad = int((inputs["attention_mask"][row] == 0).sum())  # left padding
            labels[row, : pad + prompt_len] = -100
        inputs = inputs.to(device)
        inputs["pixel_values"] = inputs["pixel_values"].float()
        loss = model(**inputs, labels=labels.to(device)).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    model.eval().to(torch.bfloat16).save_pretrained(path)
    return {"steps": steps, "loss_first": round(losses[0], 3), "loss_last10": round(sum(losses[-10:]) / 10, 4)}


def train() -> dict:
    """The trained base, its FP8 and its AWQ under ROOT/trained (GPU if there is one, else the CPU: the same
    models, carried to the GPU machine, let `agreement` start at the comparison)."""
    import torch

    from pipeline.stages.quantize import run as quantize_run

    results: dict = {"date": time.strftime("%Y-%m-%d")}
    root = ROOT / "trained"
    base = root / "base"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    step(results, "train", f"train Glm4v on easy-VQA ({device})", lambda: train_vqa(base, 20 if TINY else 400, device))
    blocks = calib_blocks(16, 64 if TINY else 256, 380)
    step(results, "train", "FP8", lambda: quantize_run(base, root / "fp8", blocks, "fp8", batch_size=16).summary())
    step(results, "train", "AWQ", lambda: quantize_run(base, root / "awq", blocks, "awq", group_size="auto",
                                                      batch_size=16, n_grid=4 if TINY else 20).summary())
    return results


# vLLM configurations the trained models are served under: --enforce-eager (fast starts) with vLLM as it ships
# and with the settings our engine adds for known defects (pipeline/engines/vllm_defects.py), and vLLM's
# default compiled mode with them (what the gpu-h200 profile runs)
AGREEMENT_RUNS = {
    "eager-shipped": {"server_args": ["--enforce-eager"], "defect_workarounds": False},
    "eager-pipeline": {"server_args": ["--enforce-eager"], "defect_workarounds": True},
    "compiled-pipeline": {"server_args": [], "defect_workarounds": True},
}
AGREEMENT_PLAN = {"base": list(AGREEMENT_RUNS), "awq": ["eager-pipeline", "compiled-pipeline"],
                  "fp8": ["eager-pipeline", "compiled-pipeline"]}


def agreement(names: list[str]) -> dict:
    """Greedy VQA answers of the trained Glm4v and its AWQ and FP8 through the hf engine and through vLLM
    (`quantize eval --suite vqa`'s code, 100 items), item by item, per vLLM configuration. Resumable: what a
    call measured is kept in ROOT/agreement-state.json and skipped by the next."""
    state_file = ROOT / "agreement-state.json"
    results: dict = json.loads(state_file.read_text()) if state_file.exists() else {"date": time.strftime("%Y-%m-%d")}
    root = ROOT / "trained"
    if not (root / "awq" / "config.json").exists():  # models trained elsewhere and carried: the comparison
        results.update(train())
    free_gpu()
    for name in names:
        model = root / name
        hf = _vqa_outputs(model, name, "hf", {})
        for run in AGREEMENT_PLAN[name]:
            key = f"{name}: VQA hf vs vLLM {run}"
            if "identical" in (results.get(key) or {}):
                continue
            step(results, "agreement", key, lambda m=model, n=name, r=run: _agree(hf, *_vqa_outputs(m, n, r, AGREEMENT_RUNS[r])))
            state_file.write_text(json.dumps(results, indent=1, default=str))
            keep(ROOT / f"trained-{name}-{run}.vllm.log")
    return results


def _vqa_outputs(model: Path, name: str, run: str, vllm: dict) -> tuple[dict, float]:
    from pipeline.stages import evaluate

    options = {"batch_size": 64, "dtype": "bfloat16"}
    if run != "hf":
        options.update(**SERVER, max_model_len=512, gpu_memory_utilization=0.3, **vllm,
                       log_path=ROOT / f"trained-{name}-{run}.vllm.log")
    out = ROOT / "trained" / f"vqa-{name}-{run}"
    summary = evaluate.run(model, suite="vqa", task="quant_vqa", variant=name, out_dir=out,
                           engine="hf" if run == "hf" else "vllm", limit=8 if TINY else None, **options).summary
    free_gpu()
    lines = [json.loads(line) for line in (out / "vqa.jsonl").read_text().splitlines()]
    return {line["id"]: line["output"] for line in lines}, summary["score"]


def _agree(hf: tuple[dict, float], outputs: dict, score: float) -> dict:
    same = sum(hf[0][i] == outputs.get(i) for i in hf[0])
    return {"items": len(hf[0]), "identical": same, "agreement": same / len(hf[0]), "score_hf": hf[1],
            "score_vllm": score}


def print_table(results: dict) -> None:
    table = results.get("table")
    if table:
        print("\n| variant | served | vLLM | start s | tok/s c=1 / 16 / 64 | TTFT p50 ms c=1 | TPOT ms c=1 | VQA items/s "
              "| VQA score |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, row in table["variants"].items():
            tps = row.get("tokens_per_s") or {}
            vqa = row.get("vqa") or {}
            print(f"| {name} | {row['served']} | {row.get('vllm_version')} | {row.get('start_s') or 0:.0f} | "
                  f"{' / '.join(str(v) for v in tps.values())} | {(row.get('ttft_ms_p50') or {}).get('1')} | "
                  f"{(row.get('tpot_ms_mean') or {}).get('1')} | {vqa.get('items_per_second')} | {vqa.get('score')} |"
                  + (f" {row['error'][:200]}" if row.get("error") else ""))
        return
    print("\n| step | result |\n|---|---|")
    for key, value in results.items():
        if isinstance(value, dict) and "visual_summary" in value:
            value = {"visual": value["visual_summary"], "kv_scale_lengths": value.get("kv_scale_shapes")}
        elif isinstance(value, dict) and "verify" in value:
            value = {k: value.get(k) for k in ("scheme", "seconds", "peak_gpu_bytes", "size_bytes")}
        print(f"| {key} | {json.dumps(value, default=str)[:600]} |")


def _list(flag: str, default: str) -> list[str]:
    return (sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default).split(",")


if __name__ == "__main__":  # vLLM starts worker processes: the guard is required
    part = sys.argv[1] if len(sys.argv) > 1 else "build"
    if part == "build":
        print_table(build())
    elif part == "serve":
        print_table(serve(_list("--models", ",".join(VARIANTS))))
    elif part == "train":
        print_table(train())
    elif part == "agreement":
        print_table(agreement(_list("--models", "base,awq,fp8")))
    elif part == "check":
        print_table(check(_list("--models", "fp8,awq")))
    else:
        sys.exit(f"unknown part {part!r}")
