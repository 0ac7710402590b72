"""`quantize fp8`: FP8 W8A8 (static or dynamic activations) with an FP8 KV cache."""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints import inspect
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


def run(model_dir: Path, out: Path, calib: Path, *, activations: str = "static", kv: str = "per-head",
        seq_len: int = 256, num_blocks: int = 32, holdout: int = 32, batch_size: int = 32,
        placement: str = "auto", plan_only: bool = False,
        calibrate_all_experts: bool = True) -> oneshot.QuantResult | oneshot.Plan:
    """plan_only: print what the run needs and how long it should take, write nothing (oneshot.run)."""
    compat.quiet_cpu_warning()
    config = inspect.check_config(model_dir)  # every check below runs before any weight is loaded
    arch = plan.check_architecture(config, model_dir)
    inspect.check(model_dir)  # the weights cover config.json: read from the headers, nothing loaded
    scheme = f"FP8 W8A8 ({activations} activations), KV cache {'FP8 ' + kv if kv != 'none' else 'unquantized'}"
    return oneshot.run(
        method="fp8", scheme=scheme, recipe=recipe(activations, kv), model_dir=model_dir, out=out,
        calib=calib, seq_len=seq_len, num_blocks=num_blocks, holdout=holdout, batch_size=batch_size,
        details={"architecture": arch, "activations": activations, "kv_cache": kv},
        placement=placement, plan_only=plan_only, calibrate_all_experts=calibrate_all_experts,
    )
