"""Engines: one small protocol, `generate(requests) -> completions`, batched.

`hf` runs everywhere (in-process transformers), `lmdeploy` on a CUDA machine (in-process PyTorch
engine), `vllm` on a CUDA machine (`vllm serve` started by the stage, spoken to over HTTP), `openai`
against any OpenAI-compatible server already running. Every engine that renders prompts itself
uses the checkpoint's own chat template and tokenizer, so switching engines changes no token.
In-process engines also time single requests (`timed_generate`) for `quantize bench`; server
engines are timed over HTTP by the bench itself.

An engine is one module, registered in ENGINES below, the one place engine names live, by:
  its section   params.yaml's `engine:` when `engine.name` names it, a subclass of EngineSettings in
                pipeline/engines/sections.py (every engine's section, each default written once there)
  its EngineSpec  its section, its class ("module:Class", made with (model_dir, settings, **what the stage
                supplies: a log path, a progress callback)) and what it can do (local_weights, starts_server,
                likelihoods, images, deployed, ...). Callers ask these flags (`capability`), never compare a name.
Adding an engine is its module, its section and its entry in ENGINES (and its row in the README).

This module stays light: it names each engine's class by a string and imports an engine's module only when that
engine is made, warmed or checked (make_engine, warm, require), so params.py validates `engine` without importing
any engine's code, and a stage that runs no engine (resave, calib, quantize) does not depend on them
(pipeline/cli/code_reach.py follows the strings from the functions that import them).
"""

from __future__ import annotations

from typing import Protocol

from pipeline.engines.base import (  # noqa: F401  (the engine protocol's types, for callers)
    Completion, GenRequest, Sampling, Timing, eos_token_ids, to_completion, truncate_at_stop,
)
from pipeline.engines.records import PEAK_IN_FLIGHT, STALLS, STARTS, engine_start_seconds  # noqa: F401
from pipeline.engines.sections import HFSettings, LMDeploySettings, OpenAISettings, VLLMSettings
from pipeline.engines.settings import EngineSettings, EngineSpec  # noqa: F401

SPECS = (  # the registry, in the order help texts list the engines
    EngineSpec("hf", HFSettings, "pipeline.engines.hf:HFEngine", "in-process", "in-process", likelihoods=True,
               images=True, vision_target="pipeline.engines.vision:VisionEngine", package="transformers",
               shown_as="transformers"),
    EngineSpec("vllm", VLLMSettings, "pipeline.engines.vllm:VLLMEngine", "`vllm serve`, CUDA", "http", "vllm",
               starts_server=True, likelihoods=True, images=True, deployed=True, package="vllm",
               warm="pipeline.engines.vllm:warm", shown_as="vLLM", hub_serving=True),
    EngineSpec("lmdeploy", LMDeploySettings, "pipeline.engines.lmdeploy:LMDeployEngine", "in-process, CUDA",
               "in-process", "lmdeploy", package="lmdeploy", check="pipeline.engines.lmdeploy:require_lmdeploy",
               deployed=True, shown_as="lmdeploy"),
    EngineSpec("openai", OpenAISettings, "pipeline.engines.openai:OpenAIEngine", "a running server", "http",
               local_weights=False, images=True),
)
ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in SPECS}
DEFAULT = "hf"  # the engine that runs everywhere: params.yaml's `engine` without a name


class Engine(Protocol):
    name: str

    def generate(self, requests: list[GenRequest]) -> list[Completion]: ...

    def apply_chat_template(self, messages: list[dict], enable_thinking: bool | None = None) -> str: ...

    def close(self) -> None: ...  # frees what the engine holds (GPU memory, worker processes)


def engine_names(quote: bool = False, described: bool = False, where=None) -> str:
    """'hf, vllm, lmdeploy or openai' (quote: "'hf', 'vllm', ..."; described: "hf (in-process), ..."), the
    registered engines for which `where(spec)` holds (default: all): for messages and help texts."""
    names = [(repr(n) if quote else n) + (f" ({s.summary})" if described else "")
             for n, s in ENGINES.items() if where is None or where(s)]
    if len(names) < 2:
        return names[0] if names else "none"
    return ", ".join(names[:-1]) + " or " + names[-1]


def shown_as(name: str) -> str:
    """An engine's name where people read it (vLLM, transformers); an unregistered name as it is."""
    spec = ENGINES.get(name)
    return (spec.shown_as or spec.name) if spec else name


def hub_serving() -> str | None:
    """The engine a model card's deployment serves the published checkpoint with (EngineSpec.hub_serving), None when
    none is registered."""
    return next((name for name, spec in ENGINES.items() if spec.hub_serving), None)


def engine_spec(name: str, what: str = "engine") -> EngineSpec:
    if name not in ENGINES:
        from pipeline.errors import UserError

        raise UserError(f"{what} {name!r}: use {engine_names()}")
    return ENGINES[name]


def capability(name: str, flag: str) -> bool:
    """An EngineSpec flag (local_weights, starts_server, likelihoods, images, deployed) of engine `name`; False for a name
    not registered (make_engine refuses it, with the names it takes)."""
    return bool(getattr(ENGINES[name], flag)) if name in ENGINES else False


def sections() -> tuple[type[EngineSettings], ...]:
    """Every engine's params section: params.yaml's `engine` is one of these, by `name`."""
    return tuple(spec.settings for spec in ENGINES.values())


def default_name() -> str:
    """The engine of params.yaml's `engine` without a name: DEFAULT, or the first registered when it is not."""
    return DEFAULT if DEFAULT in ENGINES else next(iter(ENGINES))


