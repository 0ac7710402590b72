"""Mixed W4A16 / W8A16: a W4A16 method (AWQ, GPTQ or RTN) with the groups that cost the variant most kept in 8 bits,
within a budget of mean bits per quantized weight: the fix for a W4A16 variant the verdict marks NO-GO.

The ranking is `quantize sensitivity`'s (pipeline/stages/sensitivity.py, sensitivity.json): for each fused group
(q/k/v, gate/up, o_proj, down_proj, a layer's experts: one scheme per layer vLLM runs, pipeline/checkpoints/fused.py)
how much of the W4A16 variant's KL to the base goes away when that group alone is restored. Groups are taken most KL
removed first and kept in W8A16 while the mean bits per quantized weight (4 or 8 per weight, weighted by the groups'
weight counts) stays within `max_bits`; a group that would pass it stays in 4 bits and the next ones are tried
(a smaller one may still fit); a group whose restoring removes no KL stays in 4 bits.

The checkpoint is one compressed-tensors folder with one config group per scheme (llm-compressor's modifiers take
several `config_groups`): W4A16 targets "Linear", W8A16 targets the kept groups' Linears by anchored regexes, which
outrank a class target in compressed-tensors and in vLLM. W8A16 uses the W4A16 group size and symmetry (vLLM's WNA16
covers 4 and 8 bits). The base method's other settings are its defaults (pipeline/methods/awq.py, gptq.py, rtn.py), or
those of the W4A16 variant being fixed (`recipe`'s base_settings: `quantize fix`, pipeline/stages/fix.py, passes the
variant's own section, AWQ's n_grid and search included); its smoothing and error feedback see each Linear's own
bits. The plan's memory estimate is AWQ's (the default base). quant.json lists each group's scheme and why, and the
bits per weight with and without the scales.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

import pipeline.methods.awq as awq  # not `from pipeline.methods import`: the registry imports this module
import pipeline.methods.gptq as gptq
import pipeline.methods.int4 as int4
import pipeline.methods.rtn as rtn
from pipeline.checkpoints import fused
from pipeline.errors import UserError
from pipeline.formats.sensitivity import NAME as SENSITIVITY_FILE
from pipeline.formats.sensitivity import read_sensitivity
from pipeline.methods.recipe import BatchSize, Recipe, Target
from pipeline.section import Section

BASES = {method.NAME: method for method in (awq, gptq, rtn)}  # the W4A16 methods a mixed variant starts from
LOW_BITS, HIGH_BITS = 4, 8
LOW_SCHEME, HIGH_SCHEME = "W4A16", "W8A16"  # a group's scheme in its plan's rows (and quant.json's groups)
DEFAULT_MAX_BITS = 4.5  # the budget of a mixed variant and of `quantize fix` (params.yaml `fix.max_bits`)
MaxBits = Annotated[float, Field(ge=LOW_BITS, le=HIGH_BITS, description="Budget: mean bits per quantized weight (4 or "
                                 "8 each, weighted by weight count); the most sensitive groups are kept in 8 bits "
                                 "until it is spent")]

NAME = "mixed"
SUMMARY = ("W4A16 (AWQ, GPTQ or RTN) with the groups `quantize sensitivity` ranks most costly kept in W8A16, within "
           "a budget of mean bits per weight: the fix for a NO-GO W4A16 variant.")
DEFAULT_VARIANT = "awq-w4a16-mixed"
NEEDS_CALIBRATION = True  # AWQ's and GPTQ's are (RTN's weights do not depend on it)
CALIBRATION_STATE = "activation-cache"  # the default base's (AWQ): the plan's memory estimate
SEARCH_PASS_BYTES = awq.SEARCH_PASS_BYTES
SERVING_FORMAT = "compressed-tensors pack-quantized, one config group per scheme (W4A16 and W8A16)"
CARD_TAGS = ("mixed", "w4a16", "w8a16", "int4")  # the model card's tags for its scheme (pipeline/report/model_card.py)
CARD_WEIGHTS = "int4 and int8 weights"  # what its checkpoint stores, in a model card's words
COMPARED_WITH: dict[str, str] = {}


class Params(Section):
    """`variants.<name>` with `method: mixed`."""

    method: Literal["mixed"]
    base: Literal[tuple(BASES)] = Field(awq.NAME, description="The W4A16 method the other groups are quantized with: "
                                        + ", ".join(BASES))
    max_bits: MaxBits = DEFAULT_MAX_BITS
    sensitivity: Path | None = Field(None, description="The ranking `quantize sensitivity` wrote for a W4A16 variant "
                                     "of this base (default: results/<the base method's default variant>/"
                                     "sensitivity.json)")
    group_size: int4.GroupSize = "auto"
    symmetric: int4.Symmetric = False
    batch_size: BatchSize = 32


def card_words(record: dict) -> str:
    """What it changes, in a model card's words, from its quant.json record: its base method's W4A16 and the groups
    kept in 8 bits."""
    base = BASES.get(record.get("base_method"))
    words = base.card_words(record) if base is not None else int4.card_words(record)
    bits = record.get("bits_per_weight")
    return (f"{words}; {record.get('groups_in_8_bits')} of {record.get('groups_total')} groups of layers kept in 8-bit "
            "integers (W8A16)" + (f", {bits:.2f} bits per weight on average" if bits is not None else ""))


def sensitivity_path(settings: Params) -> Path:
    return Path(settings.sensitivity or Path("results") / BASES[settings.base].DEFAULT_VARIANT / SENSITIVITY_FILE)


def choose(groups: list[dict], max_bits: float) -> tuple[list[dict], float]:
    """Each ranked group's scheme and why, and the mean bits per weight they give."""
    total = sum(g["weights"] for g in groups)
    extra_allowed, spent, rows = (max_bits - LOW_BITS) * total, 0, []
    for rank, group in enumerate(groups, 1):
        extra = (HIGH_BITS - LOW_BITS) * group["weights"]
        removes = f"rank {rank}: restoring it removes {group['share_removed']:.1%} of the variant's KL"
        if group["kl_removed"] <= 0:
            scheme, why = LOW_SCHEME, f"rank {rank}: restoring it removes none of the variant's KL"
        elif spent + extra <= extra_allowed + 1e-9 * total:
            spent += extra
            scheme, why = HIGH_SCHEME, f"{removes}; within the budget ({LOW_BITS + spent / total:.3f} bits per weight)"
        else:
            scheme, why = LOW_SCHEME, (f"{removes}, but in 8 bits the mean would be "
                                    f"{LOW_BITS + (spent + extra) / total:.3f} bits per weight, over {max_bits:g}")
        rows.append({"name": group["name"], "layer": group["layer"], "weights": group["weights"], "scheme": scheme,
                     "why": why, "modules": group["modules"]})
    return rows, LOW_BITS + spent / total


