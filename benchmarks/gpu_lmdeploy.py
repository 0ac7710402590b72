"""GPU benchmark: lmdeploy through our stages (export, eval, bench), on the GPU machine.

    python benchmarks/gpu_lmdeploy.py agreement   # small trained models: hf vs lmdeploy outputs, export exactness
    python benchmarks/gpu_lmdeploy.py serving [--no-bench] [--fp8]   # random GLM-4-9B shapes: bench, eval items/s
    python benchmarks/gpu_lmdeploy.py hf-decodings [--ab]   # the hf engine's decoding paths on the GPU, base model
    python benchmarks/gpu_lmdeploy.py judge       # `quantize judge` with lmdeploy answering and judging

`agreement` trains two small models (Llama and Glm, 4 layers, hidden 512) for a few seconds on a
digit-copy task, quantizes each with AWQ, and runs the same suite items through the hf engine
(transformers, compressed-tensors dequantized) and the lmdeploy engine (our AWQ GEMM export; Glm as
ChatGLM): the share of identical outputs is the agreement rate. It also dequantizes every exported
AWQ tensor with lmdeploy's own reference code and compares it with ours.

`serving` builds GlmForCausalLM with GLM-4-9B's shapes and random bf16 weights (speed does not
depend on the values), makes the AWQ and FP8 variants with our stages, and runs `quantize bench`
(lmdeploy) on each that lmdeploy can serve, then the math suite's items/s with hf vs lmdeploy.

`hf-decodings` runs the math suite on the GLM-4-9B-shaped base with the hf engine four ways:
transformers' attention and cache, then pipeline/engines/decoding.py's grouped attention, its
preallocated cache, and both, each forced on or off (`--ab`: transformers' path and the
preallocated cache only, alternating, twice each).
Prints a table last; details go to $OUT.
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
OUT = Path(os.environ.get("OUT", "/tmp/gpu-lmdeploy-out"))
SMALL = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=2048)


def step(results: dict, name: str, fn):
    """Runs one measurement into OUT/<part>.json (benchmarks/gpu_steps.py)."""
    record_step(results, OUT / f"{sys.argv[1]}.json", name, fn)


def outputs(path: Path) -> dict[str, str]:
    return {l["id"]: l["output"] for l in map(json.loads, path.read_text().splitlines())}


def eval_both(model: Path, root: Path, suite: str, task: str, limit: int, max_new_tokens: int) -> dict:
    from pipeline.stages import evaluate

    runs = {}
    for engine in ("hf", "lmdeploy"):
        out = root / f"{model.name}-{engine}"
        summary = evaluate.run(model, suite=suite, task=task, variant=model.name, out_dir=out, engine=engine,
                               limit=limit, max_new_tokens=max_new_tokens,
                               batch_size=64, dtype="float16").summary
        runs[engine] = (summary, outputs(out / f"{suite}.jsonl"))
    (hf, hf_out), (lm, lm_out) = runs["hf"], runs["lmdeploy"]
    same = sum(hf_out[i] == lm_out.get(i) for i in hf_out)
    return {"items": len(hf_out), "identical_outputs": same, "agreement": same / len(hf_out),
            "score_hf": hf["score"], "score_lmdeploy": lm["score"],
            "seconds_hf": hf["seconds"], "seconds_lmdeploy": lm["seconds"]}


def export_exactness(variant: Path, exported: Path) -> dict:
    """Every exported AWQ tensor dequantized by lmdeploy's reference code == by ours."""
    from lmdeploy.pytorch.backends.default.awq_modules import dequantize_gemm
    from safetensors.torch import load_file

    from pipeline.checkpoints.lmdeploy_awq import dequantize_awq_gemm

    group = json.loads((exported / "config.json").read_text())["quantization_config"]["group_size"]
    tensors = {}
    for path in exported.glob("*.safetensors"):
        tensors.update(load_file(path, device="cuda"))
    worst, checked = 0.0, 0
    for name in [n for n in tensors if n.endswith(".qweight")]:
        prefix = name[: -len("qweight")]
        args = tensors[prefix + "qweight"], tensors[prefix + "qzeros"], tensors[prefix + "scales"]
        theirs = dequantize_gemm(*args, 4, group).t()
        ours = dequantize_awq_gemm(*args, group)
        worst = max(worst, (theirs.float() - ours.float()).abs().max().item())
        checked += 1
    return {"tensors": checked, "max_abs_difference": worst}


