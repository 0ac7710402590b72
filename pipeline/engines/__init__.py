"""Engines: one small protocol, `generate(requests) -> completions`, batched.

`hf` runs everywhere (in-process transformers), `lmdeploy` on a CUDA machine (in-process PyTorch
engine), `vllm` on a CUDA machine (`vllm serve` started by the stage, spoken to over HTTP), `openai`
against any OpenAI-compatible server already running. Every engine that renders prompts itself
uses the checkpoint's own chat template and tokenizer, so switching engines changes no token.
In-process engines also time single requests (`timed_generate`) for `quantize bench`; server
engines are timed over HTTP by the bench itself. `ENGINES` is the one table of engine names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass
class GenRequest:
    prompt: str  # fully rendered (chat template already applied by the suite)
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)


@dataclass
class Completion:
    text: str
    n_tokens: int
    seconds: float
    error: str | None = None  # set when a remote engine gave up on this request; text is then ""


@dataclass
class Timing:
    """One request as `quantize bench` sees it."""

    ttft: float  # seconds from submission to the first generated token
    seconds: float  # submission to the last token
    n_tokens: int
    input_tokens: int
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None
    itl: list[float] = field(default_factory=list)  # seconds between successive token arrivals (streamed chunks)

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first."""
        return (self.seconds - self.ttft) / (self.n_tokens - 1) if self.n_tokens > 1 else None


def truncate_at_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    return text[:cut] if cut >= 0 else text


def eos_token_ids(tokenizer, generation_eos) -> set[int]:
    """The ids that end an answer: generation_config's eos_token_id (one or a list) and the tokenizer's."""
    return set(generation_eos if isinstance(generation_eos, list) else [generation_eos]) | {tokenizer.eos_token_id}


def to_completion(tokenizer, request: GenRequest, tokens: list[int], eos_ids: set[int], seconds: float,
                  error: str | None = None) -> Completion:
    """Generated ids cut at max_new_tokens and at the first EOS, decoded, cut at the first stop string."""
    tokens = tokens[: request.max_new_tokens]
    n = next((i for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    text = tokenizer.decode(tokens[:n], skip_special_tokens=True)
    return Completion(truncate_at_stop(text, request.stop), n, seconds, error)


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


ENGINES: dict[str, EngineSpec] = {spec.name: spec for spec in (
    EngineSpec("hf", "pipeline.engines.hf:HFEngine", "in-process transformers (CPU or GPU)", "in-process"),
    EngineSpec("vllm", "pipeline.engines.vllm:VLLMEngine", "`vllm serve` started by the stage (CUDA)", "http",
               "vllm"),
    EngineSpec("lmdeploy", "pipeline.engines.lmdeploy:LMDeployEngine", "lmdeploy's PyTorch engine in-process (CUDA)",
               "in-process", "lmdeploy"),
    EngineSpec("openai", "pipeline.engines.openai:OpenAIEngine", "an OpenAI-compatible server already running",
               "http"),
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


def make_engine(name: str, model_dir, **options) -> Engine:
    import importlib

    spec = engine_spec(name)
    if name == "hf":
        from pipeline.engines.vision import VisionEngine, is_multimodal

        if is_multimodal(model_dir):
            return VisionEngine(model_dir, **options)
    module, cls = spec.target.split(":")
    return getattr(importlib.import_module(module), cls)(model_dir, **options)
