"""Round-to-nearest W4A16: group-wise int4 weights with no smoothing and no error feedback.

The baseline the AWQ paper (Lin et al. 2023) and the GPTQ paper (Frantar et al. 2022) compare against: the same
quantizer AWQ ends with (llm-compressor's QuantizationModifier, per-group min/max scales, weights rounded to the
nearest grid point) applied to the weights as they are. No calibration data shapes the weights (the stage still
reads the blocks for its per-layer check)."""

from __future__ import annotations

from typing import Literal

import pipeline.methods.int4 as int4  # not `from pipeline.methods import`: the registry imports this module
from pipeline.methods.recipe import BatchSize, Recipe, Target
from pipeline.section import Section

NAME = "rtn"
SUMMARY = ("Round-to-nearest W4A16 (the int4 quantizer alone: no smoothing, no error feedback): the baseline the other "
           "W4A16 methods are measured against.")
DEFAULT_VARIANT = "rtn-w4a16"
NEEDS_CALIBRATION = False
CALIBRATION_STATE = "none"
SERVING_FORMAT = "compressed-tensors pack-quantized (W4A16)"
CARD_TAGS = ("rtn", "w4a16", "int4")  # the model card's tags for its scheme (pipeline/report/model_card.py)
WEIGHT_BITS = 4  # bits per quantized weight (int4 weights), before scales: the server plan sizes an unbuilt checkpoint by it
CARD_WEIGHTS = int4.CARD_WEIGHTS
COMPARED_WITH: dict[str, str] = {}


class Params(Section):
    """`variants.<name>` with `method: rtn`."""

    method: Literal["rtn"]
    group_size: int4.GroupSize = "auto"
    symmetric: int4.Symmetric = False
    batch_size: BatchSize = 32  # the per-layer check's forward passes


def card_words(record: dict) -> str:
    """What it changes, in a model card's words, from its quant.json record."""
    return f"{int4.card_words(record)}, rounded to nearest (no calibration)"


def recipe(settings: Params, target: Target, eight_bit_targets: tuple[str, ...] = ()) -> Recipe:
    from llmcompressor.modifiers.quantization import QuantizationModifier

    group = int4.choose_group_size(target.config, settings.group_size, target.model_dir)
    modifiers = [QuantizationModifier(config_groups=int4.config_groups(group, settings.symmetric, eight_bit_targets),
                                      ignore=list(target.ignore))]
    return Recipe(modifiers, int4.scheme(group, settings.symmetric) + ", round-to-nearest",
                  {"group_size": group, "symmetric": settings.symmetric})
