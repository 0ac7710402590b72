"""Engines: one small protocol, `generate(requests) -> completions`, batched.

`hf` runs everywhere (in-process transformers), `lmdeploy` on a CUDA machine (in-process PyTorch
engine), `vllm` on a CUDA machine (`vllm serve` started by the stage, spoken to over HTTP), `openai`
against any OpenAI-compatible server already running. Every engine that renders prompts itself
uses the checkpoint's own chat template and tokenizer, so switching engines changes no token.
In-process engines also time single requests (`timed_generate`) for `quantize bench`; server
engines are timed over HTTP by the bench itself. `ENGINES` is the one table of engine names and of what
each engine can do and reads (params, bench, evaluate, judge and the CLI ask it; none compares names).
This module stays light: params.py imports it to validate engine names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from pipeline.engines import options as _options
from pipeline.engines.base import (  # noqa: F401  (the engine protocol's types, for callers)
    Completion, GenRequest, Timing, eos_token_ids, to_completion, truncate_at_stop,
)


class Engine(Protocol):
    name: str

    def generate(self, requests: list[GenRequest]) -> list[Completion]: ...

    def apply_chat_template(self, messages: list[dict]) -> str: ...

    def close(self) -> None: ...  # frees what the engine holds (GPU memory, worker processes)


@dataclass(frozen=True)
class EngineSpec:
    """One engine: where its class lives and what it can do."""

    name: str
    target: str  # "module:Class"
    summary: str  # what help texts say of it, e.g. hf (in-process)
    timing: str  # how `quantize bench` times it: "in-process" (timed_generate) or "http" (a server)
    extra: str | None = None  # the pip extra that installs it
    local_weights: bool = True  # runs the checkpoint dir's weights (False: a server already running holds them)
    starts_server: bool = False  # the stage starts a server for it (it writes the server's log; bench asks its metrics)
    likelihoods: bool = False  # scores text (token_logprobs): likelihood and perplexity suites
    images: bool = False  # answers prompts with images (the VQA suite) for a checkpoint with a vision tower
    vision_target: str | None = None  # "module:Class" that runs a checkpoint with a vision tower, if not `target`
    # what make_engine takes for it from params.yaml's `engine` section (pipeline/engines/options.py)
    options: Callable[[Any], dict] = _options.in_process
    package: str | None = None  # the distribution whose version `quantize bench` records for it
    check: str | None = None  # "module:function" failing early (naming the extra) when its package is missing here
    # "module:function" starting the run's shared server for a checkpoint in the background (a server engine)
    warm: str | None = None


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("hf", "pipeline.engines.hf:HFEngine", "in-process", "in-process", likelihoods=True, images=True,
               vision_target="pipeline.engines.vision:VisionEngine", package="transformers"),
    EngineSpec("vllm", "pipeline.engines.vllm:VLLMEngine", "`vllm serve`, CUDA", "http", "vllm",
               starts_server=True, likelihoods=True, images=True, options=_options.vllm, package="vllm",
               warm="pipeline.engines.vllm:warm"),
    EngineSpec("lmdeploy", "pipeline.engines.lmdeploy:LMDeployEngine", "in-process, CUDA", "in-process", "lmdeploy",
               options=_options.lmdeploy, package="lmdeploy", check="pipeline.engines.lmdeploy:require_lmdeploy"),
    EngineSpec("openai", "pipeline.engines.openai:OpenAIEngine", "a running server", "http", local_weights=False,
               images=True, options=_options.openai),
)}


def engine_names(quote: bool = False, described: bool = False, where=None) -> str:
    """'hf, vllm, lmdeploy or openai' (quote: "'hf', 'vllm', ..."; described: "hf (in-process), ..."), the
    registered engines for which `where(spec)` holds (default: all): for messages and help texts."""
    names = [(repr(n) if quote else n) + (f" ({s.summary})" if described else "")
             for n, s in ENGINES.items() if where is None or where(s)]
    if len(names) < 2:
        return names[0] if names else "none"
    return ", ".join(names[:-1]) + " or " + names[-1]


def engine_spec(name: str, what: str = "engine") -> EngineSpec:
    if name not in ENGINES:
        from pipeline.errors import UserError

        raise UserError(f"{what} {name!r}: use {engine_names()}")
    return ENGINES[name]


# Every engine this process made, with what making it cost: a model load (hf, lmdeploy), a server start
# (vllm), or an attach to a server an earlier stage of the run started (vllm, shared: seconds near 0).
# Stages write the sum as `engine_start_s` in their outputs; the CLI adds it to QUANTIZE_STAGE_LOG.
STARTS: list[dict] = []
# Every wait on a server that held none of this process's outstanding requests, as the lost-request watchdog ended it
# ({"server", "idle_s", "requests", "at"}), and per server the most of this process's requests in flight there at
# once (pipeline/engines/inflight.py). Stages write both in QUANTIZE_STAGE_LOG.
STALLS: list[dict] = []
PEAK_IN_FLIGHT: dict[str, int] = {}


def engine_start_seconds(since: int = 0) -> float:
    """Seconds spent making engines, from the `since`-th on (len(STARTS) when a stage began)."""
    return round(sum(s["seconds"] for s in STARTS[since:]), 2)


def capability(name: str, flag: str) -> bool:
    """An EngineSpec flag (local_weights, starts_server, likelihoods, images) of engine `name`; False for a name
    not registered (make_engine refuses it, with the names it takes)."""
    return bool(getattr(ENGINES[name], flag)) if name in ENGINES else False


def engine_options(name: str, section) -> dict:
    """What make_engine takes for engine `name` from params.yaml's `engine` section (EngineParams); an
    unregistered name gets the in-process settings (make_engine refuses it, with the names it takes)."""
    return (ENGINES[name].options if name in ENGINES else _options.in_process)(section)


def require(name: str) -> None:
    """Fail now, before a long stage's work, when engine `name` cannot run here (its package missing: the
    UserError names the pip extra). Engines without a check (hf; vllm: its server command is checked when
    it starts) pass."""
    spec = ENGINES.get(name)
    if spec is not None and spec.check:
        import importlib

        module, function = spec.check.split(":")
        getattr(importlib.import_module(module), function)()


def warm(name: str, model_dir, **options) -> str | None:
    """Start engine `name`'s server for this checkpoint in the background when the engine has one (its
    EngineSpec.warm); returns the key of a server started, else None."""
    spec = ENGINES.get(name)
    if spec is None or not spec.warm:
        return None
    import importlib

    module, function = spec.warm.split(":")
    return getattr(importlib.import_module(module), function)(model_dir, **options)


def make_engine(name: str, model_dir, **options) -> Engine:
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
    engine = getattr(importlib.import_module(module), cls)(model_dir, **options)
    record = {"engine": name, "model": str(model_dir), "seconds": time.perf_counter() - started}
    if hasattr(engine, "server") and hasattr(engine.server, "started"):
        record["server"] = "started" if engine.server.started else "attached"
    STARTS.append(record)
    return engine
