"""`quantize awq`: AWQ smoothing, then W4A16 group-wise weight quantization."""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints import headers
from pipeline.errors import UserError
from pipeline.params import AwqParams, with_overrides
from pipeline.quantize import compat, plan, stage
from pipeline.quantize.mappings import mappings_for, supported_architectures


SEARCHES = ("gram", "forward")


def recipe(group_size: int, symmetric: bool, mappings, n_grid: int = 20, search: str = "gram") -> list:
    """search: "gram" scores single-Linear mappings from X^T X (awq_gram.py: llm-compressor's
    objective, computed cheaper); "forward" is llm-compressor's AWQModifier unchanged."""
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    from pipeline.quantize.awq_gram import GramAWQModifier

    if n_grid < 3:  # with duo scaling llm-compressor spaces its candidates by 1 / (n_grid - 2)
        raise UserError(f"n_grid {n_grid}: AWQ needs at least 3 scale candidates")
    if search not in SEARCHES:
        raise UserError(f"AWQ search {search!r}: use one of {', '.join(SEARCHES)}")
    modifier = GramAWQModifier if search == "gram" else AWQModifier

    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size,
               "symmetric": symmetric, "dynamic": False}
    return [
        modifier(mappings=mappings, duo_scaling=True, n_grid=n_grid),
        QuantizationModifier(
            config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
            ignore=plan.ignore_patterns(),
        ),
    ]


def run(model_dir: Path, out: Path, calib: Path, settings: AwqParams | None = None, *, placement: str = "auto",
        plan_only: bool = False, calibrate_all_experts: bool = True, **overrides) -> stage.QuantResult | stage.Plan:
    """settings: the variant's params section (params.yaml `variants.<name>`, defaults in params.py);
    `overrides` (e.g. group_size=64) replace fields and are validated again. calib: a calib.jsonl of
    token blocks. plan_only: print what the run needs and how long it should take, write nothing."""
    s = with_overrides(settings or AwqParams(method="awq"), **overrides)
    compat.quiet_cpu_warning()
    config = headers.check_config(model_dir)  # every check below runs before any weight is loaded
    arch = plan.check_architecture(config, model_dir)
    mappings = mappings_for(arch, config)
    if mappings is None:
        raise UserError(
            f"{model_dir}: AWQ has no smoothing mappings for {arch}; supported: "
            + ", ".join(supported_architectures())
        )
    group = plan.choose_group_size(config, s.group_size, model_dir)
    headers.check(model_dir)  # the weights cover config.json: read from the headers, nothing loaded
    scheme = f"W4A16 {'symmetric' if s.symmetric else 'asymmetric'}, group {group}"
    return stage.run(
        method="awq", scheme=scheme, recipe=recipe(group, s.symmetric, mappings, s.n_grid, s.search),
        model_dir=model_dir, out=out, calib=calib, batch_size=s.batch_size,
        details={"architecture": arch, "group_size": group, "symmetric": s.symmetric, "n_grid": s.n_grid,
                 "search": s.search},
        placement=placement, plan_only=plan_only, calibrate_all_experts=calibrate_all_experts,
    )