def agreement() -> dict:
    from pipeline.stages import calib
    from pipeline.stages import evaluate
    from pipeline.stages.quantize import run as quantize_run
    from test_verdict_real import TASK_UTILS, TASK_YAML, train_copy_model
    from tiny import save_tiny_glm, save_tiny_llama

    root = Path("/tmp/agreement")
    evals = root / "evals"
    (evals / "selftest").mkdir(parents=True, exist_ok=True)
    (evals / "selftest" / "copy.yaml").write_text(TASK_YAML)
    (evals / "selftest" / "utils.py").write_text(TASK_UTILS)
    results: dict = {}
    models = {}
    for arch, build, shape in (("llama", save_tiny_llama, SMALL), ("glm", save_tiny_glm, {**SMALL, "head_dim": 64})):
        def make(arch=arch, build=build, shape=shape):
            base = train_copy_model(root / f"{arch}-base", build=build, steps=300, device="cuda", lr=1e-3, **shape)
            cal = root / f"{arch}-calib"
            calib.run(REPO / "calib_data" / "support_logs.jsonl", cal, base, seq_len=128, num_blocks=16, holdout=8)
            variant = root / f"{arch}-awq"
            quantize_run(base, variant, cal / "calib.jsonl", "awq", group_size=128, batch_size=16)
            models[arch] = (base, variant)
            return {"base": str(base), "awq": str(variant)}
        step(results, f"{arch}: train + AWQ", make)
    for arch, (base, variant) in models.items():
        for label, model in (("base", base), ("awq", variant)):
            evaluate.EVALS_DIR = evals
            step(results, f"{arch} {label}: copy suite hf vs lmdeploy",
                 lambda m=model: eval_both(m, root / "copy", "copy", "quant_selftest_copy", 120, 2))
            evaluate.EVALS_DIR = REPO / "evals"
            step(results, f"{arch} {label}: math suite hf vs lmdeploy",
                 lambda m=model: eval_both(m, root / "math", "math", "quant_gsm8k", 40, 32))
        from pipeline.engines.lmdeploy import servable_dir

        step(results, f"{arch}: exported AWQ == lmdeploy's dequant",
             lambda v=variant: export_exactness(v, servable_dir(v)[0]))
    return results


def serving() -> dict:
    import torch

    from benchmarks.gpu_quantize import build_model, write_blocks
    from pipeline.stages import bench
    from pipeline.stages import calib
    from pipeline.stages.quantize import run as quantize_run

    root = Path("/tmp/serving")
    root.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d")}
    models = {}
    step(results, "build GLM-4-9B shapes", lambda: str(models.setdefault("base", build_model(root, 40))))
    blocks = write_blocks(root, 16, 512)
    holdout = root / "calib-text"
    step(results, "holdout prompts", lambda: calib.run(REPO / "calib_data" / "support_logs.jsonl", holdout,
                                                       models["base"], seq_len=256, num_blocks=4, holdout=64).summary())
    step(results, "AWQ (16 x 512 calibration)", lambda: quantize_run(
        models["base"], models.setdefault("awq-w4a16", root / "awq"), blocks, "awq", group_size=128, batch_size=16).summary())
    if "--fp8" in sys.argv:  # lmdeploy 0.18 cannot serve it (export refuses, see README): only the refusal to see
        step(results, "FP8", lambda: quantize_run(models["base"], models.setdefault("fp8-w8a8", root / "fp8"),
                                             blocks, "fp8").summary())
    if "--no-bench" not in sys.argv:
        for name, model in models.items():
            step(results, f"bench {name} (lmdeploy)", lambda m=model: bench.run(
                m, OUT / f"bench-{m.name}.json", engine="lmdeploy", concurrency=[1, 4, 16, 64], input_len=128,
                output_len=256, requests_per_level=1, holdout=holdout / "holdout.jsonl",
                batch_size=64).figures)
    for name, model in models.items():
        for engine in ("hf", "lmdeploy"):
            step(results, f"math suite items/s, {name}, {engine}", lambda m=model, e=engine: math_items(m, root, e))
    return results


def math_items(model: Path, root: Path, engine: str, tag: str = "") -> dict:
    from pipeline.stages import evaluate

    return evaluate.run(model, suite="math", task="quant_gsm8k", variant=model.name,
                        out_dir=root / f"math-{model.name}-{engine}{tag}", engine=engine, limit=128, max_new_tokens=128,
                        batch_size=64, dtype="bfloat16").summary


