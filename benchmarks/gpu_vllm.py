"""GPU benchmark: vLLM through our stages (`quantize bench --engine vllm`, `quantize eval --engine vllm`).

One part per device call (each must end within 10 minutes); the machine keeps /tmp between calls:

    python benchmarks/gpu_vllm.py kv-scales    # FP8 per-head KV scales reach vLLM's attention kernel
    python benchmarks/gpu_vllm.py build        # GLM-4-9B shapes, random bf16: base, AWQ W4A16, FP8 W8A8 + FP8 KV
    python benchmarks/gpu_vllm.py bench        # `quantize bench --engine vllm` on each: sweeps, percentiles, goodput
    python benchmarks/gpu_vllm.py overhead     # our HTTP bench at concurrency 1 vs vLLM's offline LLM.generate
    python benchmarks/gpu_vllm.py agreement    # small trained Glm: hf vs vLLM greedy outputs, base / AWQ / FP8
    python benchmarks/gpu_vllm.py eval-speed   # math suite items/s: hf vs vLLM on the GLM-4-9B shapes
    python benchmarks/gpu_vllm.py kl           # `quantize kl` on the GPU, GLM-4-9B shapes

The quantization stack runs in this process (PYTHONPATH=/tmp/site, llm-compressor's compressed-tensors
0.19); vLLM runs as `python3 -m vllm.entrypoints.cli.main serve` with its own PYTHONPATH (/tmp/vsite,
compressed-tensors 0.17): two site directories of wheels unpacked on the GPU machine (VLLM_SITE names the
second), because the two stacks pin different compressed-tensors releases. `--tiny` runs every part that needs
no real vLLM on the CPU against tests/openai_server.py, to check this script before it travels.
Each part prints a table last and writes $OUT/<part>.json.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_steps import step as record_step  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
OUT = Path(os.environ.get("OUT", "/tmp/gpu-vllm-out"))
TINY = "--tiny" in sys.argv
ROOT = Path("/tmp/gpu-vllm-tiny" if TINY else "/tmp/gpu-vllm")
VSITE = os.environ.get("VLLM_SITE", "/tmp/vsite")
VLLM_ENV = {"PYTHONPATH": VSITE, "VLLM_USE_FLASHINFER_SAMPLER": "0"}
SERVER = {"server_command": ([sys.executable, str(REPO / "tests" / "openai_server.py")] if TINY else
                             ["python3", "-m", "vllm.entrypoints.cli.main", "serve"]),
          "server_env": {} if TINY else VLLM_ENV, "start_timeout": 600}
SERVING = {"max_model_len": 4096, "gpu_memory_utilization": 0.85, "batch_size": 64}
SMALL_GLM = dict(hidden_size=1024, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=128, max_position_embeddings=4096)


def step(results: dict, part: str, name: str, fn):
    """Runs one measurement into OUT/<part>.json (benchmarks/gpu_steps.py)."""
    record_step(results, OUT / f"{part}.json", name, fn)


def free_gpu() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def calib_blocks(blocks: int, seq_len: int, vocab_hi: int) -> Path:
    import random

    rng = random.Random(0)
    path = ROOT / f"calib-{blocks}x{seq_len}.jsonl"
    ROOT.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        for i in range(blocks):
            handle.write(json.dumps({"block": i, "input_ids": [rng.randrange(10, vocab_hi) for _ in range(seq_len)]})
                         + "\n")
    return path


def glm9b_models() -> dict[str, Path]:
    return {"base": ROOT / "glm-random", "fp8-w8a8": ROOT / "fp8", "awq-w4a16": ROOT / "awq"}


# ---------------------------------------------------------------- build

def build() -> dict:
    from benchmarks.gpu_quantize import build_model
    from pipeline.stages import calib
    from pipeline.stages.quantize import run as quantize_run

    results: dict = {"date": time.strftime("%Y-%m-%d")}
    models = glm9b_models()
    if TINY:
        from tiny import save_tiny_glm

        step(results, "build", "base", lambda: str(save_tiny_glm(models["base"])))
    else:
        step(results, "build", "base (GLM-4-9B shapes, random bf16)", lambda: str(build_model(ROOT, 40)))
    blocks = calib_blocks(16, 128 if TINY else 512, 380 if TINY else 150000)
    step(results, "build", "holdout prompts", lambda: calib.run(
        REPO / "calib_data" / "support_logs.jsonl", ROOT / "calib-text", models["base"], seq_len=128,
        num_blocks=4, holdout=64).summary())
    step(results, "build", "FP8 W8A8 + FP8 KV per head", lambda: quantize_run(
        models["base"], models["fp8-w8a8"], blocks, "fp8", batch_size=16).summary())
    free_gpu()
    step(results, "build", "AWQ W4A16 g128 (16 x 512 calibration)", lambda: quantize_run(
        models["base"], models["awq-w4a16"], blocks, "awq", group_size=32 if TINY else 128, batch_size=16,
        n_grid=4 if TINY else 20).summary())
    return results


# ---------------------------------------------------------------- bench

def bench_all(names: list[str], rates: list[float]) -> dict:
    from pipeline.stages import bench

    results: dict = {"date": time.strftime("%Y-%m-%d")}
    models = glm9b_models()
    holdout = ROOT / "calib-text" / "holdout.jsonl"
    slo = {"ttft_ms": 200.0, "tpot_ms": 15.0, "e2el_ms": None}
    for name in names:
        step(results, "bench", f"bench {name}", lambda n=name: bench.run(
            models[n], ROOT / f"bench-{n}.json", engine="vllm", concurrency=[1, 16, 64] if not TINY else [1, 2],
            input_len=16 if TINY else 128, output_len=8 if TINY else 256, requests_per_level=2,
            holdout=holdout if holdout.exists() and not TINY else None, request_rates=rates, rate_seconds=1 if TINY else 8,
            slo=slo, **SERVING, **SERVER).figures)  # the server's log: bench-<name>.vllm.log beside the JSON
        free_gpu()
        keep(ROOT / f"bench-{name}.json", ROOT / f"bench-{name}.vllm.log")
    return results


def keep(*paths: Path, max_bytes: int = 200_000) -> None:
    """Copies files into $OUT (logs: their last max_bytes), where they come back from the device."""
    OUT.mkdir(parents=True, exist_ok=True)
    for path in paths:
        if path.exists():
            data = path.read_bytes()
            (OUT / path.name).write_bytes(data if path.suffix == ".json" else data[-max_bytes:])


def print_bench(results: dict) -> None:
    print("\n| model | workload | load | output tok/s | req/s | TTFT p50 / p99 ms | TPOT mean / p99 ms | ITL p99 ms "
          "| goodput req/s | memory GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key, value in results.items():
        if not key.startswith("bench ") or "workloads" not in value:
            continue
        for load in value["workloads"].values():
            for l in load["levels"] + load.get("rates", []):
                what = f"c={l['concurrency']}" if "concurrency" in l else f"{l['request_rate']:g} req/s"
                tp = l["tpot_ms_stats"] or {}
                print(f"| {key.split()[1]} | {load['name']} | {what} | {l['output_tokens_per_s']:.0f} | "
                      f"{l['requests_per_s']:.2f} | {l['ttft_ms']['median']:.0f} / {l['ttft_ms']['p99']:.0f} | "
                      f"{tp.get('mean', 0):.2f} / {tp.get('p99', 0):.2f} | {(l['itl_ms'] or {}).get('p99', 0):.2f} | "
                      f"{l['goodput_requests_per_s'] if l['goodput_requests_per_s'] is not None else '-'} | "
                      f"{(l.get('memory_bytes') or 0) / 2**30:.0f} |")
        r = value.get("roofline") or {}
        if r:
            print(f"| {key.split()[1]} | roofline batch 1 | {r['bandwidth_gb_s']:.0f} GB/s | "
                  f"{r['bytes_per_token'] / 1e9:.2f} GB/token | bound {r['bound_tokens_per_s']:.0f} tok/s | achieved "
                  f"{r['achieved_tokens_per_s']:.0f} ({r['fraction_of_bound']:.0%}) | | | | |")
        info = value.get("engine_info") or {}
        print(f"|   | engine | vllm {info.get('version')} | kv {info.get('kv_cache_dtype')} | start "
              f"{info.get('server_start_seconds')} s | | | | | |")


# ---------------------------------------------------------------- vLLM offline (its own process)

OFFLINE = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
spec = json.loads(sys.argv[1])
llm = LLM(model=spec["model"], seed=0, generation_config="vllm", **spec.get("llm", {}))
out = {}
if spec.get("scales"):
    def scales(model):
        found = {}
        for name, module in model.named_modules():
            if hasattr(module, "_k_scale") and hasattr(module._k_scale, "shape"):
                found[name] = {"k": module._k_scale.detach().float().cpu().flatten().tolist(),
                               "v": module._v_scale.detach().float().cpu().flatten().tolist(),
                               "k_float": getattr(module, "_k_scale_float", None),
                               "kv_cache_dtype": str(getattr(module, "kv_cache_dtype", None))}
        return found
    out["scales"] = llm.apply_model(scales)[0]
if spec.get("visual"):
    def visual(model):
        found = {}
        for name, module in model.named_modules():
            if "visual." in name and hasattr(module, "quant_method") and hasattr(module, "weight"):
                found[name] = {"quant_method": type(module.quant_method).__name__, "dtype": str(module.weight.dtype)}
        return found
    out["visual"] = llm.apply_model(visual)[0]
if spec.get("logprobs"):
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in spec["logprobs"]], params, use_tqdm=False)
    rows = []
    for o, ids in zip(outs, spec["logprobs"]):
        rows.append([None if d is None else d[ids[i]].logprob for i, d in enumerate(o.prompt_logprobs)])
    out["logprobs"] = rows
if spec.get("tpot"):
    ids, n = spec["tpot"]["ids"], spec["tpot"]["output_len"]
    long, one = (SamplingParams(max_tokens=m, min_tokens=m, ignore_eos=True, temperature=0.0) for m in (n, 1))
    llm.generate([TokensPrompt(prompt_token_ids=ids)], long, use_tqdm=False)  # warm-up
    times = []
    for _ in range(spec["tpot"].get("repeats", 4)):
        t0 = time.perf_counter(); llm.generate([TokensPrompt(prompt_token_ids=ids)], one, use_tqdm=False)
        t1 = time.perf_counter(); llm.generate([TokensPrompt(prompt_token_ids=ids)], long, use_tqdm=False)
        t2 = time.perf_counter()
        times.append({"ttft_s": t1 - t0, "e2e_s": t2 - t1})
    out["tpot"] = times
print("RESULT " + json.dumps(out))
"""


