"""Which serving engines serve a checkpoint: keyed by what was run on the GPU machine, never by what an
engine's documentation promises.

A checkpoint is described by its key, read off config.json alone: architecture x scheme x KV-cache
strategy (`checkpoint_key`). `SHOWN` lists every run recorded on the GPU machine (engine, its version,
the key, date, and where the evidence is); an engine "serves" a checkpoint only when a run with its
key was recorded and loaded and answered. A recorded refusal says so with the engine's error; an
architecture the engine's own source has no model for says "cannot" with the way out (`CANNOT`: read off the
source, never run); any other key says "not shown" with the command to try. quant.json (`serving`), the report and `quantize
export` all read `support_from_config`, so the three always say the same thing; the report recomputes
it from config.json, so a run recorded later shows there without rebuilding the variant.

Schemes: `none` (bf16/fp16), `w4a16` (compressed-tensors pack-quantized: AWQ and RTN write the same
format), `w4a16-actorder-weight` (the same tensors, config.json naming an activation order, as GPTQ writes it),
`w4a16+w8a16` (the `mixed` method: a W4A16 and a W8A16 config group in one checkpoint),
`w4a16-autoawq` (`quantize export --engine lmdeploy`), `fp8-static` (per-channel weights,
static per-tensor activations), `fp8-dynamic` (dynamic per-token activations everywhere),
`fp8-static+dynamic-experts` (the MoE default: experts dynamic, the rest static). KV: `per-head`,
`per-tensor` or `none`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoints import checkpoint, config_json


@dataclass(frozen=True)
class Run:
    engine: str
    version: str
    architecture: str
    scheme: str
    kv: str
    served: bool  # False: the engine refused it (a recorded failure)
    date: str
    evidence: str  # where the run's output is (benchmarks/results/..., or the README section)
    note: str = ""
    flags: str = ""  # what the run's `vllm serve` had beyond serve_command's (a defect's workaround)


_GLM = "GlmForCausalLM"
_GLM4V_MOE = "Glm4vMoeForConditionalGeneration"
_GLM46V = "benchmarks/results/gpu_glm46v_vllm.json"
_README_MOE = "README: vLLM on the H200, GLM-4.5V layout (2 text layers, 8 experts top-2, --enforce-eager)"
_GLM4V = "Glm4vForConditionalGeneration"
_GLM4V_VQA = "benchmarks/results/gpu_glm4v_vqa_agreement.json"
_GLM4V_NOTE = "with the rotary custom op off (vllm#42016): as vLLM ships, eager, its image positions rotate wrongly"
# the engine's workaround for that defect (pipeline/engines/vllm_defects.py; tests/test_model_card.py checks the two agree)
_GLM4V_FLAGS = """--compilation-config '{"custom_ops": ["-rotary_embedding"]}'"""
SHOWN: tuple[Run, ...] = (
    # GLM-4-9B shapes, random weights, one H200 (and TP 2 on two), vLLM 0.24.0
    Run("vllm", "0.24.0", _GLM, "none", "none", True, "2026-11-30", "benchmarks/results/gpu_vllm_bench_base.json"),
    Run("vllm", "0.24.0", _GLM, "w4a16", "none", True, "2026-11-30",
        "benchmarks/results/gpu_vllm_bench_awq-w4a16.json", "Machete kernels"),
    Run("vllm", "0.24.0", _GLM, "fp8-static", "per-head", True, "2026-11-30",
        "benchmarks/results/gpu_vllm_bench_fp8-w8a8.json, gpu_vllm_kv_scales.json",
        "CutlassFP8ScaledMM; the per-head KV scales reach the attention kernel"),
    # the `mixed` method's checkpoint (W4A16 and W8A16 config groups), same shapes: RTN-based (14 of 160 groups in
    # 8 bits), and AWQ-based as `quantize fix awq-w4a16` built it (16 of 160), each in a run of its own
    Run("vllm", "0.24.0", _GLM, "w4a16+w8a16", "none", True, "2026-12-03",
        "benchmarks/results/gpu_mixed_serve.json, gpu_mixed_bench_rtn-mixed-4.5.vllm.log; gpu_mixed_fixstage.json, "
        "gpu_mixed_bench_awq-w4a16-mixed.vllm.log",
        "Machete kernels; tok/s at batch 1 / 16 / 64: RTN-based 199 / 2920 / 8708 (W4A16 203 / 2989 / 8896, W8A16 "
        "182 / 2697 / 7902); AWQ-based 200 / 2947 / 8667 (AWQ W4A16 200 / 2969 / 8762)"),
    # the GLM-4.5V / 4.6V layout (Glm4vMoe), 2026-12-01
    Run("vllm", "0.24.0", _GLM4V_MOE, "none", "none", True, "2026-12-01", _README_MOE),
    Run("vllm", "0.24.0", _GLM4V_MOE, "w4a16", "none", True, "2026-12-01", _README_MOE),
    Run("vllm", "0.24.0", _GLM4V_MOE, "fp8-dynamic", "per-head", True, "2026-12-01", _README_MOE,
        "VLLM_CUTLASS FP8 MoE backend"),
    Run("vllm", "0.24.0", _GLM4V_MOE, "fp8-static", "per-head", False, "2026-12-01", _README_MOE,
        "refused at load: AssertionError in CompressedTensorsW8A8Fp8MoEMethod (fused MoE FP8 takes per-tensor "
        "weights + per-tensor activations, per-channel weights + dynamic per-token activations, or block FP8)"),
    # the GLM-4.6V layout at real widths (2 text layers: 1 dense + 1 MoE of 128 experts top-8, 24-block vision),
    # built by our stages, served with CUDA graphs, bench + VQA through the vLLM engine, 2026-12-01
    Run("vllm", "0.24.0", _GLM4V_MOE, "none", "none", True, "2026-12-01", _GLM46V),
    Run("vllm", "0.24.0", _GLM4V_MOE, "w4a16", "none", True, "2026-12-01", _GLM46V,
        "Machete (dense) and Marlin (MoE) kernels; vision tower unquantized in vLLM"),
    Run("vllm", "0.24.0", _GLM4V_MOE, "fp8-static+dynamic-experts", "per-head", True, "2026-12-01", _GLM46V,
        "CutlassFP8ScaledMM (dense, static), VLLM_CUTLASS FP8 MoE (experts, dynamic); 8 KV scales per layer "
        "reach the attention; vision tower unquantized in vLLM"),
    # the GLM-4.1V layout (Glm4v, dense text tower), a small model trained on easy-VQA and its variants from our
    # stages, `vllm serve` eager and compiled with the engine's defect setting (pipeline/engines/vllm_defects.py):
    # all 100 VQA answers of each equal to the hf engine's, 2026-12-02
    Run("vllm", "0.24.0", _GLM4V, "none", "none", True, "2026-12-02", _GLM4V_VQA, _GLM4V_NOTE,
        _GLM4V_FLAGS),
    Run("vllm", "0.24.0", _GLM4V, "w4a16", "none", True, "2026-12-02", _GLM4V_VQA, _GLM4V_NOTE,
        _GLM4V_FLAGS),
    Run("vllm", "0.24.0", _GLM4V, "fp8-static", "per-head", True, "2026-12-02", _GLM4V_VQA, _GLM4V_NOTE,
        _GLM4V_FLAGS),
    # lmdeploy 0.18.0's PyTorch engine (TurboMind cannot run on that CUDA 13 image)
    Run("lmdeploy", "0.18.0", _GLM, "none", "none", True, "2026-11-30", "benchmarks/results/gpu_bench_glm4_9b_base.json",
        "after `quantize export --engine lmdeploy` (ChatGLM names)"),
    Run("lmdeploy", "0.18.0", _GLM, "w4a16", "none", True, "2026-11-30", "benchmarks/results/gpu_bench_glm4_9b_awq.json",
        "after `quantize export --engine lmdeploy` (AutoAWQ GEMM layout, ChatGLM names)"),
)


# What an engine cannot load at all, read off its own source rather than run (no run to try; the way out is said):
# - vLLM 0.24.0 (registry.py of its wheel) has no model for transformers' glm46v model type; it would fall back to
#   its generic Transformers backend, which no run covers and whose names verify does not check
#   (pipeline/checkpoints/serving_names.py: GLM-4.6V's layouts);
# - lmdeploy 0.18.0 (its wheel: pytorch/models/module_map.py; pytorch/configurations/glm4_1v.py takes model_type
#   glm4v only) has a model for Glm4vForConditionalGeneration (GLM-4.1V, GLM-4.6V-Flash) and none for
#   Glm4vMoeForConditionalGeneration (GLM-4.5V, GLM-4.6V) or Glm46VForConditionalGeneration.
_RESAVE_GLM46V = ("`quantize resave DIR --out NEW` writes it as Glm4vForConditionalGeneration (or, with a MoE text "
                  "model, Glm4vMoeForConditionalGeneration), the layout GLM-4.6V's releases carry: the same model")
CANNOT = {
    ("vllm", "Glm46VForConditionalGeneration"): (
        "vLLM 0.24 has no model of its own for Glm46VForConditionalGeneration (transformers' glm46v type; its registry has "
        "Glm4vForConditionalGeneration and Glm4vMoeForConditionalGeneration) and would load it through its generic "
        f"Transformers backend, which no run covers; {_RESAVE_GLM46V}"),
    ("lmdeploy", "Glm46VForConditionalGeneration"): (
        "lmdeploy 0.18 has no model for Glm46VForConditionalGeneration (its module map has "
        f"Glm4vForConditionalGeneration, for model_type glm4v only); {_RESAVE_GLM46V}, which lmdeploy has a model "
        "for when the text model is dense (no lmdeploy run of it recorded)"),
    ("lmdeploy", "Glm4vMoeForConditionalGeneration"): (
        "lmdeploy 0.18 has no model for Glm4vMoeForConditionalGeneration (GLM-4.5V, GLM-4.6V: its module map has "
        "GLM-4.1V's Glm4vForConditionalGeneration only); serve it with vLLM"),
}


def cannot(engine: str, config: dict) -> str | None:
    """Why `engine` cannot load this checkpoint at all (CANNOT), None when nothing says it cannot."""
    return CANNOT.get((engine, architecture(config)))


# ---------------------------------------------------------------- a checkpoint's key

def scheme(config: dict) -> str:
    """The checkpoint's quantization scheme, named as in the module docstring ('other: ...' if unknown)."""
    quant = config_json.quantization(config)
    if not quant:
        return "none"
    if quant.get("quant_method") == "awq":
        return "w4a16-autoawq"
    if quant.get("quant_method") != "compressed-tensors":
        return f"other: {quant.get('quant_method')}"
    fmt = quant.get("format")
    groups = [g for g in (quant.get("config_groups") or {}).values() if isinstance(g, dict)]
    if fmt == "pack-quantized":
        # a column order the engine must know of (GPTQ's activation ordering) is a key no AWQ/RTN run covers
        orders = sorted({str((g.get("weights") or {}).get("actorder")) for g in groups} - {"None"})
        # one config group per scheme (the `mixed` method): W4A16 and W8A16 groups are a key of their own
        bits = sorted({int((g.get("weights") or {}).get("num_bits") or 4) for g in groups}) or [4]
        return "+".join(f"w{b}a16" for b in bits) + "".join(f"-actorder-{order}" for order in orders)
    if fmt in ("float-quantized", "naive-quantized") and _weights_bits(groups) == 8:
        if any((g.get("weights") or {}).get("strategy") == "block" for g in groups):
            return "fp8-block"
        dynamic = {bool((g.get("input_activations") or {}).get("dynamic")) for g in groups}
        if dynamic == {True}:
            return "fp8-dynamic"
        if dynamic == {False}:
            return "fp8-static"
        return "fp8-static+dynamic-experts" if _experts_dynamic(groups) else "other: mixed FP8 groups"
    return f"other: compressed-tensors {fmt}"


