"""What an OpenAI-compatible server's reply must hold, checked field by field before anything reads it:
the openai and vllm engines' answers (and the judge's, which go through them), vLLM's prompt
log-probabilities, and the chunks `quantize bench` times.

A reply that fails a check raises `BadReply`, a RetryableError: asked again as a timeout or an HTTP 5xx
is, then that one request's failure with the reason, never the stage's and never another exception.
The reason names the field and what was there, e.g. `malformed reply: usage.completion_tokens: expected
a whole number from 0 to 64, found text '12'`.

Text that no UTF-8 file can hold (an unpaired UTF-16 surrogate, "\\ud800" in the JSON) is not a failure:
each such character becomes U+FFFD (`encodable`) and is counted, and the count goes with the answer
(`Completion.replaced`), so what writes the answer can say so.
"""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

from pipeline.engines.http import RetryableError

REPLACEMENT = "\ufffd"
SURROGATE = re.compile("[\ud800-\udfff]")
LOGPROB_SLACK = 1e-3  # a log-probability is <= 0; float rounding may put a certain token a hair above
MAX_VERSION_CHARS = 100


class BadReply(RetryableError):
    """A reply (or streamed chunk) whose fields are not what the API specifies."""

    def __init__(self, where: str, expected: str, value):
        super().__init__(f"malformed reply: {where}: expected {expected}, found {found(value)}")


def found(value) -> str:
    """What a reply held, in a few words and never more than a short quote (no key or long text echoed)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}" if len(repr(value)) <= 24 else "a number of many digits"
    if isinstance(value, str):
        return f"text {value!r}" if len(value) <= 24 else f"text of {len(value)} characters"
    if isinstance(value, list):
        return f"an array of {len(value)}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def encodable(text: str) -> tuple[str, int]:
    """text with each character no UTF-8 file can hold (a surrogate) replaced by U+FFFD, and how many were."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError:
        return SURROGATE.sub(REPLACEMENT, text), len(SURROGATE.findall(text))


def whole_number(value, where: str, most: int | None = None, least: int = 0) -> int:
    """A count: an integer (not true/false, not 12.0, not "12"; numpy's integers pass, for the in-process
    engines) from `least` to `most`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least or \
            (most is not None and value > most):
        span = f"from {least} to {most}" if most is not None else f">= {least}"
        raise BadReply(where, f"a whole number {span}", value)
    return int(value)


def obj(value, where: str) -> dict:
    if not isinstance(value, dict):
        raise BadReply(where, "an object", value)
    return value


def optional_obj(container: dict, key: str, where: str) -> dict | None:
    value = container.get(key)
    return None if value is None else obj(value, where)


def text(value, where: str) -> str:
    if not isinstance(value, str):
        raise BadReply(where, "text", value)
    return value


def token_ids(value, where: str, vocab_size: int | None, most: int | None = None) -> list[int]:
    """Generated token ids: an array of at most `most` whole numbers below the vocabulary size."""
    if not isinstance(value, list) or (most is not None and len(value) > most):
        raise BadReply(where, "an array of token ids" + (f" (at most {most})" if most is not None else ""), value)
    top = vocab_size - 1 if vocab_size else None
    return [whole_number(t, f"{where}[{i}]", top) for i, t in enumerate(value)]


def first_choice(data: dict) -> dict:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        raise BadReply("choices", "a non-empty array", choices)
    return obj(choices[0], "choices[0]")


@dataclass
class Choice:
    """The first choice of a (chat) completion, every field checked."""

    text: str  # surrogates replaced (`replaced` of them)
    token_ids: list[int] | None  # vLLM's return_token_ids, when the reply has them
    completion_tokens: int | None  # usage.completion_tokens, when the reply has it
    finish_reason: str | None
    replaced: int = 0
    reasoning: str | None = None  # a chat reply's reasoning, split off by the server's reasoning parser (vLLM)
    reasoning_tokens: int | None = None  # usage.completion_tokens_details.reasoning_tokens, when the reply has it


def completion_choice(data: dict, *, chat: bool, max_tokens: int | None = None,
                      vocab_size: int | None = None) -> Choice:
    """The first choice of a /v1/completions (chat: /v1/chat/completions) reply; BadReply when any field
    read is not what the API specifies. max_tokens: what the request allowed (bounds the counts);
    vocab_size: the model's (bounds token ids)."""
    choice = first_choice(data)
    reasoning = None
    if chat:
        message = obj(choice.get("message"), "choices[0].message")
        # vLLM's reasoning parser: the reasoning apart (`reasoning`; `reasoning_content` in older vLLM and other
        # servers), and the content null when the reasoning took every token
        for key in ("reasoning", "reasoning_content"):
            if message.get(key) is not None:
                reasoning = encodable(text(message[key], f"choices[0].message.{key}"))[0]
                break
        content = "" if reasoning is not None and message.get("content") is None else \
            text(message.get("content"), "choices[0].message.content")
    else:
        content = text(choice.get("text"), "choices[0].text")
    finish = choice.get("finish_reason")
    if finish is not None and not isinstance(finish, str):
        raise BadReply("choices[0].finish_reason", "text or null", finish)
    ids = choice.get("token_ids")
    if ids is not None:
        ids = token_ids(ids, "choices[0].token_ids", vocab_size, max_tokens)
    usage = optional_obj(data, "usage", "usage")
    count = thought = None
    if usage is not None and usage.get("completion_tokens") is not None:
        count = whole_number(usage["completion_tokens"], "usage.completion_tokens", max_tokens)
    details = optional_obj(usage or {}, "completion_tokens_details", "usage.completion_tokens_details")
    if details is not None and details.get("reasoning_tokens") is not None:
        thought = whole_number(details["reasoning_tokens"], "usage.completion_tokens_details.reasoning_tokens", max_tokens)
    content, replaced = encodable(content)
    return Choice(content, ids, count, finish, replaced, reasoning, thought)


