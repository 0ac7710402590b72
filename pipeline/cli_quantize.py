"""The quantize subcommands: awq, fp8, rtn and variant (one params.yaml variant, what `dvc repro` runs),
and what they share: the variant's settings with the flags over them, the calibration blocks (a raw
conversation file is prepared by the calib stage first), the stage's run. pipeline/cli.py registers
them on the `quantize` app, in the order `quantize --help` lists them."""

from __future__ import annotations

import contextlib
import logging
import tempfile
from pathlib import Path
from typing import Optional

import typer

from pipeline import params as params_mod
from pipeline.cli_common import PARAMS_OPTION, load_params, make_room_on_gpu, refuse_overlap, stage, working
from pipeline.errors import UserError
from pipeline.params import with_overrides

log = logging.getLogger("pipeline.cli")


def _whole(value: str, flag: str, expected: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{flag} {value}: use {expected}") from None


def _calibration_file(p: params_mod.Params, calib: Optional[Path]) -> Path:
    """--calib, else the calib stage's calib.jsonl when built, else params calib.source."""
    if calib is None:
        built = p.calib.out / "calib.jsonl"
        calib = built if built.exists() else p.calib.source
    return Path(calib)


@contextlib.contextmanager
def _calibration_blocks(p: params_mod.Params, calib: Optional[Path], model: Path):
    """The calib.jsonl a quantize stage calibrates on: --calib or the calib stage's output (else
    params calib.source); a raw conversation file is prepared by the calib stage into a temporary
    dir first, with params calib's settings (what `quantize awq --calib support_logs.jsonl` does)."""
    from pipeline.formats.calib_blocks import is_blocks_file

    calib = _calibration_file(p, calib)
    if calib.is_file() and is_blocks_file(calib):
        yield calib
        return
    from pipeline import calib as calib_stage

    with tempfile.TemporaryDirectory() as tmp:
        result = calib_stage.run(calib, Path(tmp) / "build", model, p.calib)
        log.info(result.summary())
        yield Path(tmp) / "build" / "calib.jsonl"


def _quantize(method: str, params_file: Path, variant: Optional[str], flags: dict, model: Optional[Path],
              out: Optional[Path], calib: Optional[Path], placement: str, plan: bool) -> None:
    """What awq, fp8, rtn and variant share: the variant's params section with the flags over it
    (validated again), the paths' defaults, the overlap check, calibration blocks, the stage's run."""
    from pipeline.quantize import require_llmcompressor

    p = load_params(params_file)
    variant, settings = _variant_settings(p, variant, method)
    section = {"awq": params_mod.AwqParams, "fp8": params_mod.Fp8Params, "rtn": params_mod.RtnParams}[method]
    settings = with_overrides(settings or section(method=method), **flags)
    require_llmcompressor()
    from pipeline.quantize import awq as awq_stage, fp8 as fp8_stage, rtn as rtn_stage

    stage_module = {"awq": awq_stage, "fp8": fp8_stage, "rtn": rtn_stage}[method]
    model, out = model or p.model.base_dir, out or Path("models") / (variant or f"{method}-{DEFAULT_SCHEME[method]}")
    refuse_overlap(out, replaces="quantize", base_checkpoint=model, calibration_file=_calibration_file(p, calib))
    if not plan:
        make_room_on_gpu(p, f"quantize {method}", [model], factor=2.5)
    with _calibration_blocks(p, calib, model) as blocks:
        with working():
            result = stage_module.run(model, out, blocks, settings, placement=placement, plan_only=plan)
    typer.echo(result.summary())


DEFAULT_SCHEME = {"awq": "w4a16", "fp8": "w8a8", "rtn": "w4a16"}  # out dir without a named variant: models/awq-w4a16


def _variant_settings(p: params_mod.Params, variant: Optional[str], method: str):
    if variant is None:
        matching = [n for n, v in p.variants.items() if v.method == method]
        variant = matching[0] if matching else None
    settings = p.variant(variant) if variant else None
    if settings is not None and settings.method != method:
        raise UserError(f"params.yaml: variants.{variant} is an {settings.method} variant, not {method}")
    return variant, settings


# the options awq, fp8 and rtn share
MODEL_OPTION = typer.Option(None, help="Base checkpoint (default: params model.base_dir)")
OUT_OPTION = typer.Option(None, help="Output dir (default: models/<variant>)")
PLAN_OPTION = typer.Option(False, "--plan", help="Print the layers, the device and host memory the run needs and its "
                           "expected time (a one-layer probe on this machine), then stop: nothing is written.")
PLACEMENT_OPTION = typer.Option("auto", help="auto (whole model on the accelerator when it fits), device, or offload "
                                "(on the host, one decoder layer at a time on the accelerator)")


@stage
def awq(
    model: Optional[Path] = MODEL_OPTION,
    calib: Optional[Path] = typer.Option(None, help="Calibration: conversations file, or calib.jsonl built by `quantize calib` (default: params calib.out/calib.jsonl, else calib.source)"),
    out: Optional[Path] = OUT_OPTION,
    group_size: Optional[str] = typer.Option(None, help="Weights per scale: auto, 16, 32, 64, 128 (must divide every layer's input width) (default: params)"),
    symmetric: Optional[bool] = typer.Option(None, "--symmetric/--asymmetric", help="Symmetric int4 (no zero point) (default: params, asymmetric)"),
    variant: Optional[str] = typer.Option(None, help="Variant name in params.yaml whose settings to use (default: the first awq variant)"),
    plan: bool = PLAN_OPTION,
    placement: str = PLACEMENT_OPTION,
    params_file: Path = PARAMS_OPTION,
):
    """AWQ smoothing, then W4A16 group-wise int4 weights; lm_head and vision tower untouched."""
    size = group_size if group_size in (None, "auto") else _whole(group_size, "--group-size", "auto or a power of two such as 64 or 128")
    _quantize("awq", params_file, variant, dict(group_size=size, symmetric=symmetric), model, out, calib, placement, plan)


@stage
def fp8(
    model: Optional[Path] = MODEL_OPTION,
    calib: Optional[Path] = typer.Option(None, help="Calibration file (as for awq) (default: params)"),
    out: Optional[Path] = OUT_OPTION,
    activations: Optional[str] = typer.Option(None, help="static (calibrated scale) or dynamic (per token) (default: params)"),
    kv: Optional[str] = typer.Option(None, help="FP8 KV cache scales: per-head, per-tensor or none (default: params, per-head)"),
    variant: Optional[str] = typer.Option(None, help="Variant name in params.yaml (default: the first fp8 variant)"),
    plan: bool = PLAN_OPTION,
    placement: str = PLACEMENT_OPTION,
    params_file: Path = PARAMS_OPTION,
):
    """FP8 W8A8 with FP8 KV-cache scales; lm_head and vision tower untouched."""
    _quantize("fp8", params_file, variant, dict(activations=activations, kv=kv), model, out, calib, placement, plan)


@stage
def rtn(
    model: Optional[Path] = MODEL_OPTION,
    calib: Optional[Path] = typer.Option(None, help="Calibration file (as for awq; RTN's weights do not depend on it) (default: params)"),
    out: Optional[Path] = OUT_OPTION,
    group_size: Optional[str] = typer.Option(None, help="Weights per scale: auto, 16, 32, 64, 128 (default: params)"),
    symmetric: Optional[bool] = typer.Option(None, "--symmetric/--asymmetric", help="Symmetric int4 (default: params, asymmetric)"),
    variant: Optional[str] = typer.Option(None, help="Variant name in params.yaml (default: the first rtn variant)"),
    plan: bool = PLAN_OPTION,
    placement: str = PLACEMENT_OPTION,
    params_file: Path = PARAMS_OPTION,
):
    """Round-to-nearest W4A16 (AWQ's quantizer without its smoothing): the baseline AWQ is measured against."""
    size = group_size if group_size in (None, "auto") else _whole(group_size, "--group-size", "auto or a power of two such as 64 or 128")
    _quantize("rtn", params_file, variant, dict(group_size=size, symmetric=symmetric), model, out, calib, placement, plan)


@stage
def build_variant(
    name: str = typer.Argument(..., help="Variant name from params.yaml (its method picks awq, fp8 or rtn)"),
    params_file: Path = PARAMS_OPTION,
):
    """Build one variant exactly as params.yaml describes it (what `dvc repro` runs)."""
    p = load_params(params_file)
    _quantize(p.variant(name).method, params_file, name, {}, None, None, None, "auto", False)
