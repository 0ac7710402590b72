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
    error: str | None = None  # set when a remote engine gave up on this request; text is then ""


class Engine(Protocol):
    name: str

    def generate(self, requests: list[GenRequest]) -> list[Completion]: ...

    def apply_chat_template(self, messages: list[dict]) -> str: ...


def make_engine(name: str, model_dir, **options) -> Engine:
    if name == "hf":
        from pipeline.engines.vision import VisionEngine, is_multimodal

        if is_multimodal(model_dir):
            return VisionEngine(model_dir, **options)
        from pipeline.engines.hf import HFEngine

        return HFEngine(model_dir, **options)
    if name == "openai":
        from pipeline.engines.openai import OpenAIEngine

        return OpenAIEngine(**options)
    from pipeline.errors import UserError

    if name == "lmdeploy":
        try:
            import lmdeploy  # noqa: F401  (only present with the GPU extra)
        except ImportError:
            raise UserError("engine 'lmdeploy' needs the GPU extra (pip install -e '.[gpu]' on a CUDA machine); "
                            "use hf, or openai against a running `lmdeploy serve api_server`") from None
        raise UserError("engine 'lmdeploy' in-process is not wired yet; serve the model with "
                        "`lmdeploy serve api_server` and use the openai engine with its URL")

    raise UserError(f"engine {name!r} is not available yet; use engine.name: hf")