def vllm_offline(spec: dict, timeout: float = 540) -> dict:
    env = {**os.environ, **VLLM_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    script = ROOT / "vllm_offline.py"
    ROOT.mkdir(parents=True, exist_ok=True)
    script.write_text("if __name__ == '__main__':\n" + "\n".join("    " + line for line in OFFLINE.splitlines()))
    done = subprocess.run(["python3", str(script), json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=timeout)
    line = next((l for l in done.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"vLLM offline run failed (code {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


# ---------------------------------------------------------------- FP8 per-head KV scales reach the kernel

def kv_scales() -> dict:
    """A small Glm whose first KV head's keys and values are 16x larger than the others', quantized by our
    FP8 stage (per-head scales). Served by vLLM with an FP8 KV cache three ways: as written; with every
    head's scale replaced by the largest (what collapsing to one scale per tensor does); and with a bf16
    KV cache (the reference). If vLLM used one scale per tensor, the first two would give identical
    log-probabilities."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.stages.quantize import run as quantize_run
    from tiny import save_tiny_glm

    results: dict = {"date": time.strftime("%Y-%m-%d")}
    base = ROOT / "kv-base"
    save_tiny_glm(base, dtype=torch.bfloat16, **SMALL_GLM)
    weights = load_file(base / "model.safetensors")
    head_dim = SMALL_GLM["head_dim"]
    for layer in range(SMALL_GLM["num_hidden_layers"]):
        for proj in ("k_proj", "v_proj"):
            for kind in ("weight", "bias"):
                name = f"model.layers.{layer}.self_attn.{proj}.{kind}"
                if name in weights:
                    weights[name][:head_dim] *= 16  # KV head 0
    save_file(weights, base / "model.safetensors", metadata={"format": "pt"})
    blocks = calib_blocks(16, 256, 380)
    per_head = ROOT / "kv-fp8-per-head"
    step(results, "kv-scales", "FP8 stage (per-head KV)", lambda: quantize_run(base, per_head, blocks, "fp8", batch_size=16).summary())
    tensors = load_file(per_head / "model.safetensors")
    written = {name: tensors[name].float().flatten().tolist() for name in tensors if name.endswith(("k_scale", "v_scale"))}
    results["checkpoint scales"] = written
    collapsed = ROOT / "kv-fp8-collapsed"
    import shutil

    shutil.rmtree(collapsed, ignore_errors=True)
    shutil.copytree(per_head, collapsed)
    for name in written:
        tensors[name] = torch.full_like(tensors[name], float(tensors[name].max()))
    save_file(tensors, collapsed / "model.safetensors", metadata={"format": "pt"})
    import random

    rng = random.Random(1)
    prompts = [[rng.randrange(10, 380) for _ in range(96)] for _ in range(8)]
    common = {"enforce_eager": True, "max_model_len": 512, "gpu_memory_utilization": 0.3}
    runs = {}
    for label, model, kv in (("per-head fp8", per_head, "fp8"), ("collapsed fp8", collapsed, "fp8"),
                             ("bf16 cache", per_head, "auto")):
        runs[label] = step(results, "kv-scales", f"vLLM {label}", lambda m=model, k=kv: vllm_offline(
            {"model": str(m), "llm": {**common, "kv_cache_dtype": k}, "scales": True, "logprobs": prompts}))
    if all("logprobs" in r for r in runs.values()):
        def mean_abs(a, b):
            pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb) if x is not None]
            return sum(abs(x - y) for x, y in pairs) / len(pairs), max(abs(x - y) for x, y in pairs)

        ref = runs["bf16 cache"]["logprobs"]
        results["summary"] = {
            "per-head vs collapsed: mean / max |d logprob|": mean_abs(runs["per-head fp8"]["logprobs"],
                                                                      runs["collapsed fp8"]["logprobs"]),
            "per-head vs bf16 cache": mean_abs(runs["per-head fp8"]["logprobs"], ref),
            "collapsed vs bf16 cache": mean_abs(runs["collapsed fp8"]["logprobs"], ref),
            "vLLM's k scales, per-head checkpoint": {k: v["k"] for k, v in runs["per-head fp8"]["scales"].items()},
            "vLLM's k scales, collapsed checkpoint": {k: v["k"] for k, v in runs["collapsed fp8"]["scales"].items()},
        }
        (OUT / "kv-scales.json").write_text(json.dumps(results, indent=1, default=str))
    return results


# ---------------------------------------------------------------- harness overhead

def overhead() -> dict:
    """TPOT at concurrency 1: `quantize bench` over HTTP (bench-base.json) against vLLM's offline engine."""
    from transformers import AutoTokenizer

    from pipeline.stages.bench import fixed_workload

    results: dict = {"date": time.strftime("%Y-%m-%d")}
    base = glm9b_models()["base"]
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = fixed_workload(lambda t: tokenizer(t, add_special_tokens=False)["input_ids"], 128, 256).prompts[0]
    offline = step(results, "overhead", "offline LLM.generate, batch 1", lambda: vllm_offline(
        {"model": str(base), "llm": {"max_model_len": 4096, "gpu_memory_utilization": 0.85},
         "tpot": {"ids": ids, "output_len": 256, "repeats": 4}}))
    bench = json.loads((ROOT / "bench-base.json").read_text()) if (ROOT / "bench-base.json").exists() else None
    if bench and "tpot" in offline:
        tpots = [(t["e2e_s"] - t["ttft_s"]) / 255 * 1000 for t in offline["tpot"]]
        ours = bench["workloads"]["fixed"]["levels"][0]
        results["summary"] = {"offline_tpot_ms": sum(tpots) / len(tpots), "offline_tpot_ms_all": tpots,
                              "bench_http_tpot_ms": ours["tpot_ms"], "bench_concurrency": ours["concurrency"],
                              "ratio": ours["tpot_ms"] / (sum(tpots) / len(tpots))}
    return results


# ---------------------------------------------------------------- agreement on a real (trained) model

def agreement() -> dict:
    from pipeline.stages import evaluate
    from pipeline.stages.quantize import run as quantize_run
    from test_verdict_real import train_copy_model
    from tiny import save_tiny_glm

    results: dict = {"date": time.strftime("%Y-%m-%d")}
    root = ROOT / "agreement"
    shape = {**SMALL_GLM, "num_hidden_layers": 4, "hidden_size": 512, "intermediate_size": 1024,
             "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64}
    if TINY:  # the CPU check of this script: the path, not the training
        shape.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, head_dim=32)
    base = root / "glm-base"
    models = {}

    def make():
        train_copy_model(base, build=save_tiny_glm, steps=30 if TINY else 300, device="cpu" if TINY else "cuda",
                         lr=1e-3, **shape)
        blocks = calib_blocks(16, 128, 380)
        quantize_run(base, root / "glm-awq", blocks, "awq", group_size=64 if TINY else 128, batch_size=16, n_grid=4 if TINY else 20)
        quantize_run(base, root / "glm-fp8", blocks, "fp8", batch_size=16)
        models.update(base=base, awq=root / "glm-awq", fp8=root / "glm-fp8")
        return {k: str(v) for k, v in models.items()}

    step(results, "agreement", "train Glm (copy task) + AWQ + FP8", make)
    for label, model in models.items():
        def both(m=model):
            runs = {}
            for engine in ("vllm", "hf"):
                # bfloat16 for both: vLLM's FP8 attention writes bfloat16 only (a float16 FP8 server died here)
                options = {"batch_size": 64, "dtype": "bfloat16"}
                if engine == "vllm":
                    options = {**options, **SERVER, "max_model_len": 2048, "gpu_memory_utilization": 0.5,
                               "server_args": [] if TINY else ["--enforce-eager"]}
                out = root / f"math-{m.name}-{engine}"
                summary = evaluate.run(m, suite="math", task="quant_gsm8k", variant=m.name, out_dir=out,
                                       engine=engine, limit=40, max_new_tokens=32,
                                       log_path=root / f"{m.name}.vllm.log", **options).summary
                runs[engine] = (summary, {l["id"]: l["output"] for l in map(json.loads, (out / "math.jsonl")
                                                                             .read_text().splitlines())})
                free_gpu()
            (hf, hf_out), (vl, vl_out) = runs["hf"], runs["vllm"]
            same = sum(hf_out[i] == vl_out.get(i) for i in hf_out)
            return {"items": len(hf_out), "identical_outputs": same, "agreement": same / len(hf_out),
                    "score_hf": hf["score"], "score_vllm": vl["score"]}
        step(results, "agreement", f"{label}: math suite hf vs vLLM", both)
    keep(*(root / f"{m.name}.vllm.log" for m in models.values()), max_bytes=30_000)
    return results


# ---------------------------------------------------------------- eval items/s

def eval_speed(names: list[str]) -> dict:
    from pipeline.stages import evaluate

    results: dict = {"date": time.strftime("%Y-%m-%d")}
    models = glm9b_models()
    for name in names:
        for engine in ("vllm", "hf"):
            options = {"batch_size": 64, "dtype": "bfloat16"}
            if engine == "vllm":
                options = {**options, **SERVING, **SERVER}
            step(results, "eval-speed", f"math items/s, {name}, {engine}", lambda m=models[name], e=engine, o=options:
                 evaluate.run(m, suite="math", task="quant_gsm8k", variant=m.name, out_dir=ROOT / f"eval-{m.name}-{e}",
                              engine=e, limit=8 if TINY else 128, max_new_tokens=8 if TINY else 128,
                              log_path=ROOT / f"eval-{name}.vllm.log", **o).figures)
            free_gpu()
    return results


def kl() -> dict:
    from pipeline.stages import kl as kl_stage

    results: dict = {"date": time.strftime("%Y-%m-%d")}
    models = glm9b_models()
    for name in ("fp8-w8a8", "awq-w4a16"):
        step(results, "kl", f"kl {name}", lambda n=name: kl_stage.run(
            models["base"], models[n], ROOT / "calib-text" / "holdout.jsonl", OUT / f"kl-{n}.json",
            max_tokens=512, sequences=32).figures)
        free_gpu()
    return results


def print_results(results: dict) -> None:
    print("\n| step | result |\n|---|---|")
    for key, value in results.items():
        if isinstance(value, dict) and value.get("items_per_second") is not None:  # an eval summary
            value = {k: value.get(k) for k in ("engine", "n", "score", "items_per_second", "tokens_per_second",
                                                "generate_seconds", "seconds")}
        elif isinstance(value, dict) and "kl_mean" in value:
            value = {k: value.get(k) for k in ("tokens", "kl_mean", "top1_agreement", "device", "dtype",
                                                "models_resident", "seconds")}
        print(f"| {key} | {json.dumps(value, default=str)[:900]} |")


def _list(flag: str, default: str) -> list[str]:
    return (sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default).split(",")


if __name__ == "__main__":  # vLLM and lmdeploy start worker processes: the guard is required
    part = sys.argv[1] if len(sys.argv) > 1 else "build"
    if part == "build":
        print_results(build())
    elif part == "bench":
        print_bench(bench_all(_list("--models", "base,fp8-w8a8,awq-w4a16"),
                              [float(r) for r in _list("--rates", "8,32") if r]))
    elif part == "kv-scales":
        print_results(kv_scales())
    elif part == "overhead":
        print_results(overhead())
    elif part == "agreement":
        print_results(agreement())
    elif part == "eval-speed":
        print_results(eval_speed(_list("--models", "base,awq-w4a16")))
    elif part == "kl":
        print_results(kl())
    else:
        sys.exit(f"unknown part {part!r}")
