"""`quantize fp8`: FP8 W8A8 (static or dynamic activations) with an FP8 KV cache."""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints import inspect
from pipeline.params import Fp8Params, with_overrides
from pipeline.quantize import compat, oneshot, plan

KV_STRATEGY = {"per-head": "attn_head", "per-tensor": "tensor", "none": None}


def recipe(activations: str, kv: str) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    fp8 = {"num_bits": 8, "type": "float", "symmetric": True}
    weights = {**fp8, "strategy": "channel", "dynamic": False}
    if activations == "static":
        inputs = {**fp8, "strategy": "tensor", "dynamic": False, "observer": "static_minmax"}
    else:
        inputs = {**fp8, "strategy": "token", "dynamic": True}
    kv_scheme = None
    if KV_STRATEGY[kv]:
        kv_scheme = {**fp8, "strategy": KV_STRATEGY[kv], "dynamic": False}
    return [
        QuantizationModifier(
            config_groups={"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs}},
            kv_cache_scheme=kv_scheme,
            ignore=plan.ignore_patterns(),
        )
    ]


def run(model_dir: Path, out: Path, calib: Path, settings: Fp8Params | None = None, *, placement: str = "auto",
        plan_only: bool = False, calibrate_all_experts: bool = True, **overrides) -> oneshot.QuantResult | oneshot.Plan:
    """settings: the variant's params section (defaults in params.py); `overrides` replace fields and are
    validated again. plan_only: print what the run needs and how long it should take, write nothing."""
    s = with_overrides(settings or Fp8Params(method="fp8"), **overrides)
    compat.quiet_cpu_warning()
    config = inspect.check_config(model_dir)  # every check below runs before any weight is loaded
    arch = plan.check_architecture(config, model_dir)
    inspect.check(model_dir)  # the weights cover config.json: read from the headers, nothing loaded
    scheme = (f"FP8 W8A8 ({s.activations} activations), "
              f"KV cache {'FP8 ' + s.kv if s.kv != 'none' else 'unquantized'}")
    return oneshot.run(
        method="fp8", scheme=scheme, recipe=recipe(s.activations, s.kv), model_dir=model_dir, out=out,
        calib=calib, batch_size=s.batch_size,
        details={"architecture": arch, "activations": s.activations, "kv_cache": s.kv},
        placement=placement, plan_only=plan_only, calibrate_all_experts=calibrate_all_experts,
    )
