"""`quantize fp8`: FP8 W8A8 (static or dynamic activations) with an FP8 KV cache.

MoE models get a second scheme for their experts (routed and shared): per-channel FP8 weights with
dynamic per-token FP8 activations, while attention and dense MLPs keep the section's `activations`.
Why, from evidence:
- vLLM's fused-MoE FP8 path takes per-tensor weights with per-tensor activations, per-channel
  weights with dynamic per-token activations, or block FP8; the default dense scheme (per-channel
  weights, static per-tensor activations) was refused at load on the H200 (`AssertionError` in
  `CompressedTensorsW8A8Fp8MoEMethod`, vLLM 0.24, README), the same report as
  vllm-project/llm-compressor#1393; per-channel + dynamic loaded and answered there.
- GLM's own FP8 releases quantize with dynamic activations (GLM-4.5-FP8: `activation_scheme:
  dynamic`; llm-compressor's GLM-4.6 example: FP8_BLOCK, whose activations are dynamic too).
- a static scale per expert is only as good as the tokens that expert was routed in calibration;
  dynamic scales need none, so no expert's scale is a guess.
- block FP8 (128 x 128) would need every expert width to divide by 128 (GLM-4.6V: 1408 does; small
  models do not) and buys nothing in accuracy over per-channel weights.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints import config_json, headers
from pipeline.params import Fp8Params, with_overrides
from pipeline.quantize import compat, plan, stage

KV_STRATEGY = {"per-head": "attn_head", "per-tensor": "tensor", "none": None}
# MoE expert Linears (routed experts once linearized, and the shared expert), in compressed-tensors' target
# syntax: a regex target outranks the "Linear" class target, so experts take this group's scheme.
EXPERT_TARGETS = ["re:.*mlp\\.experts\\..*", "re:.*mlp\\.shared_experts\\..*"]
EXPERT_SCHEME_WHY = ("MoE experts (routed and shared): per-channel FP8 weights with dynamic per-token activations, "
                     "the FP8 scheme vLLM's fused MoE serves besides block and per-tensor FP8 (static per-tensor "
                     "activations with per-channel weights are refused at load), the one GLM's own FP8 releases "
                     "use (dynamic activations), and one that needs no calibration tokens per expert")


def recipe(activations: str, kv: str, moe: bool = False) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    return [
        QuantizationModifier(
            config_groups=config_groups(activations, moe),
            kv_cache_scheme=kv_cache_scheme(kv),
            ignore=plan.ignore_patterns(),
        )
    ]


def _fp8() -> dict:
    return {"num_bits": 8, "type": "float", "symmetric": True}


def _inputs(activations: str) -> dict:
    if activations == "static":
        return {**_fp8(), "strategy": "tensor", "dynamic": False, "observer": "static_minmax"}
    return {**_fp8(), "strategy": "token", "dynamic": True}


def config_groups(activations: str, moe: bool) -> dict:
    """compressed-tensors config groups: every Linear at `activations`; a MoE's experts dynamic."""
    weights = {**_fp8(), "strategy": "channel", "dynamic": False}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": _inputs(activations)}}
    if moe and activations != "dynamic":
        groups["experts"] = {"targets": EXPERT_TARGETS, "weights": weights, "input_activations": _inputs("dynamic")}
    return groups


def kv_cache_scheme(kv: str) -> dict | None:
    return {**_fp8(), "strategy": KV_STRATEGY[kv], "dynamic": False} if KV_STRATEGY[kv] else None


def scheme_name(activations: str, kv: str, moe: bool) -> str:
    experts = ", MoE experts dynamic" if moe and activations != "dynamic" else ""
    return f"FP8 W8A8 ({activations} activations{experts}), KV cache {'FP8 ' + kv if kv != 'none' else 'unquantized'}"


def run(model_dir: Path, out: Path, calib: Path, settings: Fp8Params | None = None, *, placement: str = "auto",
        plan_only: bool = False, calibrate_all_experts: bool = True, **overrides) -> stage.QuantResult | stage.Plan:
    """settings: the variant's params section (defaults in params.py); `overrides` replace fields and are
    validated again. plan_only: print what the run needs and how long it should take, write nothing."""
    s = with_overrides(settings or Fp8Params(method="fp8"), **overrides)
    compat.quiet_cpu_warning()
    config = headers.check_config(model_dir)  # every check below runs before any weight is loaded
    arch = plan.check_architecture(config, model_dir)
    headers.check(model_dir)  # the weights cover config.json: read from the headers, nothing loaded
    moe = config_json.routed_experts(config) > 0
    details = {"architecture": arch, "activations": s.activations, "kv_cache": s.kv}
    if moe:
        details["expert_scheme"] = {"activations": "dynamic", "weights": "per-channel", "why": EXPERT_SCHEME_WHY}
    return stage.run(
        method="fp8", scheme=scheme_name(s.activations, s.kv, moe), recipe=recipe(s.activations, s.kv, moe),
        model_dir=model_dir, out=out, calib=calib, batch_size=s.batch_size, details=details,
        placement=placement, plan_only=plan_only, calibrate_all_experts=calibrate_all_experts,
        experts_need_data=not moe,  # dynamic expert scales come from each token at serving time
    )
