"""What every engine declares: its params.yaml section (a subclass of EngineSettings: the `engine:` mapping when
`engine.name` names it) and its EngineSpec (what it can do, where its class lives).

The sections are in pipeline/engines/sections.py, the specs in the registry (pipeline/engines/__init__.py). Nothing
here imports the registry or params.py (params.py validates `engine` with the registry's sections, as it validates
`variants` with the methods').
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field

from pipeline.section import Section

# the dtype an in-process engine loads the weights in (float32 holds float16 weights exactly)
ModelDtype = Literal["float32", "float16", "bfloat16"]
MAX_TIMEOUT_S = 3600.0


class EngineSettings(Section):
    """The settings every engine takes. An engine's own section adds its fields, each with its default."""

    name: str
    # in-process engines: prompts per batch; server engines: requests in flight
    batch_size: int = Field(32, ge=1, le=4096)

    def check(self) -> None:
        """Refuse, before any work, settings this engine cannot run with that the schema alone cannot tell (the
        openai engine without a served model's name); raises UserError."""


class HTTPSettings(EngineSettings):
    """An engine spoken to over HTTP: its client's deadline, retries and response bound."""

    timeout: float = Field(120.0, gt=0, le=MAX_TIMEOUT_S)  # seconds for a whole request (a total deadline, not idle)
    retries: int = Field(3, ge=0, le=20)
    max_response_bytes: int = Field(16 << 20, ge=1024, le=1 << 30)


def env_var_name(value: str | None) -> str | None:
    """An api_key_env: the NAME of an environment variable, never the key itself."""
    import re

    if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        # never echo the value: it may be a key pasted by mistake
        raise ValueError("must be the name of an environment variable (e.g. OPENAI_API_KEY), not the key itself")
    return value


@dataclass(frozen=True)
class EngineSpec:
    """One engine: its settings, where its class lives and what it can do (callers ask these flags, never a name)."""

    name: str
    settings: type[EngineSettings]  # its params.yaml section
    target: str  # "module:Class", made with (model_dir, settings, **what the stage supplies)
    summary: str  # what help texts say of it, e.g. hf (in-process)
    timing: str  # how `quantize bench` times it: "in-process" (timed_generate) or "http" (a server)
    extra: str | None = None  # the pip extra that installs it
    local_weights: bool = True  # runs the checkpoint dir's weights (False: a server already running holds them)
    starts_server: bool = False  # the stage starts a server for it (it writes the server's log; bench asks its metrics)
    likelihoods: bool = False  # scores text (token_logprobs): likelihood and perplexity suites
    images: bool = False  # answers prompts with images (the VQA suite) for a checkpoint with a vision tower
    deployed: bool = False  # a variant is deployed on it: the report shows whether it serves each variant
    vision_target: str | None = None  # "module:Class" that runs a checkpoint with a vision tower, if not `target`
    package: str | None = None  # the distribution whose version `quantize bench` records for it
    check: str | None = None  # "module:function" failing early (naming the extra) when its package is missing here
    # "module:function" starting the run's shared server for a checkpoint in the background (a server engine)
    warm: str | None = None
    shown_as: str | None = None  # its name where people read it (a model card's serving lines), else `name`
    # serves a published compressed-tensors checkpoint by its Hub repository id, as it is (no export first): the
    # engine a model card's deployment shows (pipeline/report/card_usage.py)
    hub_serving: bool = False
