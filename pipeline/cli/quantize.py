"""The quantize subcommands: one per registered method (pipeline/methods/: `quantize awq`, `quantize fp8`, ...,
each with one flag per field of the method's params section, its help from the field's description) and
`variant` (one params.yaml variant, what `dvc repro` runs), and what they share: the variant's settings with
the flags over them, the calibration blocks (a raw conversation file is prepared by the calib stage first),
the stage's run. pipeline/cli/app.py registers them on the `quantize` app (`register`), in the order `quantize
--help` lists them."""

from __future__ import annotations

import contextlib
import inspect
import logging
import tempfile
import typing
from pathlib import Path
from typing import Optional

import typer

from pipeline import console, methods
from pipeline.settings import params as params_mod
from pipeline.cli.common import PARAMS_OPTION, load_params, make_room_on_gpu, refuse_overlap, stage, working
from pipeline.errors import UserError
from pipeline.settings.params import with_overrides

log = logging.getLogger("pipeline.cli.app")


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
    from pipeline.stages import calib as calib_stage

    with tempfile.TemporaryDirectory() as tmp:
        result = calib_stage.run(calib, Path(tmp) / "build", model, p.calib)
        log.info(result.summary())
        yield Path(tmp) / "build" / "calib.jsonl"


def _quantize(name: str, params_file: Path, variant: Optional[str], flags: dict, model: Optional[Path],
              out: Optional[Path], calib: Optional[Path], placement: str, plan: bool) -> None:
    """What every method's subcommand and `variant` share: the variant's params section with the flags over it
    (validated again), the paths' defaults, the overlap check, calibration blocks, the stage's run."""
    from pipeline.quantize import require_llmcompressor

    method = methods.method(name)
    p = load_params(params_file)
    variant, settings = _variant_settings(p, variant, method.NAME)
    settings = with_overrides(settings or method.Params, **({"method": method.NAME} if settings is None else {}),
                              **flags)
    require_llmcompressor()
    from pipeline.stages import quantize as quantize_stage

    model, out = model or p.model.base_dir, out or Path("models") / (variant or method.DEFAULT_VARIANT)
    refuse_overlap(out, replaces="quantize", base_checkpoint=model, calibration_file=_calibration_file(p, calib))
    if not plan:
        make_room_on_gpu(f"quantize {method.NAME}", [model], factor=2.5, last=p.model.base_dir)
    with _calibration_blocks(p, calib, model) as blocks:
        with working():
            result = quantize_stage.run(model, out, blocks, settings, placement=placement, plan_only=plan)
    console.summary(result.summary())


def _variant_settings(p: params_mod.Params, variant: Optional[str], method: str):
    if variant is None:
        matching = [n for n, v in p.variants.items() if v.method == method]
        variant = matching[0] if matching else None
    settings = p.variant(variant) if variant else None
    if settings is not None and settings.method != method:
        raise UserError(f"params.yaml: variants.{variant} is a {settings.method} variant, not {method}")
    return variant, settings


# the options every method's subcommand shares
MODEL_OPTION = typer.Option(None, help="Base checkpoint (default: params model.base_dir)")
OUT_OPTION = typer.Option(None, help="Output dir (default: models/<variant>)")
PLAN_OPTION = typer.Option(False, "--plan", help="Print the layers, the device and host memory the run needs and its "
                           "expected time (a one-layer probe on this machine), then stop: nothing is written.")
PLACEMENT_OPTION = typer.Option("auto", help="auto (whole model on the accelerator when it fits), device, or offload "
                                "(on the host, one decoder layer at a time on the accelerator)")
CALIB_HELP = ("Calibration: conversations file, or calib.jsonl built by `quantize calib` (default: params "
              "calib.out/calib.jsonl, else calib.source)")
SHARED = ("model", "calib", "out", "variant", "plan", "placement", "params_file")


