"""What every engine speaks: requests, completions, request timings, and the one way generated token ids
become an answer (cut at max_new_tokens, at the first EOS and at the first stop string)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    replaced: int = 0  # characters of the server's text no UTF-8 file can hold, replaced by U+FFFD


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
    server_prompt_tokens: int | None = None  # the server's own count of the prompt (usage.prompt_tokens), if reported

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