def bits_with_scales(bits: float, group_size: int, symmetric: bool, share_high: float) -> float:
    """Stored bits per weight: each group of `group_size` weights adds a 16-bit scale and, asymmetric, a zero point
    packed at the weights' own bits."""
    from pipeline.checkpoints.sizes import stored_bits_per_weight

    zero = 0.0 if symmetric else LOW_BITS * (1 - share_high) + HIGH_BITS * share_high
    return stored_bits_per_weight(bits, group_size, zero)


def _check_modules(ranking: dict, path: Path, target: Target) -> None:
    """Every ranked Linear is one of this model's: a ranking measured on another model is refused."""
    from pipeline.checkpoints.loading import meta_model

    names = {name for name, _ in meta_model(target.model_dir).named_modules()}
    for group in ranking["groups"]:
        missing = [m for m in group["modules"] if m not in names]
        if missing:
            raise UserError(f"{path}: {missing[0]} (group {group['name']}) is not a module of {target.model_dir}: the "
                            f"ranking was measured on another model; run `quantize sensitivity` on a W4A16 variant "
                            f"of {target.model_dir}, or pass its sensitivity.json")


def eight_bit_targets(kept: list[fused.Group], target: Target) -> tuple[str, ...]:
    """The W8A16 config group's targets: each kept group by its HF names and by the names vLLM gives them (a GLM-4V's
    prefix mapper: vLLM matches `re:` targets against its own names, pipeline/checkpoints/serving_names.py)."""
    from pipeline.checkpoints import serving_names

    renaming = serving_names.target_renaming(target.architecture)
    return tuple(fused.target_regex(g, renaming) for g in kept)