def _weights_bits(groups: list[dict]) -> int | None:
    return next((int(g["weights"]["num_bits"]) for g in groups if (g.get("weights") or {}).get("num_bits")), None)


def _experts_dynamic(groups: list[dict]) -> bool:
    """Static "Linear" group + a dynamic group that targets only expert modules."""
    for group in groups:
        dynamic = bool((group.get("input_activations") or {}).get("dynamic"))
        targets = group.get("targets") or []
        if dynamic and not all("experts" in t for t in targets):
            return False
        if not dynamic and targets != ["Linear"]:
            return False
    return True


def kv_strategy(config: dict) -> str:
    kv = config_json.kv_cache_scheme(config) or {}
    return {"attn_head": "per-head", "tensor": "per-tensor"}.get(kv.get("strategy"), "none" if not kv else
                                                                  f"other: {kv.get('strategy')}")


def architecture(config: dict) -> str:
    return config_json.architecture_or(config, config.get("model_type") or "unknown")


def checkpoint_key(config: dict) -> tuple[str, str, str]:
    return architecture(config), scheme(config), kv_strategy(config)


def runs_for(engine: str, config: dict) -> list[Run]:
    key = checkpoint_key(config)
    return [run for run in SHOWN if run.engine == engine and (run.architecture, run.scheme, run.kv) == key]