def prompt_logprobs(data: dict, ids: list[int], start: int) -> tuple[float, bool] | None:
    """Sum of the log-probabilities of ids[start:] and whether each was the top token, from vLLM's
    `prompt_logprobs` (one entry per prompt token: {token id: {logprob, rank}}); None when the reply has
    none at all (a server too old to give them). BadReply when an entry is missing or out of range."""
    first_choice(data)
    positions = data["choices"][0].get("prompt_logprobs")
    if positions is None:
        return None
    if not isinstance(positions, list) or len(positions) != len(ids):
        raise BadReply("choices[0].prompt_logprobs", f"an array of {len(ids)} entries (one per prompt token)",
                       positions)
    total, greedy = 0.0, True
    for position in range(start, len(ids)):
        where = f"choices[0].prompt_logprobs[{position}]"
        entry = obj(obj(positions[position], where).get(str(ids[position])), f"{where}[{str(ids[position])!r}]")
        logprob = entry.get("logprob")
        if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or not math.isfinite(logprob) \
                or logprob > LOGPROB_SLACK:
            raise BadReply(f"{where}.logprob", "a log-probability (a finite number <= 0)", logprob)
        rank = entry.get("rank")
        if rank is not None:
            rank = whole_number(rank, f"{where}.rank", least=1)
        total += min(float(logprob), 0.0)
        greedy = greedy and rank == 1
    return total, greedy


@dataclass
class StreamChunk:
    """What one streamed chunk says: the tokens it carries, and the usage it reports (the last chunk, with
    stream_options.include_usage), each None when absent."""

    tokens: int
    completion_tokens: int | None = None
    prompt_tokens: int | None = None


def stream_chunk(event: dict, max_tokens: int | None = None, chat: bool = False) -> StreamChunk:
    """A streamed /v1/completions chunk (chat: /v1/chat/completions, whose text is each choice's delta.content). A
    chunk carries its token ids (vLLM's return_token_ids) or, without them, one token per non-empty text; a chat
    stream's first chunk (the role, empty content) carries none."""
    choices = event.get("choices")
    if choices is not None and not isinstance(choices, list):
        raise BadReply("choices", "an array", choices)
    count = 0
    for i, choice in enumerate(choices or []):
        choice = obj(choice, f"choices[{i}]")
        ids = choice.get("token_ids")
        if chat:
            delta = optional_obj(choice, "delta", f"choices[{i}].delta") or {}
            piece, where = delta.get("content"), f"choices[{i}].delta.content"
        else:
            piece, where = choice.get("text"), f"choices[{i}].text"
        if piece is not None:
            text(piece, where)
        if ids is not None:
            count += len(token_ids(ids, f"choices[{i}].token_ids", None, max_tokens))
        elif piece:
            count += 1
    usage = optional_obj(event, "usage", "usage")
    completion = prompt = None
    if usage is not None and usage.get("completion_tokens") is not None:
        completion = whole_number(usage["completion_tokens"], "usage.completion_tokens", max_tokens)
    if usage is not None and usage.get("prompt_tokens") is not None:
        prompt = whole_number(usage["prompt_tokens"], "usage.prompt_tokens")
    return StreamChunk(count, completion, prompt)


def version(value) -> str | None:
    """A server's /version answer's `version`: short printable text, else unknown (None)."""
    if isinstance(value, str) and 0 < len(value) <= MAX_VERSION_CHARS and value.isprintable():
        return value
    return None