def hf_decodings() -> dict:
    import torch

    from benchmarks.gpu_quantize import build_model
    from pipeline.engines.decoding import use_grouped_attention
    from pipeline.engines.hf import HFEngine

    root = Path("/tmp/serving")
    root.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d")}
    model = build_model(root, 40)
    loaded = HFEngine.__init__
    settings = [(False, False), (True, False), (False, True), (True, True)]
    if "--ab" in sys.argv:
        settings = [(False, False), (False, True)] * 2
    for run, (grouped, preallocated) in enumerate(settings):
        def forced(self, *args, _grouped=grouped, _preallocated=preallocated, **kwargs):
            loaded(self, *args, **kwargs)
            if _grouped:
                use_grouped_attention(self.model)
            self.preallocate = _preallocated  # what HFEngine._cache reads
        HFEngine.__init__ = forced
        name = {(False, False): "transformers", (True, False): "grouped attention",
                (False, True): "preallocated cache", (True, True): "both"}[(grouped, preallocated)]
        try:
            step(results, f"math suite items/s, base, hf, {name} (run {run + 1})",
                 lambda: math_items(model, root, "hf", tag=f"-{run}"))
        finally:
            HFEngine.__init__ = loaded
    return results


def judge_through_lmdeploy() -> dict:
    """`quantize judge` with lmdeploy writing the answers and judging (the small trained Llama and its AWQ)."""
    from pipeline.stages import calib
    from pipeline.stages import judge
    from pipeline.settings.params import JudgeParams
    from pipeline.stages.quantize import run as quantize_run
    from test_verdict_real import train_copy_model

    root = Path("/tmp/judge")
    results: dict = {}
    base = train_copy_model(root / "base", steps=300, device="cuda", lr=1e-3, **SMALL)
    calib.run(REPO / "calib_data" / "support_logs.jsonl", root / "calib", base, seq_len=128, num_blocks=16, holdout=8)
    variant = root / "awq"
    quantize_run(base, variant, root / "calib" / "calib.jsonl", "awq", group_size=128, batch_size=16)
    settings = JudgeParams(backend="lmdeploy", limit=8, max_new_tokens=32, judge_max_new_tokens=16)
    step(results, "judge, lmdeploy answers and judge", lambda: judge.run(
        variant, base, root / "calib" / "holdout.jsonl", root / "out", settings, name="lmdeploy",
        batch_size=32).figures)
    return results


def print_serving_table(results: dict) -> None:
    print(f"\nlmdeploy PyTorch engine, GLM-4-9B shapes (random bf16), {results.get('device')}, {results.get('date')}")
    print("| model | workload | c | output tok/s | TTFT p50 ms | TPOT ms | memory GiB |")
    print("|---|---|---|---|---|---|---|")
    for key, value in results.items():
        if key.startswith("bench ") and "workloads" in value:
            for load in value["workloads"].values():
                for l in load["levels"]:
                    print(f"| {key.split()[1]} | {load['name']} | {l['concurrency']} | {l['output_tokens_per_s']:.0f} "
                          f"| {l['ttft_p50_ms']:.0f} | {l['tpot_ms']:.1f} | {(l['memory_bytes'] or 0) / 2**30:.1f} |")
            r = value["roofline"]
            print(f"|   roofline batch 1 | {r['bandwidth_gb_s']:.0f} GB/s | {r['bytes_per_token'] / 1e9:.2f} GB/token "
                  f"| bound {r['bound_tokens_per_s']:.0f} tok/s | achieved {r['achieved_tokens_per_s']:.0f} "
                  f"({r['fraction_of_bound']:.0%}) | | |")
    for key, s in results.items():
        if key.startswith("math suite") and s.get("items_per_second"):
            print(f"{key}: {s['n']} items, generation {s['generate_seconds']:.1f} s = "
                  f"{s['items_per_second']:.2f} items/s, {s['tokens_per_second']:.0f} tok/s "
                  f"(whole stage with model load: {s['seconds']:.0f} s)")


if __name__ == "__main__":  # lmdeploy starts worker processes: the guard is required
    part = sys.argv[1] if len(sys.argv) > 1 else "agreement"
    if part == "judge":
        print(json.dumps(judge_through_lmdeploy(), indent=1)[:3000])
    elif part == "hf-decodings":
        print_serving_table(hf_decodings())
    elif part == "agreement":
        found = agreement()
        print("\n| check | result |\n|---|---|")
        for key, value in found.items():
            print(f"| {key} | {json.dumps(value)[:200]} |")
    else:
        print_serving_table(serving())
