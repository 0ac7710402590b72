"""`quantize rtn`: round-to-nearest W4A16, group-wise int4 weights with no AWQ smoothing.

The contrast the AWQ paper draws (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization"):
the same quantizer AWQ ends with (llm-compressor's QuantizationModifier, per-group min/max scales,
weights rounded to the nearest grid point) applied to the unsmoothed weights. Same plan, save and
verification as every other method (stage.py); no calibration data shapes the weights.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints import headers
from pipeline.params import RtnParams, with_overrides
from pipeline.quantize import compat, plan, stage


def recipe(group_size: int, symmetric: bool) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size,
               "symmetric": symmetric, "dynamic": False}
    return [QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                                 ignore=plan.ignore_patterns())]


def run(model_dir: Path, out: Path, calib: Path, settings: RtnParams | None = None, *, placement: str = "auto",
        plan_only: bool = False, **overrides) -> stage.QuantResult | stage.Plan:
    """settings: the variant's params section (defaults in params.py); `overrides` replace fields and are
    validated again. plan_only: print what the run needs and how long it should take, write nothing."""
    s = with_overrides(settings or RtnParams(method="rtn"), **overrides)
    compat.quiet_cpu_warning()
    config = headers.check_config(model_dir)  # every check below runs before any weight is loaded
    arch = plan.check_architecture(config, model_dir)
    headers.check(model_dir)  # the weights cover config.json: read from the headers, nothing loaded
    group = plan.choose_group_size(config, s.group_size, model_dir)
    scheme = f"W4A16 {'symmetric' if s.symmetric else 'asymmetric'}, group {group}, round-to-nearest"
    return stage.run(
        method="rtn", scheme=scheme, recipe=recipe(group, s.symmetric), model_dir=model_dir, out=out, calib=calib,
        batch_size=s.batch_size, details={"architecture": arch, "group_size": group, "symmetric": s.symmetric},
        placement=placement, plan_only=plan_only,
    )