def _flag(name: str, field) -> tuple[type, typer.models.OptionInfo]:
    """The CLI option for one field of a method's params section: its help is the field's description (with the
    choices of a Literal); every value but a bool is taken as text and validated by the section, like the file."""
    help_text = field.description or name.replace("_", " ")
    choices = [arg for arg in typing.get_args(field.annotation) if isinstance(arg, str)] or \
        [a for member in typing.get_args(field.annotation) for a in typing.get_args(member) if isinstance(a, str)]
    if field.annotation is bool:
        extra = field.json_schema_extra or {}
        flag = extra.get("flag") or f"--{name.replace('_', '-')}/--no-{name.replace('_', '-')}"
        return Optional[bool], typer.Option(None, flag,
                                            help=f"{help_text} (default: params, else {str(field.default).lower()})")
    if choices and "auto" not in choices and not any(choice in help_text for choice in choices):
        help_text += f": {', '.join(choices)}"
    return Optional[str], typer.Option(None, f"--{name.replace('_', '-')}",
                                       help=f"{help_text} (default: params, else {field.default})")


def method_command(method):
    """`quantize <method>`: the shared options and one flag per field of the method's params section."""
    calib_help = CALIB_HELP + ("" if method.NEEDS_CALIBRATION else f"; {method.NAME.upper()}'s weights do not depend on it")
    shared = [
        ("model", Optional[Path], MODEL_OPTION), ("calib", Optional[Path], typer.Option(None, help=calib_help)),
        ("out", Optional[Path], OUT_OPTION)]
    fields = [(name, *_flag(name, field)) for name, field in method.Params.model_fields.items() if name != "method"]
    tail = [("variant", Optional[str], typer.Option(None, help=f"Variant name in params.yaml whose settings to use "
                                                              f"(default: the first {method.NAME} variant)")),
            ("plan", bool, PLAN_OPTION), ("placement", str, PLACEMENT_OPTION), ("params_file", Path, PARAMS_OPTION)]

    def command(**options):
        flags = {name: value for name, value in options.items() if name not in SHARED}
        _quantize(method.NAME, options["params_file"], options["variant"], flags, options["model"], options["out"],
                  options["calib"], options["placement"], options["plan"])

    parameters = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)
                  for name, kind, default in shared + fields + tail]
    command.__signature__ = inspect.Signature(parameters)
    command.__annotations__ = {name: kind for name, kind, _ in shared + fields + tail}
    command.__doc__ = method.SUMMARY
    return stage(command)


@stage
def build_variant(
    name: str = typer.Argument(..., help=f"Variant name from params.yaml (its method picks {methods.names()})"),
    params_file: Path = PARAMS_OPTION,
):
    """Build one variant exactly as params.yaml describes it (what `dvc repro` runs)."""
    p = load_params(params_file)
    _quantize(p.variant(name).method, params_file, name, {}, None, None, None, "auto", False)


@stage
def fix(
    variant: str = typer.Argument(..., help="A W4A16 variant of params.yaml (method awq, gptq or rtn), built in "
                                            "models/<variant> and ranked (quantize kl models/<variant> --rank)"),
    params_file: Path = PARAMS_OPTION,
):
    """A NO-GO's fix: models/<variant>-mixed, the `mixed` method on the variant's own settings with the groups its
    ranking (results/<variant>/sensitivity.json, written by `quantize kl --rank`) says cost most kept in 8 bits
    within params fix.max_bits; evaluated and decided like any variant (dvc.yaml's fix stage)."""
    from pipeline.quantize import require_llmcompressor
    from pipeline.settings import fixes
    from pipeline.stages import fix as fix_stage
    from pipeline.stages import quantize as quantize_stage

    p = load_params(params_file)
    fixes.variant_settings(p, variant)  # a W4A16 variant of params.yaml, else refused before any work
    where = fix_stage.paths(variant)
    base, holdout = p.model.base_dir, p.calib.out / "holdout.jsonl"
    refuse_overlap(where["out"], replaces="quantize", calibration_file=_calibration_file(p, None),
                   base_checkpoint=base, variant_checkpoint=where["variant"], held_out_prompts=holdout,
                   ranking=where["ranking"])
    fix_stage.check_inputs(variant, base, holdout)
    require_llmcompressor()
    make_room_on_gpu("fix", [base], factor=2.5, last=base)  # as quantize: the base calibrated again, V's own way
    with _calibration_blocks(p, None, base) as blocks, working():
        result = fix_stage.run(variant, p, calib=blocks, build=quantize_stage.run, base_dir=base)
    console.summary(result.summary())


def register(app: typer.Typer) -> None:
    """One subcommand per registered method, then `variant` and `fix` (a W4A16 variant rebuilt as its fix)."""
    for method in methods.METHODS:
        app.command(method.NAME, help=method.SUMMARY)(method_command(method))
    app.command("variant")(build_variant)
    app.command("fix")(fix)
