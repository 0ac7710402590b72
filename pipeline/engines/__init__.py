"""Engines: one small protocol, `generate(requests) -> completions`, batched.

`hf` runs everywhere (in-process transformers); `lmdeploy` and `openai` join with their issues.
The suite, not the engine, decides the prompt: switching engines changes no prompt.
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


class Engine(Protocol):
    name: str

    def generate(self, requests: list[GenRequest]) -> list[Completion]: ...

    def apply_chat_template(self, messages: list[dict]) -> str: ...


def make_engine(name: str, model_dir, **options) -> Engine:
    if name == "hf":
        from pipeline.engines.hf import HFEngine

        return HFEngine(model_dir, **options)
    from pipeline.errors import UserError

    raise UserError(f"engine {name!r} is not available yet; use engine.name: hf")
