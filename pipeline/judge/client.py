"""The judge itself: prompts sent through any engine, strict parsing, one reminded retry of an unparsable
reply (a reply whose fields are broken is the engine's failure, retried there: pipeline/engines/replies.py;
characters of a reply that no UTF-8 file can hold arrive as U+FFFD, counted in the record's `replaced`),
and the judgment cache (append-only JSONL keyed by judge, mode, template, prompt, answers and
order: a rerun asks nothing; a failed request is not cached and is asked again next run)."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from dataclasses import dataclass
from typing import Callable

from pipeline.engines import Completion, Engine, GenRequest
from pipeline.engines.replies import encodable
from pipeline.formats.keyed_jsonl import KeyedJsonl
from pipeline.judge.prompts import REMINDER, load_template, render
from pipeline.judge.scoring import parse_grade, parse_verdict

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
    """A finished judgment as Judge._record writes it: the reply's text (writable as UTF-8), its verdict or
    grade (or none), the attempts, no error, and the count of characters replaced."""
    texts = [entry.get("raw")] + ([entry["raw_first"]] if "raw_first" in entry else [])
    parsed, replaced = entry.get("parsed"), entry.get("replaced", 0)
    return (all(isinstance(t, str) and encodable(t)[1] == 0 for t in texts)
            and (parsed is None or parsed in ("A", "B", "C") or (type(parsed) is int and 1 <= parsed <= 5))
            and type(entry.get("attempts")) is int and entry["attempts"] in (1, 2) and entry.get("error") is None
            and type(replaced) is int and replaced >= 0)


@dataclass
class Ask:
    key: str
    messages: list[dict]


class Judge:
    """Sends judge prompts through any Engine, parses strictly, retries an unparsable reply once.

    The engine is made on the first cache miss, so a fully cached rerun loads no model and
    sends no request. Judgments that the judge actually gave (parsable or not) are cached;
    failed requests are not, so the next run asks again.
    """

    def __init__(self, engine_factory: Callable[[], Engine], judge_id: str, cache: JudgmentCache, *,
                 mode: str = "pairwise", max_new_tokens: int = 512, chunk: int = 16):
        self._factory, self._engine = engine_factory, None
        self.judge_id, self.cache, self.mode = judge_id, cache, mode
        self.parse = parse_verdict if mode == "pairwise" else parse_grade
        self.template = load_template(mode)
        self.template_hash = hashlib.sha256(self.template.encode()).hexdigest()[:16]
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
        return JudgmentCache.key(self.judge_id, self.mode, self.template_hash, *parts)

    def ask_pairwise(self, key: str, question: str, answer_a: str, answer_b: str) -> Ask:
        content = render(self.template, question=question, answer_a=answer_a, answer_b=answer_b)
        return Ask(key, [{"role": "user", "content": content}])

    def ask_reference(self, key: str, question: str, reference: str, answer: str) -> Ask:
        content = render(self.template, question=question, reference=reference, answer=answer)
        return Ask(key, [{"role": "user", "content": content}])

    def judge(self, asks: list[Ask]) -> dict[str, dict]:
        """key -> {"raw", "parsed", "attempts", "error"} for every ask. An engine that keeps its own requests in
        flight (a server: `in_flight`) gets every ask at once; each finished judgment is cached as it arrives."""
        from pipeline.console import progress

        results = {a.key: self.cache.get(a.key) for a in asks if self.cache.get(a.key)}
        todo = list({a.key: a for a in asks if a.key not in results}.values())
        with progress(f"judge ({self.mode})", len(todo), "judgments") as advance:
            size = (len(todo) if getattr(self.engine, "in_flight", None) else self.chunk) if todo else 1
            for start in range(0, len(todo), size):
                results.update(self._judge_part(todo[start:start + size], advance))
        return results

    def _judge_part(self, asks: list[Ask], advance) -> dict[str, dict]:
        """Every ask judged; an unparsable reply asked once more with a reminder. Each judgment is cached (and
        counted) when it is final: parsed at once, or after its second attempt."""
        results: dict[str, dict] = {}

        def final(record: dict) -> None:
            results[record["key"]] = record
            if record["error"] is None:
                self.cache.put_many([record])
            advance(1)

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
        if "on_done" in inspect.signature(self.engine.generate).parameters:
            self.engine.generate(requests, on_done=on_done)
            return
        for index, completion in enumerate(self.engine.generate(requests)):
            on_done(index, completion)

    def _record(self, key: str, completion: Completion, attempts: int) -> dict:
        if completion.error:
            log.warning("judge request failed: %s", completion.error)
        parsed = None if completion.error else self.parse(completion.text)
        record = {"key": key, "raw": completion.text, "parsed": parsed, "attempts": attempts, "error": completion.error}
        if completion.replaced:  # characters of the reply no UTF-8 file can hold, written as U+FFFD
            record["replaced"] = completion.replaced
        return record