def default_settings(name: str | None = None) -> EngineSettings:
    """Engine `name`'s defaults (a stage called without params.yaml's `engine`); None: the default engine's, as
    params.yaml's `engine` when it is not given."""
    return engine_spec(name or default_name()).settings()


def takes(key: str) -> list[str]:
    """The engines whose section has setting `key`, e.g. takes("base_url") == ["openai"]."""
    return [name for name, spec in ENGINES.items() if key in spec.settings.model_fields]


def validate_section(value) -> EngineSettings:
    """params.yaml's `engine` mapping validated as the section of the engine its `name` names (the default engine's
    without one), read from the registry when params are validated. Problems are pydantic's, at their keys: an
    unregistered engine.name with the names to use, a key of another engine's section with the engine that takes
    it (e.g. "engine.base_url: the openai engine's setting; engine.name is vllm")."""
    from pydantic import ValidationError
    from pydantic_core import PydanticCustomError

    if isinstance(value, EngineSettings):
        return value
    if not isinstance(value, dict):
        raise PydanticCustomError("dict_type", "Input should be a valid dictionary")
    name = value.get("name", default_name())
    if not isinstance(name, str) or name not in ENGINES:
        raise ValidationError.from_exception_data("engine", [{
            "type": "literal_error", "loc": ("name",), "input": name, "ctx": {"expected": engine_names(quote=True)}}])
    try:
        return ENGINES[name].settings.model_validate({**value, "name": name})
    except ValidationError as exc:
        raise ValidationError.from_exception_data("engine", [_told(err, name) for err in exc.errors()]) from None


def _told(err: dict, name: str) -> dict:
    """A pydantic error of engine `name`'s section as a line error again; an unknown key names who takes it."""
    from pydantic_core import PydanticCustomError

    if err["type"] != "extra_forbidden" or len(err["loc"]) != 1:
        return {key: err[key] for key in ("type", "loc", "input", "ctx") if key in err}
    owners = takes(str(err["loc"][0]))
    if owners:
        whose = " and ".join(f"the {owner}" for owner in owners) + (" engines'" if len(owners) > 1 else " engine's")
        why = f"{whose} setting; engine.name is {name}"
    else:
        why = (f"unknown key; remove it or check its spelling (the {name} engine takes: "
               f"{', '.join(ENGINES[name].settings.model_fields)})")
    return {"type": PydanticCustomError("engine_key", "{why}", {"why": why}), "loc": err["loc"], "input": err["input"]}


def settings_for(section: EngineSettings, name: str) -> EngineSettings:
    """Engine `name`'s settings from params.yaml's `engine` section (`--engine`, bench.engine and judge.backend
    may name another engine than engine.name): the section itself when it is that engine's; else that engine's
    defaults, with every setting the section gives explicitly that this engine also takes carried over (batch_size,
    dtype, timeout, ...; a value it does not take, e.g. out of its bounds, left at its default) and the other
    engine's own settings ignored, with no error: `quantize eval --engine hf` runs on a params.yaml written for
    vllm. Checked before any work (openai: engine.model set): a UserError when it cannot run."""
    from pydantic import ValidationError

    spec = engine_spec(name)
    settings = section
    if type(section) is not spec.settings:
        given = section.model_dump(include=section.model_fields_set & set(spec.settings.model_fields) - {"name"})
        try:
            settings = spec.settings.model_validate({**given, "name": name})
        except ValidationError as exc:
            refused = {str(err["loc"][0]) for err in exc.errors() if err["loc"]}
            kept = {key: value for key, value in given.items() if key not in refused}
            settings = spec.settings.model_validate({**kept, "name": name})
    settings.check()
    return settings


def require(name: str) -> None:
    """Fail now, before a long stage's work, when engine `name` cannot run here (its package missing: the
    UserError names the pip extra). Engines without a check (hf; vllm: its server command is checked when
    it starts) pass."""
    spec = ENGINES.get(name)
    if spec is not None and spec.check:
        import importlib

        module, function = spec.check.split(":")
        getattr(importlib.import_module(module), function)()


def warm(name: str, model_dir, settings: EngineSettings, **stage) -> str | None:
    """Start engine `name`'s server for this checkpoint in the background when the engine has one (its
    EngineSpec.warm), with `settings` (settings_for) and what the stage supplies (log_path); returns the key of a
    server started, else None."""
    spec = ENGINES.get(name)
    if spec is None or not spec.warm:
        return None
    import importlib

    module, function = spec.warm.split(":")
    return getattr(importlib.import_module(module), function)(model_dir, settings, **stage)


def make_engine(name: str, model_dir, settings: EngineSettings | None = None, **stage) -> Engine:
    """Engine `name` for the checkpoint in model_dir, with `settings` (settings_for; None: the engine's defaults)
    and what the stage supplies (log_path, progress)."""
    import importlib
    import time

    spec = engine_spec(name)
    started = time.perf_counter()
    target = spec.target
    if spec.vision_target and model_dir is not None:
        from pipeline.engines.vision import is_multimodal

        if is_multimodal(model_dir):
            target = spec.vision_target
    module, cls = target.split(":")
    settings = settings_for(settings, name) if settings is not None else spec.settings()
    engine = getattr(importlib.import_module(module), cls)(model_dir, settings, **stage)
    record = {"engine": name, "model": str(model_dir), "seconds": time.perf_counter() - started}
    if hasattr(engine, "server") and hasattr(engine.server, "started"):
        record["server"] = "started" if engine.server.started else "attached"
    STARTS.append(record)
    return engine
