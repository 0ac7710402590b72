"""GPTQ W4A16 (Frantar et al. 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): each Linear's weights quantized column by column, the rounding error of each column spread over the
columns not yet quantized through the inverse Hessian of the layer's inputs (X^T X from the calibration tokens).

llm-compressor's GPTQModifier (0.14: llmcompressor/modifiers/gptq/base.py) on the same group-wise int4 weights as
AWQ and RTN (int4.py), so the three differ only by how the int4 values are chosen. Activation ordering
(`actorder`, compressed-tensors' ActivationOrdering): `weight` (llm-compressor's default, alias `static`) quantizes
the columns in order of their Hessian diagonal and puts them back, so the groups stay in place and the checkpoint
holds W4A16's own tensors (config.json says `actorder: weight`); `none` quantizes left to right. llm-compressor
0.14 refuses `group` (alias `dynamic`, deprecated by compressed-tensors) for GPTQ
(gptq/helpers.py, apply_activation_ordering), so it is not offered."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

import pipeline.methods.int4 as int4  # not `from pipeline.methods import`: the registry imports this module
from pipeline.methods.recipe import BatchSize, Recipe, Target
from pipeline.section import Section

NAME = "gptq"
SUMMARY = "GPTQ W4A16: group-wise int4 weights with error feedback through each layer's Hessian; lm_head and vision " \
          "tower untouched."
DEFAULT_VARIANT = "gptq-w4a16"
NEEDS_CALIBRATION = True  # the Hessians come from the calibration tokens
CALIBRATION_STATE = "hessians"  # per layer: one float32 in x in matrix per quantized Linear (quantize/plan.py)
SERVING_FORMAT = "compressed-tensors pack-quantized (W4A16), with the activation order in config.json"
CARD_TAGS = ("gptq", "w4a16", "int4")  # the model card's tags for its scheme (pipeline/report/model_card.py)
WEIGHT_BITS = 4  # bits per quantized weight (int4 weights), before scales: the server plan sizes an unbuilt checkpoint by it
CARD_WEIGHTS = int4.CARD_WEIGHTS
COMPARED_WITH = {"awq": "the two calibrated W4A16 methods a W4A16 checkpoint is chosen between",
                 "rtn": "the GPTQ paper's baseline: the same int4 quantizer without error feedback"}


class Params(Section):
    """`variants.<name>` with `method: gptq`."""

    method: Literal["gptq"]
    group_size: int4.GroupSize = "auto"
    symmetric: int4.Symmetric = False
    actorder: Literal["weight", "none"] = Field(
        "weight", description="Activation ordering: weight (columns quantized in order of their Hessian diagonal, "
                              "groups kept in place; llm-compressor's default) or none (left to right)")
    dampening_frac: float = Field(0.01, gt=0, le=1, description="Added to the Hessian's diagonal, as a fraction of its "
                                  "mean, before it is inverted (llm-compressor's default 0.01; raise it when a layer "
                                  "falls back to round-to-nearest)")
    block_size: int = Field(128, ge=1, le=4096, description="Columns quantized per block of the error update "
                            "(llm-compressor's default 128; memory, not the result)")
    batch_size: BatchSize = 32


def card_words(record: dict) -> str:
    """What it changes, in a model card's words, from its quant.json record."""
    return f"{int4.card_words(record)}, by GPTQ (each rounding error fed back through its layer's Hessian)"


def recipe(settings: Params, target: Target, eight_bit_targets: tuple[str, ...] = ()) -> Recipe:
    """llm-compressor's GPTQModifier with W4A16 on every Linear outside the ignore list; a group size that does not
    fit is refused before any weight loads."""
    from llmcompressor.modifiers.gptq import GPTQModifier

    group = int4.choose_group_size(target.config, settings.group_size, target.model_dir)
    actorder = None if settings.actorder == "none" else settings.actorder
    modifiers = [GPTQModifier(config_groups=int4.config_groups(group, settings.symmetric, eight_bit_targets),
                              ignore=list(target.ignore), actorder=actorder, dampening_frac=settings.dampening_frac,
                              block_size=settings.block_size)]
    return Recipe(modifiers, int4.scheme(group, settings.symmetric) + f", GPTQ (actorder {settings.actorder})",
                  {"group_size": group, "symmetric": settings.symmetric, "actorder": settings.actorder,
                   "dampening_frac": settings.dampening_frac, "block_size": settings.block_size})