# ---------------------------------------------------------------- what each engine does with it

def vllm_serve_command(kv_quantized: bool, dtype: str | None) -> str:
    """`vllm serve DIR` with what the checkpoint needs: its FP8 KV cache, served in bfloat16 (vLLM 0.24's FP8 attention
    writes bfloat16 only: a float16 model died at its first request; pipeline/engines/vllm_server.py: serving_dtype).
    `dtype`: the checkpoint's (config.json's)."""
    if not kv_quantized:
        return "vllm serve DIR"
    return "vllm serve DIR --kv-cache-dtype fp8" + (" --dtype bfloat16" if dtype == "float16" else "")


def _vllm_command(config: dict) -> str:
    return vllm_serve_command(kv_strategy(config) != "none", config_json.dtype(config))


# the serving engines SHOWN records runs of, each with the command that serves a checkpoint (DIR: its folder)
SERVE_COMMANDS = {
    "vllm": _vllm_command,
    "lmdeploy": lambda config: "quantize export DIR --engine lmdeploy, then lmdeploy serve api_server EXPORT "
                               "--backend pytorch",
}
# beside the command, how else to try a checkpoint no recorded run covers
TRY_ALSO = {"vllm": " (or benchmarks/gpu_glm46v_vllm.py for the GLM-4.6V layout)"}


