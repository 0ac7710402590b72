"""Group-wise int4 weights (W4A16), the format AWQ, GPTQ and RTN write: compressed-tensors `pack-quantized`,
one scale (and, asymmetric, one zero point) per `group_size` consecutive input weights of a Linear.

The group-size rule, stated once: a group size is one of GROUP_SIZES and must divide every quantized Linear's
input width (checked from config.json before any weight loads: by params.yaml's validation against the base
checkpoint, pipeline/settings/checks.py, and by the quantize stage); `auto` takes the first of GROUP_SIZES that
does, 128 unless the model needs smaller (the demo's SmolLM2: 576 wide, so 64)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from pipeline.checkpoints import config_json
from pipeline.errors import UserError

GROUP_SIZES = (128, 64, 32, 16)  # in order of preference: `auto` takes the first that divides every width
ALLOWED = "auto, " + ", ".join(str(g) for g in sorted(GROUP_SIZES))


def _group_size(value):
    """`auto` or one of GROUP_SIZES; a whole number written as text (a CLI flag) counts as that number."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value in GROUP_SIZES):
        return value
    shown = repr(value) if isinstance(value, str) else value
    raise ValueError(f"{shown} is not one of {ALLOWED}")


GroupSize = Annotated[int | Literal["auto"], BeforeValidator(_group_size), Field(
    description=f"Weights per scale: {ALLOWED} (must divide every quantized layer's input width; auto: 128 "
                "unless the model needs smaller)")]
Symmetric = Annotated[bool, Field(description="Symmetric int4 (no zero point); false: asymmetric, a zero point "
                                              "per group", json_schema_extra={"flag": "--symmetric/--asymmetric"})]


def group_size_problem(config: dict, group_size: int, model_dir: Path | str) -> str | None:
    """Why `group_size` cannot quantize this model (a width it does not divide, and the size that would), else None."""
    widths = config_json.linear_input_widths(config)
    for what, width in widths.items():
        if width % group_size:
            fits = [g for g in GROUP_SIZES if all(w % g == 0 for w in widths.values())]
            hint = f"; use {fits[0]}" if fits else ""
            return f"{group_size} does not divide {width} ({what} of {model_dir}){hint}"
    return None


def choose_group_size(config: dict, requested: int | str, model_dir: Path | str) -> int:
    """128 unless the model needs smaller; an explicit size that does not fit is refused."""
    if requested == "auto":
        for size in GROUP_SIZES:
            if group_size_problem(config, size, model_dir) is None:
                return size
        widths = ", ".join(f"{k} {v}" for k, v in config_json.linear_input_widths(config).items())
        raise UserError(f"{model_dir}: no group size in {GROUP_SIZES} divides the layer widths ({widths})")
    problem = group_size_problem(config, int(requested), model_dir)
    if problem:
        raise UserError(f"group_size: {problem}")
    return int(requested)


def weights(group_size: int, symmetric: bool, **extra) -> dict:
    """compressed-tensors' weight arguments of W4A16 at this group size (extra: e.g. GPTQ's actorder)."""
    return {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size, "symmetric": symmetric,
            "dynamic": False, **extra}


def config_groups(group_size: int, symmetric: bool, eight_bit_targets: tuple[str, ...] = ()) -> dict:
    """llm-compressor's config_groups: W4A16 on every Linear (outside the modifier's ignore list) and, for
    `eight_bit_targets` (name or `re:` targets, which outrank the class target in compressed-tensors and vLLM),
    W8A16 at the same group size and symmetry (the `mixed` method, pipeline/methods/mixed.py)."""
    groups = {"group_0": {"targets": ["Linear"], "weights": weights(group_size, symmetric)}}
    if eight_bit_targets:
        groups["group_1"] = {"targets": list(eight_bit_targets), "weights": {**weights(group_size, symmetric),
                                                                             "num_bits": 8}}
    return groups


CARD_WEIGHTS = "int4 weights"  # what a W4A16 checkpoint stores, in a model card's words


def card_words(record: dict) -> str:
    """What W4A16 changes, from quant.json's record: "4-bit integer weights with one scale and zero point per group of
    64 weights, activations in 16 bits"."""
    zero = "" if record.get("symmetric") else " and zero point"
    return (f"4-bit integer weights with one scale{zero} per group of {record.get('group_size')} weights, activations "
            "in 16 bits")


def scheme(group_size: int, symmetric: bool) -> str:
    return f"W4A16 {'symmetric' if symmetric else 'asymmetric'}, group {group_size}"
