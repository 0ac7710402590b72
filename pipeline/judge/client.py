"""The judge itself: prompts sent through any engine, the verdict read one of two ways, and the judgment cache.

- `logprobs` (an engine that scores likelihoods: hf, vllm): the judge prompt rendered by the judge's chat template,
  its reply begun with the mode's cue ("Final verdict: [[", pipeline/judge/prompts.py), and each choice (A, B, C;
  a grade 1-5) scored as the continuation of that text, as lm-eval scores multiple choice (the whole text encoded
  and cut at the context's length: pipeline/scoring/likelihood.py); the verdict is the likeliest choice. One
  forward pass per choice (the hf engine runs a prompt's one-token choices as one row), nothing generated, nothing
  to parse: every judgment has a verdict.
- `text` (any engine, e.g. a chat API): the judge writes its reply, parsed strictly; an unparsable reply is asked
  once more with a reminder (a reply whose fields are broken is the engine's failure, retried there:
  pipeline/engines/replies.py; characters of a reply that no UTF-8 file can hold arrive as U+FFFD, counted in the
  record's `replaced`).

The cache is append-only JSONL keyed by judge, mode, method, template (with the cue and choices when read from
log-probabilities), prompt, answers and order: a rerun asks nothing, a rerun with the other method asks again;
a failed request is not cached and is asked again next run."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
from dataclasses import dataclass
from typing import Callable

from pipeline.engines import Completion, Engine, GenRequest
from pipeline.engines.replies import encodable
from pipeline.formats.keyed_jsonl import KeyedJsonl
from pipeline.judge.prompts import ANSWER_CUE, CHOICES, REMINDER, load_template, render
from pipeline.judge.scoring import likeliest, parse_grade, parse_verdict

log = logging.getLogger(__name__)


class JudgmentCache(KeyedJsonl):
    """Append-only keyed JSONL of finished judgments; a torn last line (SIGKILL) is dropped and cut off, and
    a line that is not a judgment as Judge._record writes it (edited by hand) is refused with its line."""

    def __init__(self, path):
        super().__init__(path, valid=is_judgment)

    @staticmethod
    def key(*parts) -> str:
        return hashlib.sha256(json.dumps(parts, ensure_ascii=False).encode()).hexdigest()

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put_many(self, entries: list[dict]) -> None:
        self.append(entries)


def is_judgment(entry: dict) -> bool:
    """A finished judgment as Judge writes it: its verdict or grade (or none), the attempts, no error; read from
    log-probabilities (`by: logprobs`), each choice's finite log-probability and the likeliest of them as the
    verdict; from a reply (`by: text`, or no `by`: written before there were two ways), the reply's text (writable
    as UTF-8) and the count of characters replaced."""
    parsed, attempts = entry.get("parsed"), entry.get("attempts")
    if not ((parsed is None or parsed in ("A", "B", "C") or (type(parsed) is int and 1 <= parsed <= 5))
            and type(attempts) is int and attempts in (1, 2) and entry.get("error") is None):
        return False
    if entry.get("by") == "logprobs":
        logprobs = entry.get("logprobs")
        return (isinstance(logprobs, dict) and bool(logprobs) and attempts == 1
                and all(type(v) is float and math.isfinite(v) and v <= 0 for v in logprobs.values())
                and (None if parsed is None else str(parsed)) == likeliest(logprobs))
    texts = [entry.get("raw")] + ([entry["raw_first"]] if "raw_first" in entry else [])
    replaced = entry.get("replaced", 0)
    return (entry.get("by", "text") == "text" and all(isinstance(t, str) and encodable(t)[1] == 0 for t in texts)
            and type(replaced) is int and replaced >= 0)


def choice_requests(tokenizer, encode: Callable[[str], list[int]], context: str,
                    choices) -> list[tuple[list[int], list[int]]]:
    """Each choice as the continuation of `context` (context ids, choice ids), split as lm-eval splits multiple
    choice (pipeline/scoring/likelihood.py: encode_pair), encoded by `encode` (the engine's, as it encodes a prompt
    it generates from). A ValueError when the tokenizer writes a choice into the context's last token: the text
    tokenized whole does not begin with the context's tokens, and the choice cannot be scored apart."""
    from pipeline.scoring.likelihood import encode_pair

    requests = []
    for choice in choices:
        context_ids, choice_ids = encode_pair(tokenizer, context, choice, encode=encode)
        if not choice_ids or context_ids + choice_ids != encode(context + choice):
            raise ValueError(f"the judge's tokenizer joins choice {choice!r} with the end of the prompt "
                             f"{context[-12:]!r} into one token: its log-probability cannot be read apart; use "
                             "judge.scoring: text")
        requests.append((context_ids, choice_ids))
    return requests