def serve_command(engine: str, config: dict, run: Run | None = None) -> str:
    """The command that serves the checkpoint on `engine`: the one `run` (a recorded run) served it with."""
    command = SERVE_COMMANDS[engine](config)
    return f"{command} {run.flags}" if run is not None and run.flags else command


def _engine_entry(engine: str, config: dict) -> dict:
    arch, kind, kv = checkpoint_key(config)
    runs = runs_for(engine, config)
    served = [r for r in runs if r.served]
    if served:
        run = served[-1]
        return {"serves": True, "status": "shown", "version": run.version, "date": run.date,
                "evidence": run.evidence, "command": serve_command(engine, config, run),
                "how": f"shown on the GPU machine ({engine} {run.version}, {run.date})" + (f": {run.note}" if run.note
                                                                                            else "")}
    if runs:
        run = runs[-1]
        return {"serves": False, "status": "refused", "version": run.version, "date": run.date,
                "evidence": run.evidence, "how": f"{engine} {run.version} {run.note or 'refused it'}"}
    if why := cannot(engine, config):  # known from the engine's source: no command to try
        return {"serves": False, "status": "cannot", "how": why}
    command = serve_command(engine, config)
    return {"serves": False, "status": "not shown", "command": command,
            "how": f"not shown: no {engine} run of {arch} with {kind}, KV {kv} was recorded; try: "
                   f"{command}{TRY_ALSO.get(engine, '')}"}


def support_from_config(config: dict) -> dict[str, dict]:
    """{engine: {"serves": bool, "status": shown | refused | cannot | not shown, "how": str, ...}} for hf, vllm, lmdeploy;
    `command`: the command a recorded run served it with (shown), or the one to try (not shown)."""
    kind, kv = scheme(config), kv_strategy(config)
    precision = in_process_precision(kind)  # the model card says it too (pipeline/report/card_evaluation.py)
    result = {"hf": {"serves": True, "status": "in-process", "precision": precision,
                     "how": f"in-process transformers; {precision}: right for accuracy, not a serving speed"}}
    for engine in SERVE_COMMANDS:
        result[engine] = _engine_entry(engine, config)
    # known from lmdeploy's loader: no run to try (an architecture it has no model for says so first)
    if kind.startswith("fp8") and result["lmdeploy"]["status"] not in ("shown", "cannot"):
        why = ("its FP8 KV cache takes one scale per tensor, where this variant has one per KV head"
               if kv == "per-head" else "it reads compressed-tensors checkpoints as int4 weights only")
        # a GLM checkpoint reaches lmdeploy through `quantize export`, in ChatGLM's names (pipeline/checkpoints/export.py)
        glm = architecture(config) in GLM_EXPORTED
        split = (", and its ChatGLM loader splits every query_key_value tensor, so a fused QKV's static input scale "
                 "does not load") if glm else ""
        result["lmdeploy"] = {"serves": False, "status": "cannot",
                              "how": f"lmdeploy 0.18 cannot serve FP8 W8A8: {why}{split}; serve it with vLLM"}
    return result


# the architectures `quantize export --engine lmdeploy` writes in ChatGLM's names
GLM_EXPORTED = ("GlmForCausalLM", "ChatGLMModel", "ChatGLMForConditionalGeneration")


def in_process_precision(kind: str) -> str:
    """What an in-process engine (transformers, with compressed-tensors) does with a checkpoint of scheme `kind` at
    load (pipeline/checkpoints/loading.py): its weights decompressed to the exact values they hold, an FP8 variant's
    activations and KV cache fake-quantized with their calibrated scales in every forward."""
    if kind == "none":
        return "unquantized weights, as stored"
    if kind.startswith("fp8"):
        return ("FP8 weights decompressed at load to the values they hold; activations and KV cache fake-quantized to "
                "FP8 with their scales in every forward")
    if kind.startswith("w"):
        stored = "int4 and int8 weights" if "w8a16" in kind else "int4 weights"  # `mixed`: one group per scheme
        return f"{stored} decompressed at load to the values they hold"
    return "decompressed at load"


def serving_support(model_dir: Path | str) -> dict[str, dict]:
    return support_from_config(checkpoint.open(model_dir).config)