def _check_vllm(target: Target, group: int, symmetric: bool, kept: list[fused.Group], linears: list[str]) -> None:
    """Before any quantization runs: each Linear's config group as compressed-tensors will store it must be the one
    vLLM builds its layer with (pipeline/checkpoints/serving_names.py); verify checks the written checkpoint again."""
    from pipeline.checkpoints import serving_names

    config = {**target.config, "quantization_config": {"config_groups": int4.config_groups(
        group, symmetric, eight_bit_targets(kept, target))}}
    conflicts = serving_names.vllm_scheme_conflicts(config, linears)
    if conflicts:
        raise UserError(f"{target.model_dir}: vLLM would build {len(conflicts)} of the Linears kept in 8 bits with the "
                        f"4-bit scheme: {'; '.join(conflicts[:3])}; this model's fused layers are named otherwise "
                        "than pipeline/checkpoints/fused.py knows (FUSED)")


def for_variant(variant_settings, max_bits: float, sensitivity: Path) -> Params:
    """The mixed section that fixes a W4A16 variant (`quantize fix`): the variant's method as the base, its group
    size, symmetry and batch, this budget and ranking; pass the variant's section to `recipe` as base_settings."""
    return Params(method=NAME, base=variant_settings.method, max_bits=max_bits, sensitivity=Path(sensitivity),
                  group_size=variant_settings.group_size, symmetric=variant_settings.symmetric,
                  batch_size=variant_settings.batch_size)


def base_section(settings: Params, base_settings=None):
    """The base method's own params section: `base_settings` when given (a W4A16 variant's section, which must
    agree with this one on the base method, group size, symmetry and batch), else the base method's defaults with
    this section's group size, symmetry and batch."""
    base = BASES[settings.base]
    if base_settings is None:
        return base.Params(method=base.NAME, group_size=settings.group_size, symmetric=settings.symmetric,
                           batch_size=settings.batch_size)
    differ = [key for key in ("method", "group_size", "symmetric", "batch_size")
              if getattr(base_settings, key) != (settings.base if key == "method" else getattr(settings, key))]
    if differ:
        raise UserError(f"mixed: the base method's settings ({base_settings.method}) differ from the mixed section's "
                        f"on {', '.join(differ)}; build the section from them (mixed.for_variant)")
    return base_settings


def recipe(settings: Params, target: Target, base_settings=None) -> Recipe:
    """The base method's recipe with its weights in two config groups: W4A16 on every Linear outside the ignore
    list, W8A16 on the groups the ranking keeps within the budget. base_settings: the base method's own section
    (the W4A16 variant a fix is built for), else its defaults (`base_section`)."""
    path = sensitivity_path(settings)
    ranking = read_sensitivity(path)
    _check_modules(ranking, path, target)
    base = BASES[settings.base]
    own = base_section(settings, base_settings)
    int4.choose_group_size(target.config, own.group_size, target.model_dir)  # a group size that does not fit: refused first
    rows, bits = choose(ranking["groups"], settings.max_bits)
    kept = [fused.Group(r["name"], r["layer"], r["name"].rpartition(".")[2], r["modules"]) for r in rows
            if r["scheme"] == HIGH_SCHEME]
    base_recipe = base.recipe(own, target, eight_bit_targets=eight_bit_targets(kept, target))
    group, symmetric = base_recipe.details["group_size"], base_recipe.details["symmetric"]
    _check_vllm(target, group, symmetric, kept, [m for r in rows for m in r["modules"]])
    share_high = sum(r["weights"] for r in rows if r["scheme"] == HIGH_SCHEME) / sum(r["weights"] for r in rows)
    details = {"base_method": base.NAME, **base_recipe.details, "max_bits": settings.max_bits,
               "bits_per_weight": round(bits, 4),
               "bits_per_weight_with_scales": round(bits_with_scales(bits, group, symmetric, share_high), 4),
               "groups_in_8_bits": len(kept), "groups_total": len(rows), "sensitivity": str(path),
               "groups": [{k: r[k] for k in ("name", "layer", "weights", "scheme", "why")} for r in rows]}
    return Recipe(base_recipe.modifiers, f"{base_recipe.scheme}; {len(kept)} of {len(rows)} groups in W8A16 "
                                         f"({bits:.2f} bits per weight)", details)