@dataclass
class Ask:
    key: str
    messages: list[dict]


class Judge:
    """Sends judge prompts through any Engine; reads each verdict from the choices' log-probabilities (scoring
    "logprobs": the engine must have `token_logprobs`) or from the reply (scoring "text": parsed strictly, an
    unparsable reply asked once more).

    The engine is made on the first cache miss, so a fully cached rerun loads no model and
    sends no request. Judgments that the judge actually gave (parsable or not) are cached;
    failed requests are not, so the next run asks again.
    """

    def __init__(self, engine_factory: Callable[[], Engine], judge_id: str, cache: JudgmentCache, *,
                 mode: str = "pairwise", scoring: str = "text", max_new_tokens: int = 512, chunk: int = 16):
        self._factory, self._engine = engine_factory, None
        self.judge_id, self.cache, self.mode, self.scoring = judge_id, cache, mode, scoring
        self.parse = parse_verdict if mode == "pairwise" else parse_grade
        self.choices, self.cue = CHOICES[mode], ANSWER_CUE[mode]
        self.template = load_template(mode)
        # what the judge is shown: the template and, when its verdict is read from log-probabilities, the cue its
        # reply is begun with and the choices scored after it
        shown = self.template + ("" if scoring == "text" else json.dumps([self.cue, *self.choices]))
        self.template_hash = hashlib.sha256(shown.encode()).hexdigest()[:16]
        self.max_new_tokens, self.chunk = max_new_tokens, chunk
        self.requests = 0  # sent to the engine this run

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = self._factory()
        return self._engine

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None

    def key(self, *parts) -> str:
        return JudgmentCache.key(self.judge_id, self.mode, self.scoring, self.template_hash, *parts)

    def ask_pairwise(self, key: str, question: str, answer_a: str, answer_b: str) -> Ask:
        content = render(self.template, question=question, answer_a=answer_a, answer_b=answer_b)
        return Ask(key, [{"role": "user", "content": content}])

    def ask_reference(self, key: str, question: str, reference: str, answer: str) -> Ask:
        content = render(self.template, question=question, reference=reference, answer=answer)
        return Ask(key, [{"role": "user", "content": content}])

    def judge(self, asks: list[Ask]) -> dict[str, dict]:
        """key -> {"by", "parsed", "attempts", "error", and the reply's "raw" (text) or the choices' "logprobs"} for
        every ask. An engine that keeps its own requests in flight (a server: `in_flight`) gets every ask at once;
        each finished judgment is cached as it arrives."""
        from pipeline.console import progress

        results = {a.key: self.cache.get(a.key) for a in asks if self.cache.get(a.key)}
        todo = list({a.key: a for a in asks if a.key not in results}.values())
        part = self._score_part if self.scoring == "logprobs" else self._judge_part
        with progress(f"judge ({self.mode})", len(todo), "judgments") as advance:
            size = (len(todo) if getattr(self.engine, "in_flight", None) else self.chunk) if todo else 1
            for start in range(0, len(todo), size):
                results.update(part(todo[start:start + size], advance))
        return results

    def _finisher(self, results: dict[str, dict], advance) -> Callable[[dict], None]:
        """What a judgment goes through when it is final: kept in results, cached unless it failed, counted."""
        def final(record: dict) -> None:
            results[record["key"]] = record
            if record["error"] is None:
                self.cache.put_many([record])
            advance(1)

        return final

    def _score_part(self, asks: list[Ask], advance) -> dict[str, dict]:
        """Every ask's choices scored as continuations of its prompt and the judge's cue; each judgment is cached (and
        counted) when its last choice's log-probability arrives. A prompt longer than the judge's context fails (it
        is not cut: its start holds the instructions)."""
        results: dict[str, dict] = {}
        final = self._finisher(results, advance)
        engine = self.engine
        requests, scored = [], []  # (context ids, choice ids), one per choice of each ask; the asks scored
        for ask in asks:
            try:
                pairs = choice_requests(engine.tokenizer, engine.encode,
                                        engine.apply_chat_template(ask.messages) + self.cue, self.choices)
                tokens = max(len(c) + len(x) for c, x in pairs)
                if tokens > engine.max_length:
                    raise ValueError(f"the judge prompt is {tokens} tokens, over the judge's context of "
                                     f"{engine.max_length}")
            except ValueError as exc:
                final({"key": ask.key, "by": "logprobs", "parsed": None, "attempts": 1, "error": str(exc)})
                continue
            requests += pairs
            scored.append(ask)
        self.requests += len(requests)
        logprobs: list[dict[str, float]] = [{} for _ in scored]

        def done(index: int, score: tuple[float, bool]) -> None:
            ask, choice = divmod(index, len(self.choices))
            logprobs[ask][self.choices[choice]] = score[0]
            if len(logprobs[ask]) == len(self.choices):
                final(self._scored(scored[ask].key, {c: logprobs[ask][c] for c in self.choices}))

        self._each(engine.token_logprobs, requests, done)
        return results

    def _scored(self, key: str, logprobs: dict[str, float]) -> dict:
        """A judgment read from its choices' log-probabilities: the likeliest choice (a grade as its number)."""
        record = {"key": key, "by": "logprobs", "logprobs": logprobs, "attempts": 1, "error": None}
        if not all(math.isfinite(v) for v in logprobs.values()):  # no JSON file holds it, no argmax trusts it
            return {**record, "parsed": None, "error": f"a choice's log-probability is not a finite number: {logprobs}"}
        choice = likeliest(logprobs)
        return {**record, "parsed": None if choice is None else int(choice) if self.mode == "reference" else choice}

    def _judge_part(self, asks: list[Ask], advance) -> dict[str, dict]:
        """Every ask judged; an unparsable reply asked once more with a reminder. Each judgment is cached (and
        counted) when it is final: parsed at once, or after its second attempt."""
        results: dict[str, dict] = {}
        final = self._finisher(results, advance)
        retry: list[tuple[Ask, Completion]] = []

        def first_done(i: int, completion: Completion) -> None:
            record = self._record(asks[i].key, completion, attempts=1)
            if record["error"] is None and record["parsed"] is None:
                retry.append((asks[i], completion))
            else:
                final(record)

        self._generate([a.messages for a in asks], first_done)
        again_for = list(retry)

        def second_done(i: int, completion: Completion) -> None:
            ask, old = again_for[i]
            record = self._record(ask.key, completion, attempts=2)
            record["raw_first"] = old.text
            if old.replaced:
                record["replaced"] = record.get("replaced", 0) + old.replaced
            final(record)

        if again_for:
            self._generate([a.messages + [{"role": "assistant", "content": c.text},
                                          {"role": "user", "content": REMINDER[self.mode]}] for a, c in again_for],
                           second_done)
        return results

    def _generate(self, conversations: list[list[dict]], on_done: Callable[[int, Completion], None]) -> None:
        """Each answer passed to on_done(index, completion) as it finishes (at the end of the call, in order, for
        an engine that cannot report each)."""
        requests = [GenRequest(self.engine.apply_chat_template(m), self.max_new_tokens) for m in conversations]
        self.requests += len(requests)
        self._each(self.engine.generate, requests, on_done)

    @staticmethod
    def _each(method: Callable, requests: list, on_done: Callable) -> None:
        """method(requests) of the engine, each result passed to on_done(index, result) as it finishes (at the end
        of the call, in order, for an engine that cannot report each)."""
        if "on_done" in inspect.signature(method).parameters:
            method(requests, on_done=on_done)
            return
        for index, result in enumerate(method(requests)):
            on_done(index, result)

    def _record(self, key: str, completion: Completion, attempts: int) -> dict:
        if completion.error:
            log.warning("judge request failed: %s", completion.error)
        parsed = None if completion.error else self.parse(completion.text)
        record = {"key": key, "by": "text", "raw": completion.text, "parsed": parsed, "attempts": attempts,
                  "error": completion.error}
        if completion.replaced:  # characters of the reply no UTF-8 file can hold, written as U+FFFD
            record["replaced"] = completion.replaced
        return record
