"""What every engine speaks: requests, completions, request timings, and the one way generated token ids
become an answer (cut at max_new_tokens, at the first EOS and at the first stop string; a reasoning model's reasoning
split off first: pipeline/engines/reasoning.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Sampling:
    """How a sampled request draws its tokens (a suite's k samples: pipeline/scoring/samples.py)."""

    temperature: float
    top_p: float
    top_k: int  # 0: no top-k cut


@dataclass
class GenRequest:
    prompt: str  # fully rendered (chat template already applied by the suite)
    max_new_tokens: int = 256
    stop: list[str] = field(default_factory=list)  # a reasoning model's: applied to the answer after its reasoning
    # a reasoning model's mode as rendered (enable_thinking), its reasoning split off the answer; None: the template
    # does not think (SmolLM2), nothing split
    thinking: bool | None = None
    seed: int | None = None  # a sampled request's seed; None: greedy
    sampling: Sampling | None = None  # with a seed: how it samples


@dataclass
class Completion:
    text: str  # the answer (a reasoning model's: after its reasoning)
    n_tokens: int  # every generated token, the reasoning's included
    seconds: float
    error: str | None = None  # set when a remote engine gave up on this request; text is then ""
    replaced: int = 0  # characters of the server's text no UTF-8 file can hold, replaced by U+FFFD
    reasoning: str = ""  # a reasoning model's reasoning ("" when none)
    reasoning_tokens: int | None = 0  # tokens of the reasoning, its closing marker included (None: not known)
    cut: str | None = None  # where max_new_tokens cut the generation: "reasoning", "answer", None (not cut)
    thinking: bool = False  # whether the request was rendered with thinking on

    @property
    def answer_tokens(self) -> int | None:
        return None if self.reasoning_tokens is None else self.n_tokens - self.reasoning_tokens


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
                  error: str | None = None, capped: bool | None = None) -> Completion:
    """Generated ids cut at max_new_tokens and at the first EOS, a reasoning model's reasoning split off
    (request.thinking not None), the answer decoded and cut at the first stop string. capped: whether the engine
    stopped at max_new_tokens (a server's finish_reason "length"); None: no EOS within max_new_tokens."""
    from pipeline.engines.reasoning import split_reasoning

    tokens = tokens[: request.max_new_tokens]
    n = next((i for i, t in enumerate(tokens) if t in eos_ids), len(tokens))
    capped = n >= request.max_new_tokens if capped is None else capped
    if request.thinking is None:
        reasoning, answer_ids, closed = "", tokens[:n], True
    else:
        reasoning, answer_ids, closed = split_reasoning(tokenizer, tokens[:n], request.prompt)
    text = tokenizer.decode(answer_ids, skip_special_tokens=True)
    answer = truncate_at_stop(text, request.stop)
    cut = None if not capped else "reasoning" if not closed else "answer" if answer == text else None
    return Completion(answer, n, seconds, error, reasoning=reasoning, reasoning_tokens=n - len(answer_ids), cut=cut,
                      thinking=bool(request.thinking))
