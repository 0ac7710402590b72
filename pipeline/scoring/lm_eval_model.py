"""Our engine, presented to lm-eval as its LM (lm_eval.api.model.LM): lm-eval builds the prompts and scores the
answers; the engine generates (`generate_until`) or scores tokens (`loglikelihood`, `loglikelihood_rolling`:
pipeline/scoring/likelihood.py turns lm-eval's requests into token requests, the same for every engine), and every
finished generation and token score goes through the suite's resume cache (pipeline/scoring/eval_cache.py).

Imports lm-eval: pipeline/stages/evaluate.py imports this module when it first evaluates.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import replace

from lm_eval.api.model import LM

from pipeline.scoring import likelihood
from pipeline.engines import Completion, Engine, GenRequest
from pipeline.errors import UserError
from pipeline.scoring.eval_cache import GenerationCache, score_key


class PipelineLM(LM):
    """Presents any Engine to lm-eval. Generations and token scores go through the resume cache
    one finished item at a time (or per engine call, for an engine that cannot report each).
    on_items(n): n more requests to answer (cached ones included); on_done(n): n of them answered.
    Generations are reported one by one by every engine (hf rows as they stop, the openai and vLLM
    answers as they arrive, lmdeploy's requests as they finish); token scores per engine call of
    batch_size requests, since the rows of one forward pass all finish together.

    An engine that keeps its own requests in flight (a server engine: `in_flight`, pipeline/engines/inflight.py)
    is handed every request of a call at once, and caches each answer and score as it arrives: it keeps
    `in_flight` requests at the server until the last, where handing it `chunk` at a time would let each chunk's
    stragglers hold the next chunk back (waves).

    plan: how the suite generates on this model (pipeline/scoring/generation_plan.py): thinking handed to the chat
    template, and with k samples every request asked once per seed, all at once in the first pass; `sample` is the
    pass, whose answers lm-eval gets."""

    def __init__(self, engine: Engine, cache: GenerationCache, chunk: int, on_done=None, task: str = "",
                 on_items=None, plan=None):
        super().__init__()
        self.engine, self.cache, self.chunk, self.task = engine, cache, chunk, task
        self.plan, self.sample = plan, 0
        self.on_done, self.on_items = on_done or (lambda n: None), on_items or (lambda n: None)
        self.stats: dict[str, Completion] = {}
        self.documents: dict[str, tuple[float, int]] = {}  # rolling requests: text -> (log-likelihood, tokens)
        # wall time inside the engine and what it produced, this run (cached items excluded):
        # per-item seconds are latencies, which overlap on an engine that runs requests concurrently
        self.generate_seconds, self.generated_items, self.generated_tokens = 0.0, 0, 0
        self.scored_requests, self.scored_tokens = 0, 0
        self.first_request_at: float | None = None  # when lm-eval, done building the task, first asked
        self.MULTIMODAL = bool(getattr(engine, "accepts_images", False))  # lm-eval refuses image tasks otherwise

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.engine, "model_dir", self.engine.name))

    @property
    def thinking(self) -> bool | None:
        return self.plan.thinking if self.plan is not None else None

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        tokenizer = getattr(self.engine, "tokenizer", None)
        switch = {} if self.thinking is None else {"enable_thinking": self.thinking}
        if not add_generation_prompt and getattr(tokenizer, "chat_template", None):
            # lm-eval continues a final assistant turn (a task's gen_prefix), as HFLM does
            return tokenizer.apply_chat_template(chat_history, tokenize=False, add_generation_prompt=False,
                                                 continue_final_message=True, **switch)
        return self.engine.apply_chat_template(chat_history, **switch)

    def _requests(self, requests) -> tuple[list[GenRequest], list[GenRequest]]:
        """lm-eval's requests as ours (the plan's thinking), and every one the plan asks: one per seed with k samples."""
        from pipeline.engines.vision import request_from_lm_eval

        asked = [replace(request_from_lm_eval(request.args), thinking=self.thinking) for request in requests]
        if self.plan is None or not self.plan.seeds:
            return asked, asked
        return asked, [replace(r, seed=seed, sampling=self.plan.sampling) for r in asked for seed in self.plan.seeds]

    def generate_until(self, requests) -> list[str]:
        self._asked()
        asked, gen = self._requests(requests)
        todo = [r for r in gen if self.cache.get(r) is None]
        if self.sample == 0:  # later passes read the samples the first generated
            self.on_items(len(gen))
            self.on_done(len(gen) - len(todo))  # read back from the cache
        reports_each = "on_done" in inspect.signature(self.engine.generate).parameters
        size = self._part_size(len(todo))
        for start in range(0, len(todo), size):
            part = todo[start:start + size]
            started = time.perf_counter()
            if reports_each:  # each row cached as it finishes: a kill loses only unfinished rows
                completions = self.engine.generate(part, on_done=lambda i, c, part=part: self._finished(part[i], c))
            else:
                completions = self.engine.generate(part)
                answered = [(r, c) for r, c in zip(part, completions) if not c.error]
                self.cache.put_many([r for r, _ in answered], [c for _, c in answered])
                self.on_done(len(answered))
            self.generate_seconds += time.perf_counter() - started
            self.generated_items += len(part)
            self.generated_tokens += sum(c.n_tokens for c in completions)
            failed = [c.error for c in completions if c.error]
            if failed:  # a request the engine gave up on is not a wrong answer: stop, keep what finished
                raise UserError(f"engine {self.engine.name}: {len(failed)} of {len(part)} requests failed (the "
                                f"first: {failed[0]}); the finished ones are cached, rerun the same command to "
                                "resume once the engine answers")
        if self.plan is not None and self.plan.seeds:  # this pass's sample of each
            asked = [replace(r, seed=self.plan.seeds[self.sample], sampling=self.plan.sampling) for r in asked]
        done = [self.cache.get(r) for r in asked]
        for request, completion in zip(asked, done):
            self.stats[request.prompt] = completion
        return [c.text for c in done]

    def _part_size(self, todo: int) -> int:
        """Requests per engine call: all of them for an engine that keeps its own in flight, else `chunk`."""
        return max(1, todo) if getattr(self.engine, "in_flight", None) else self.chunk

    def _finished(self, request: GenRequest, completion: Completion) -> None:
        if completion.error:  # never cached: a rerun asks again
            return
        self.cache.put(request, completion)
        self.on_done(1)

    # ------------------------------------------------------------ likelihoods (pipeline/scoring/likelihood.py)

    def _asked(self) -> None:
        if self.first_request_at is None:
            from pipeline.engines import STARTS

            self.first_request_at, self.starts_at_first_request = time.perf_counter(), len(STARTS)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        self._asked()
        likelihood.require_scoring(self.engine)
        token_requests = likelihood.loglikelihood_requests(
            self.engine.tokenizer, [r.args[:2] for r in requests], self.engine.max_length, f"task {self.task}")
        return self._scores(token_requests)

    def loglikelihood_rolling(self, requests) -> list[float]:
        self._asked()
        likelihood.require_scoring(self.engine)
        documents = [likelihood.rolling_windows(self.engine.tokenizer, r.args[0], self.engine.max_length)
                     for r in requests]
        scores = iter(self._scores([w for d in documents for w in d.windows]))
        totals = []
        for request, document in zip(requests, documents):
            total = sum(next(scores)[0] for _ in document.windows)
            self.documents[request.args[0]] = (total, document.n_tokens)
            totals.append(total)
        return totals

    def _scored(self, pending: tuple[str, likelihood.TokenRequest], score: tuple[float, bool]) -> None:
        key, request = pending
        self.cache.put_scores([key], [score], [len(request[1])])
        self.on_done(1)

    def _scores(self, token_requests: list[likelihood.TokenRequest]) -> list[tuple[float, bool]]:
        """Scores from the cache, the rest from the engine longest first, cached per engine call."""
        keys = [score_key(*r) for r in token_requests]
        todo: dict[str, likelihood.TokenRequest] = {}
        for key, request in zip(keys, token_requests):
            if self.cache.get_score(key) is None:
                todo.setdefault(key, request)
        pending = list(todo.items())
        self.on_items(len(token_requests))
        self.on_done(len(token_requests) - len(pending))  # cached, or the same request twice
        order = likelihood.longest_first([r for _, r in pending])
        size = self._part_size(len(order))
        for start in range(0, len(order), size):
            part = [pending[i] for i in order[start:start + size]]
            started = time.perf_counter()
            if getattr(self.engine, "in_flight", None):  # each score cached as it arrives
                self.engine.token_logprobs([r for _, r in part], on_done=lambda i, score, part=part: self._scored(
                    part[i], score))
            else:
                scores = self.engine.token_logprobs([r for _, r in part])
                self.cache.put_scores([k for k, _ in part], scores, [len(r[1]) for _, r in part])
                self.on_done(len(part))
            self.generate_seconds += time.perf_counter() - started
            self.scored_requests += len(part)
            self.scored_tokens += sum(len(r[1]) for _, r in part)
        return [self.cache.get_score(key) for key in keys]



def _quiet_git_hash() -> str | None:
    """lm-eval's get_git_commit_hash (the working directory's `git describe --always`, recorded in its results), its
    git's stderr kept off the terminal: lm-eval lets it through, and outside a git checkout every `quantize eval`
    printed "fatal: not a git repository ..." (issue 70.6: library output goes to the stage's log, not the user)."""
    import subprocess

    try:
        done = subprocess.run(["git", "describe", "--always"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def _quiet_lm_eval() -> None:
    import lm_eval.evaluator

    lm_eval.evaluator.get_git_commit_hash = _quiet_git_hash


_quiet_lm_eval()
