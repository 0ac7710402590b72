"""FP8 W8A8 (static or dynamic activations) with an FP8 KV cache (per KV head by default).

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

from typing import Literal

from pydantic import Field

from pipeline.methods.recipe import BatchSize, Recipe, Target
from pipeline.section import Section

NAME = "fp8"
SUMMARY = "FP8 W8A8 with FP8 KV-cache scales; lm_head and vision tower untouched."
DEFAULT_VARIANT = "fp8-w8a8"
NEEDS_CALIBRATION = True  # static activation scales and the KV-cache scales come from the calibration tokens
CALIBRATION_STATE = "none"
SERVING_FORMAT = "compressed-tensors float-quantized (FP8 W8A8, FP8 KV-cache scales)"
CARD_TAGS = ("fp8", "w8a8")  # the model card's tags for its scheme (pipeline/report/model_card.py)
WEIGHT_BITS = 8  # bits per quantized weight (FP8 weights), before scales: the server plan sizes an unbuilt checkpoint by it
CARD_WEIGHTS = "FP8 weights"  # what its checkpoint stores, in a model card's words
COMPARED_WITH: dict[str, str] = {}


class Params(Section):
    """`variants.<name>` with `method: fp8`."""

    method: Literal["fp8"]
    activations: Literal["static", "dynamic"] = Field("static", description="static (one calibrated scale per "
                                                      "tensor) or dynamic (per token, at run time)")
    kv: Literal["per-head", "per-tensor", "none"] = Field("per-head", description="FP8 KV-cache scales: per-head, "
                                                           "per-tensor, or none (KV cache unquantized)")
    batch_size: BatchSize = 32  # scales only


def card_words(record: dict) -> str:
    """What it changes, in a model card's words, from its quant.json record (its activations, KV cache, experts)."""
    activations = {"static": "FP8 activations with one calibrated scale per tensor",
                   "dynamic": "FP8 activations scaled per token at run time"}.get(record.get("activations"))
    kv = {"per-head": "an FP8 KV cache with one calibrated scale per attention head",
          "per-tensor": "an FP8 KV cache with one calibrated scale per tensor",
          "none": "the KV cache unquantized"}.get(record.get("kv_cache"))
    experts = ", MoE experts with per-token activation scales" if record.get("expert_scheme") else ""
    return "FP8 weights with one scale per output channel" + "".join(f", {p}" for p in (activations, kv) if p) + experts


def recipe(settings: Params, target: Target) -> Recipe:
    """Every Linear outside the ignore list at `activations`; a MoE's experts with dynamic activations."""
    from llmcompressor.modifiers.quantization import QuantizationModifier

    modifiers = [QuantizationModifier(config_groups=config_groups(settings.activations, target.moe),
                                      kv_cache_scheme=kv_cache_scheme(settings.kv), ignore=list(target.ignore))]
    details = {"activations": settings.activations, "kv_cache": settings.kv}
    if target.moe:
        details["expert_scheme"] = {"activations": "dynamic", "weights": "per-channel", "why": EXPERT_SCHEME_WHY}
    # dynamic expert scales come from each token at serving time: an expert calibration never routed to is sound
    return Recipe(modifiers, scheme_name(settings.activations, settings.kv, target.moe), details,
                  experts_need_tokens=not target.moe)


KV_STRATEGY = {"per-head": "attn_head", "per-tensor": "tensor", "none": None}
# MoE expert Linears (routed experts once linearized, and the shared expert), in compressed-tensors' target
# syntax: a regex target outranks the "Linear" class target, so experts take this group's scheme.
EXPERT_TARGETS = ["re:.*mlp\\.experts\\..*", "re:.*mlp\\.shared_experts\\..*"]
EXPERT_SCHEME_WHY = ("MoE experts (routed and shared): per-channel FP8 weights with dynamic per-token activations, "
                     "the FP8 scheme vLLM's fused MoE serves besides block and per-tensor FP8 (static per-tensor "
                     "activations with per-channel weights are refused at load), the one GLM's own FP8 releases "
                     "use (dynamic activations), and one that needs no calibration tokens per expert")


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
