"""`quantize rtn`: round-to-nearest W4A16, group-wise int4 weights with no AWQ smoothing.

The contrast the AWQ paper draws (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization"):
the same quantizer AWQ ends with (llm-compressor's QuantizationModifier, per-group min/max scales,
weights rounded to the nearest grid point) applied to the unsmoothed weights. Same plan, save and
verification as every other method (oneshot.py); no calibration data shapes the weights.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints import inspect
from pipeline.quantize import compat, oneshot, plan


def recipe(group_size: int, symmetric: bool) -> list:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size,
               "symmetric": symmetric, "dynamic": False}
    return [QuantizationModifier(config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
                                 ignore=plan.ignore_patterns())]


def run(model_dir: Path, out: Path, calib: Path, *, group_size: int | str = "auto", symmetric: bool = False,
        seq_len: int = 256, num_blocks: int = 32, holdout: int = 32, batch_size: int = 32,
        placement: str = "auto", plan_only: bool = False) -> oneshot.QuantResult | oneshot.Plan:
    """plan_only: print what the run needs and how long it should take, write nothing (oneshot.run)."""
    compat.quiet_cpu_warning()
    config = inspect.check_config(model_dir)  # every check below runs before any weight is loaded
    arch = plan.check_architecture(config, model_dir)
    inspect.check(model_dir)  # the weights cover config.json: read from the headers, nothing loaded
    group = plan.choose_group_size(config, group_size, model_dir)
    scheme = f"W4A16 {'symmetric' if symmetric else 'asymmetric'}, group {group}, round-to-nearest"
    return oneshot.run(
        method="rtn", scheme=scheme, recipe=recipe(group, symmetric), model_dir=model_dir, out=out, calib=calib,
        seq_len=seq_len, num_blocks=num_blocks, holdout=holdout, batch_size=batch_size,
        details={"architecture": arch, "group_size": group, "symmetric": symmetric},
        placement=placement, plan_only=plan_only,
    )
