"""AWQ W4A16 (Lin et al. 2023, "AWQ: Activation-aware Weight Quantization"): per-channel scales that protect the
weights the activations make salient, searched per layer group on calibration data (awq_gram.py: llm-compressor's
objective from X^T X where a mapping's output is one Linear's), folded into the preceding norm or Linear
(awq_mappings.py: which feeds which, per architecture), then group-wise int4 weights (int4.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.errors import UserError
import pipeline.methods.int4 as int4  # not `from pipeline.methods import`: the registry imports this module
from pipeline.methods.recipe import BatchSize, Recipe, Target
from pipeline.section import Section

NAME = "awq"
SUMMARY = "AWQ smoothing, then W4A16 group-wise int4 weights; lm_head and vision tower untouched."
DEFAULT_VARIANT = "awq-w4a16"
NEEDS_CALIBRATION = True  # the scales are searched on the calibration tokens
CALIBRATION_STATE = "activation-cache"  # per layer: the attention's cached inputs and float32 Gram matrices (quantize/plan.py)
SERVING_FORMAT = "compressed-tensors pack-quantized (W4A16)"
CARD_TAGS = ("awq", "w4a16", "int4")  # the model card's tags for its scheme (pipeline/report/model_card.py)
WEIGHT_BITS = 4  # bits per quantized weight (int4 weights), before scales: the server plan sizes an unbuilt checkpoint by it
CARD_WEIGHTS = int4.CARD_WEIGHTS
COMPARED_WITH = {"rtn": "the contrast the AWQ paper draws: the same int4 quantizer without AWQ's smoothing"}
SEARCHES = ("gram", "forward")
# the X^T X search scores several scale candidates at once, stacked (awq_gram.py): at most this many bytes of them
# on the device at a time, about five float32 copies of the weight per candidate (at least one candidate per pass)
SEARCH_PASS_BYTES = 4 << 30
# and ranks every candidate by a bfloat16 estimate of its loss, then scores this many of the best again in float32 and
# keeps the best of those (the exhaustive search's choice unless it ranks below them; benchmarks/awq_profile.py checks)
RESCORED_CANDIDATES = 3
# llm-compressor's forward search (the attention mapping, whose output passes a softmax) can rank every candidate on a
# share of the calibration batches, then rescore the best RESCORED_CANDIDATES on all of them (GramAWQModifier.
# ranking_share). Off (0): it kept other scales than the exhaustive search, and on the demo model raised the KL from
# the base by +0.0005 [+0.0002, +0.0008] (benchmarks/results/awq_profile_cpu.md); benchmarks/gpu_awq_speed.py
# measures it on GLM-4-9B's shapes as `ours-ranked`.
RANKING_SHARE = 0.0


class Params(Section):
    """`variants.<name>` with `method: awq`."""

    method: Literal["awq"]
    group_size: int4.GroupSize = "auto"
    symmetric: int4.Symmetric = False
    batch_size: BatchSize = 32
    n_grid: int = Field(20, ge=3, le=100, description="Scale candidates per layer group (llm-compressor's default "
                        "20; it spaces them by 1 / (n_grid - 2), so at least 3)")
    search: Literal["gram", "forward"] = Field("gram", description="How each candidate is scored: gram (llm-compressor's "
                                               "loss from X^T X where a mapping's output is one Linear's) or forward "
                                               "(llm-compressor's own search)")


def card_words(record: dict) -> str:
    """What it changes, in a model card's words, from its quant.json record."""
    return (f"{int4.card_words(record)}, after AWQ smoothing (per-channel scales searched on calibration data, folded "
            "into the layers before)")


def recipe(settings: Params, target: Target, eight_bit_targets: tuple[str, ...] = ()) -> Recipe:
    """llm-compressor's AWQ smoothing (our search, or its own), then W4A16 on every Linear outside the ignore list.
    Refused before any weight loads: an architecture without smoothing mappings, a group size that does not fit."""
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    from pipeline.methods.awq_gram import GramAWQModifier
    from pipeline.methods.awq_mappings import mappings_for, supported_architectures

    mappings = mappings_for(target.architecture, target.config)
    if mappings is None:
        raise UserError(f"{target.model_dir}: AWQ has no smoothing mappings for {target.architecture}; supported: "
                        + ", ".join(supported_architectures()))
    group = int4.choose_group_size(target.config, settings.group_size, target.model_dir)
    smoothing = (GramAWQModifier(mappings=mappings, duo_scaling=True, n_grid=settings.n_grid,
                                 search_pass_bytes=SEARCH_PASS_BYTES, rescored_candidates=RESCORED_CANDIDATES,
                                 ranking_share=RANKING_SHARE)
                 if settings.search == "gram"
                 else AWQModifier(mappings=mappings, duo_scaling=True, n_grid=settings.n_grid))
    modifiers = [
        smoothing,
        QuantizationModifier(config_groups=int4.config_groups(group, settings.symmetric, eight_bit_targets),
                             ignore=list(target.ignore)),
    ]
    return Recipe(modifiers, int4.scheme(group, settings.symmetric),
                  {"group_size": group, "symmetric": settings.symmetric, "n_grid": settings.n_grid,
                   "search": settings.search})
