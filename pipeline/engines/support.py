"""Which serving engines can serve a checkpoint, and why not: read off its config.json alone.

Recorded in every variant's quant.json (`serving`), shown in the report and used by `quantize
export` for its refusals, so the three always say the same thing. What "can serve" means here is
what was shown on the GPU machine (README: vLLM and lmdeploy sections), not what an engine's
documentation promises:

- vLLM serves the base, AWQ W4A16 and RTN W4A16 (compressed-tensors pack-quantized: Machete/Marlin
  kernels) and FP8 W8A8 with per-head FP8 KV scales (`--kv-cache-dtype fp8`; the scales reach the
  attention kernel per head: benchmarks/gpu_vllm.py `kv-scales`).
- lmdeploy 0.18's PyTorch engine serves the base and W4A16 variants after `quantize export --engine
  lmdeploy` (AutoAWQ GEMM layout; `Glm` renamed to ChatGLM). It cannot serve FP8 variants: its FP8
  KV cache takes one scale per tensor, and its ChatGLM loader splits every query_key_value tensor,
  so a fused QKV's static input scale does not load.
- hf (transformers, in-process) loads everything, dequantizing W4A16 and fake-quantizing FP8: right
  for accuracy, meaningless for speed.
"""

from __future__ import annotations

import json
from pathlib import Path

VLLM_ARCHITECTURES = {"LlamaForCausalLM", "GlmForCausalLM", "Glm4ForCausalLM", "Glm4vForConditionalGeneration",
                      "Glm4vMoeForConditionalGeneration", "Glm4MoeForCausalLM", "Qwen2ForCausalLM",
                      "Qwen3ForCausalLM", "MistralForCausalLM", "ChatGLMModel", "ChatGLMForConditionalGeneration"}
LMDEPLOY_NATIVE = {"LlamaForCausalLM", "Glm4ForCausalLM", "Glm4vForConditionalGeneration",
                   "ChatGLMForConditionalGeneration", "ChatGLMModel", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
LMDEPLOY_EXPORTABLE = {"GlmForCausalLM"}  # renamed to ChatGLM by `quantize export --engine lmdeploy`


def scheme(config: dict) -> str:
    """'none', 'w4a16', 'fp8' or 'other: ...' for a config.json's quantization_config."""
    quant = config.get("quantization_config") or {}
    if not quant:
        return "none"
    if quant.get("quant_method") == "awq":
        return "w4a16-autoawq"
    if quant.get("quant_method") != "compressed-tensors":
        return f"other: {quant.get('quant_method')}"
    fmt = quant.get("format")
    if fmt == "pack-quantized":
        return "w4a16"
    if fmt in ("float-quantized", "naive-quantized") and _weights_bits(quant) == 8:
        return "fp8"
    return f"other: compressed-tensors {fmt}"


def _weights_bits(quant: dict) -> int | None:
    for group in (quant.get("config_groups") or {}).values():
        weights = group.get("weights") or {}
        if weights.get("num_bits"):
            return int(weights["num_bits"])
    return None


def kv_strategy(config: dict) -> str | None:
    kv = (config.get("quantization_config") or {}).get("kv_cache_scheme") or {}
    return kv.get("strategy")


def support_from_config(config: dict) -> dict[str, dict]:
    """{engine: {"serves": bool, "how": str}} for hf, vllm and lmdeploy."""
    arch = (config.get("architectures") or [config.get("model_type") or "unknown"])[0]
    kind, kv = scheme(config), kv_strategy(config)
    result = {"hf": {"serves": True, "how": "in-process transformers; W4A16 dequantized and FP8 fake-quantized at "
                                            "load: right for accuracy, not a serving speed"}}
    if arch not in VLLM_ARCHITECTURES:
        result["vllm"] = {"serves": False, "how": f"{arch} was not served by vLLM here; try `vllm serve DIR`"}
    elif kind == "fp8":
        per = "per-head" if kv == "attn_head" else "per-tensor" if kv == "tensor" else None
        how = "vllm serve DIR" + (f" --kv-cache-dtype fp8 (its {per} FP8 KV scales; engine.kv_cache_dtype: "
                                  "checkpoint does this)" if per else "")
        result["vllm"] = {"serves": True, "how": how}
    elif kind in ("none", "w4a16", "w4a16-autoawq"):
        result["vllm"] = {"serves": True, "how": "vllm serve DIR" + (" (W4A16: Machete / Marlin kernels)"
                                                                      if kind.startswith("w4a16") else "")}
    else:
        result["vllm"] = {"serves": False, "how": f"quantization {kind} was not served by vLLM here"}
    if kind == "fp8":
        why = ("its FP8 KV cache takes one scale per tensor, where this variant has one per KV head"
               if kv == "attn_head" else "it reads compressed-tensors checkpoints as int4 weights only")
        result["lmdeploy"] = {"serves": False,
                              "how": f"lmdeploy 0.18 cannot serve FP8 W8A8: {why}, and its ChatGLM loader splits "
                                     "every query_key_value tensor, so a fused QKV's static input scale does not "
                                     "load; serve it with vLLM"}
    elif kind == "w4a16" and (arch in LMDEPLOY_NATIVE or arch in LMDEPLOY_EXPORTABLE):
        result["lmdeploy"] = {"serves": True, "how": "after `quantize export --engine lmdeploy` (AutoAWQ GEMM layout"
                                                     + (", ChatGLM names" if arch in LMDEPLOY_EXPORTABLE else "") + ")"}
    elif kind in ("none", "w4a16-autoawq") and arch in LMDEPLOY_NATIVE:
        result["lmdeploy"] = {"serves": True, "how": "as it is"}
    elif kind == "none" and arch in LMDEPLOY_EXPORTABLE:
        result["lmdeploy"] = {"serves": True, "how": "after `quantize export --engine lmdeploy` (ChatGLM names)"}
    else:
        result["lmdeploy"] = {"serves": False, "how": f"{arch} with quantization {kind} has no lmdeploy path here"}
    return result


def serving_support(model_dir: Path | str) -> dict[str, dict]:
    return support_from_config(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")))
