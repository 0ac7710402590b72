"""What the quantize stage (pipeline/stages/quantize.py) and a method module say to each other: the stage
describes the checkpoint (`Target`, read from config.json before any weight loads), the method answers with
its `Recipe` (llm-compressor modifiers, the scheme in words, what quant.json records of its settings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field

# every method's `batch_size`: calibration blocks per forward pass (more: faster, more memory; same result)
BatchSize = Annotated[int, Field(ge=1, le=4096, description="Calibration blocks per forward pass: more is faster "
                                 "and holds more activations in memory")]


@dataclass(frozen=True)
class Target:
    """The checkpoint a method quantizes, as config.json describes it."""

    model_dir: Path
    config: dict  # config.json, parsed (pipeline/checkpoints/config_json.py reads it)
    architecture: str  # e.g. GlmForCausalLM
    moe: bool  # routed experts, loaded as one Linear per expert
    ignore: tuple[str, ...]  # module patterns left in full precision (pipeline/quantize/plan.py IGNORE)


@dataclass
class Recipe:
    """A method's answer for one checkpoint and settings."""

    modifiers: list  # llm-compressor modifiers, applied in order by one `oneshot` call
    scheme: str  # what it writes, in words: "W4A16 asymmetric, group 128"
    details: dict = field(default_factory=dict)  # quant.json's record of the settings (group size, ...)
    # False where an expert the router never chose still gets sound scales (FP8 with dynamic expert activations):
    # verify then fails no expert for having seen no calibration token
    experts_need_tokens: bool = True
