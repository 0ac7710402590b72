"""The resume cache of `quantize eval` (and the judge's answers): an append-only JSONL beside the
results, one line per finished generation or scored token request, keyed by the model's
fingerprint and the request, so a killed run resumes where it stopped and a rerun of an
unchanged model costs nothing.

A kill can land at any byte of an append: the file is a keyed JSONL (pipeline/formats/keyed_jsonl.py),
whose next open drops a torn last line, counts it (`dropped`) and cuts it off the file; the requests
it held are simply computed again. Any other broken line is an error naming the file and line.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

from pipeline.checkpoints.fingerprint import model_fingerprint  # noqa: F401  (what the cache is keyed by)
from pipeline.engines import Completion, GenRequest
from pipeline.formats.checked_json import unpaired_surrogate
from pipeline.formats.keyed_jsonl import KeyedJsonl


# an engine's settings that change the numbers it computes: the precision it runs in, and the KV cache's
NUMERICS = ("dtype", "kv_cache_dtype")


def answers_fingerprint(model_dir: Path, engine: str, settings) -> str:
    """What a cached answer or score was computed from: the checkpoint's content, the engine and the precision it
    computes in (NUMERICS: bfloat16 scores differ from float32's). A rerun resumes where it stopped, and a setting
    that changes how the engine runs but not its arithmetic (a server's arguments, the batch size, a timeout) keeps
    the cache; another engine or dtype computes its own, never another's (the cache had been keyed by the checkpoint
    alone: a suite scored again in bfloat16 was served the float32 scores under a bfloat16 label)."""
    numerics = {name: getattr(settings, name) for name in NUMERICS if hasattr(settings, name)}
    payload = json.dumps([model_fingerprint(model_dir), engine, numerics], sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def score_key(context: list[int], continuation: list[int]) -> str:
    """Key of a token-level scoring request: the same tokens score the same on any engine."""
    return "ll:" + hashlib.sha256(json.dumps([list(context), list(continuation)]).encode()).hexdigest()


def is_entry(entry: dict) -> bool:
    """A line as put_many (a generation: its text, writable as UTF-8, tokens, seconds) or put_scores (a token
    score: a finite log-probability, greedy or not, tokens) writes it."""
    def count(value) -> bool:
        return type(value) is int and value >= 0

    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    if "logprob" in entry:
        return number(entry["logprob"]) and type(entry.get("greedy")) is bool and count(entry.get("n_tokens"))
    text, reasoning = entry.get("text"), entry.get("reasoning", "")
    return isinstance(text, str) and unpaired_surrogate(text) is None and count(entry.get("n_tokens")) \
        and number(entry.get("seconds")) and entry["seconds"] >= 0 \
        and isinstance(reasoning, str) and unpaired_surrogate(reasoning) is None \
        and (entry.get("reasoning_tokens") is None or count(entry["reasoning_tokens"])) \
        and entry.get("cut") in (None, "reasoning", "answer")


class GenerationCache(KeyedJsonl):
    """Finished generations and token scores of one model, read at open and appended one line per item."""

    def __init__(self, path: Path, fingerprint: str):
        self.fingerprint = fingerprint
        super().__init__(path, keep=lambda entry: entry.get("model") == fingerprint, valid=is_entry)

    @staticmethod
    def key(request: GenRequest) -> str:
        """The request's prompt, budget and stops; a reasoning model's mode (its answer is split off the reasoning);
        a sample's seed and sampling. A greedy request to a model that does not think keeps the key it always had."""
        parts = [request.prompt, request.max_new_tokens, request.stop]
        if getattr(request, "images", None):  # same question, other image: another answer
            from pipeline.engines.vision import image_digest

            parts.append(image_digest(request.images))
        if request.thinking is not None:
            parts.append({"thinking": request.thinking})
        if request.seed is not None:
            parts.append({"seed": request.seed, "sampling": request.sampling and vars(request.sampling)})
        raw = json.dumps(parts)
        return hashlib.sha256(raw.encode()).hexdigest()

    def get(self, request: GenRequest) -> Completion | None:
        """The cached answer; an entry written before answers recorded where the budget cut them (no `cut`) is asked
        again."""
        entry = self.entries.get(self.key(request))
        if not entry or "cut" not in entry:
            return None
        return Completion(entry["text"], entry["n_tokens"], entry["seconds"], reasoning=entry.get("reasoning", ""),
                          reasoning_tokens=entry.get("reasoning_tokens", 0), cut=entry["cut"],
                          thinking=bool(entry.get("thinking")))

    def put(self, request: GenRequest, completion: Completion) -> None:
        self.put_many([request], [completion])

    def put_many(self, requests: list[GenRequest], completions: list[Completion]) -> None:
        self.append([{"model": self.fingerprint, "key": self.key(request), "text": completion.text,
                      "n_tokens": completion.n_tokens, "seconds": completion.seconds, "cut": completion.cut,
                      **({"thinking": completion.thinking, "reasoning": completion.reasoning,
                          "reasoning_tokens": completion.reasoning_tokens} if request.thinking is not None else {})}
                     for request, completion in zip(requests, completions)])

    # ---------------------------------------------------------------- token scores (likelihood suites)

    def get_score(self, key: str) -> tuple[float, bool] | None:
        entry = self.entries.get(key)
        return (entry["logprob"], entry["greedy"]) if entry and "logprob" in entry else None

    def put_scores(self, keys: list[str], scores: list[tuple[float, bool]], n_tokens: list[int]) -> None:
        self.append([{"model": self.fingerprint, "key": key, "logprob": float(logprob), "greedy": bool(greedy),
                      "n_tokens": n} for key, (logprob, greedy), n in zip(keys, scores, n_tokens)])
