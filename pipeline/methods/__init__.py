"""Quantization methods: one module each, registered in METHODS below, the one place method names live.

A method module declares, once:
  NAME               its name: params.yaml's `variants.<v>.method`, the `quantize <NAME>` subcommand, quant.json's method
  SUMMARY            one line: the subcommand's help
  DEFAULT_VARIANT    where `quantize <NAME>` writes without a params.yaml variant: models/<DEFAULT_VARIANT>
  NEEDS_CALIBRATION  whether calibration tokens shape the variant (RTN: no; the stage still reads them to check it)
  CALIBRATION_STATE  what it holds per decoder layer while calibrating beyond the activations, for the plan's memory
                     estimate (pipeline/quantize/plan.py): "none", "activation-cache" (cached inputs, Gram matrices), "hessians"
  SERVING_FORMAT     the checkpoint format it writes (where it is served: pipeline/checkpoints/serving.py, from the
                     checkpoint's config.json and the runs recorded on the GPU machine, never from the method's name)
  CARD_TAGS          the model card's tags for it: the method and the scheme it writes ("awq", "w4a16", "int4")
  WEIGHT_BITS        bits per quantized weight before scales (4, 8): the server plan sizes a checkpoint not yet built
                     by it (pipeline/stages/warm.py); `mixed` has none: its budget, max_bits, is its size
  CARD_WEIGHTS       what its checkpoint stores, in a model card's words ("int4 weights")
  card_words(record) -> str   what it changes, in a model card's words, from its quant.json record
  COMPARED_WITH      {other method: why}: the report compares each of its variants with the other method's at the
                     same group size, paired per document (shown, not counted)
  Params             its params.yaml section: typed fields with their bounds and help (the CLI flags' help too)
  recipe(settings, target) -> Recipe   llm-compressor's modifiers for one checkpoint (pipeline/methods/recipe.py)

The quantize stage (pipeline/stages/quantize.py) runs any of them the same way: plan, load, calibrate, save, verify.
Adding a method is its module and its entry here (and its variant in params.yaml, its row in the README).
"""

from __future__ import annotations

from pipeline.methods import awq, fp8, gptq, mixed, rtn

METHODS = (awq, fp8, rtn, gptq, mixed)  # the registry, in the order `quantize --help` lists the subcommands

_BY_NAME = {method.NAME: method for method in METHODS}


def names(quote: bool = False) -> str:
    """The registered names, e.g. 'awq, fp8 or rtn' (quote: "'awq', 'fp8' or 'rtn'"), for messages and help texts."""
    shown = [repr(name) if quote else name for name in _BY_NAME]
    return ", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else "".join(shown)


def is_method(name) -> bool:
    return name in _BY_NAME


def method(name: str, what: str = "method"):
    """The module of method `name`; an unknown name is refused with the registered ones."""
    if name not in _BY_NAME:
        from pipeline.errors import UserError

        raise UserError(f"{what} {name!r}: use {names()}")
    return _BY_NAME[name]


def sections() -> tuple:
    """Every method's params section: params.yaml's `variants` entries are one of these, by `method`."""
    return tuple(module.Params for module in METHODS)


def comparisons() -> list[tuple[str, str, str]]:
    """(method, compared with, why) for every pair a method declares in COMPARED_WITH."""
    return [(module.NAME, other, why) for module in METHODS for other, why in module.COMPARED_WITH.items()]
