"""Engines: one small protocol, `generate(requests) -> completions`, batched.

`hf` runs everywhere (in-process transformers), `lmdeploy` on a CUDA machine (in-process PyTorch
engine), `vllm` on a CUDA machine (`vllm serve` started by the stage, spoken to over HTTP), `openai`
against any OpenAI-compatible server already running. Every engine that renders prompts itself
uses the checkpoint's own chat template and tokenizer, so switching engines changes no token.
In-process engines also time single requests (`timed_generate`) for `quantize bench`; server
engines are timed over HTTP by the bench itself. `ENGINES` is the one table of engine names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
    summary: str
    timing: str  # how `quantize bench` times it: "in-process" (timed_generate) or "http" (a server)
    extra: str | None = None  # the pip extra that installs it
    local_weights: bool = True  # runs the checkpoint dir's weights (False: a server already running holds them)
    starts_server: bool = False  # the stage starts a server for it (it writes the server's log; bench asks its metrics)


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("hf", "pipeline.engines.hf:HFEngine", "in-process transformers (CPU or GPU)", "in-process"),
    EngineSpec("vllm", "pipeline.engines.vllm:VLLMEngine", "`vllm serve` started by the stage (CUDA)", "http",
               "vllm", starts_server=True),
    EngineSpec("lmdeploy", "pipeline.engines.lmdeploy:LMDeployEngine", "lmdeploy's PyTorch engine in-process (CUDA)",
               "in-process", "lmdeploy"),
    EngineSpec("openai", "pipeline.engines.openai:OpenAIEngine", "an OpenAI-compatible server already running",
               "http", local_weights=False),
)}


def engine_names() -> str:
    """'hf, vllm, lmdeploy or openai': for messages and help texts."""
    names = list(ENGINES)
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


def engine_start_seconds(since: int = 0) -> float:
    """Seconds spent making engines, from the `since`-th on (len(STARTS) when a stage began)."""
    return round(sum(s["seconds"] for s in STARTS[since:]), 2)


def capability(name: str, flag: str) -> bool:
    """An EngineSpec flag (local_weights, starts_server) of engine `name`; False for a name not registered
    (make_engine refuses it, with the names it takes)."""
    return bool(getattr(ENGINES[name], flag)) if name in ENGINES else False


def make_engine(name: str, model_dir, **options) -> Engine:
    import importlib
    import time

    spec = engine_spec(name)
    started = time.perf_counter()
    if name == "hf":
        from pipeline.engines.vision import VisionEngine, is_multimodal

        if is_multimodal(model_dir):
            engine = VisionEngine(model_dir, **options)
            STARTS.append({"engine": name, "model": str(model_dir), "seconds": time.perf_counter() - started})
            return engine
    module, cls = spec.target.split(":")
    engine = getattr(importlib.import_module(module), cls)(model_dir, **options)
    record = {"engine": name, "model": str(model_dir), "seconds": time.perf_counter() - started}
    if hasattr(engine, "server") and hasattr(engine.server, "started"):
        record["server"] = "started" if engine.server.started else "attached"
    STARTS.append(record)
    return engine
