"""An OpenAI-compatible server (vLLM, lmdeploy api_server, llama.cpp server, OpenAI itself).

Three ways to send a prompt, `prompt_format`:
- `tokens` (the default for `quantize eval`): the suite's prompt is rendered by the checkpoint's own
  chat template and tokenizer here and sent to `/v1/completions` as token ids, so the server sees
  exactly the tokens the hf engine would. Needs the checkpoint dir (for its tokenizer).
- `text`: the same rendered prompt, as text, to `/v1/completions` (the server tokenizes it).
- `chat`: the messages to `/v1/chat/completions`; the server applies its own chat template. For a
  judge served elsewhere (whose tokenizer we do not have), or when the user asks for the server's
  template. The eval summary and the report say which format was used.

Images (a VisionRequest, e.g. the VQA suite): `/v1/completions` takes no images, so with `tokens` or
`text` the rendered prompt (image markup in place, rendered here as the hf engine renders it) goes to
`/v1/chat/completions` as one user message, its text part followed by the images as PNG data URLs.
The server must pass that text through unchanged: the vLLM engine starts vLLM with a pass-through
chat template and string content format (`pipeline/engines/vllm.py`), and vLLM, finding one image
placeholder in the text per image, adds none of its own.

Requests run on one asyncio event loop with `concurrency` of them in flight (pipeline/engines/inflight.py: a
pool of exactly that many connections, the next request sent the moment one finishes; with a `load` probe, as
the vLLM engine sets, a request the server lost is noticed within seconds and asked again). Every attempt has
a wall-clock deadline from connect to the last byte and a cap on response bytes (`pipeline/engines/http.py`);
timeouts, connection errors, HTTP 5xx, 429 (honouring Retry-After),
malformed JSON and, when asked, cut-off answers (finish_reason "length") are retried with
exponential backoff and jitter, and so is a reply whose fields are not what the API specifies
(pipeline/engines/replies.py: every field read is checked for type and range: the choice's text, its
finish_reason and token ids, `usage.completion_tokens`). A request that still fails comes back as a
Completion with `error` set, never as an exception: one bad response must not end a stage. Answer text
that no UTF-8 file can hold (a lone surrogate escape) has those characters replaced by U+FFFD, counted
in `Completion.replaced`. The server must serve the model asked for (pipeline/engines/served_model.py): its
`/v1/models` is read before the first request, and every reply's `model` checked; another model stops the stage
(WrongModel, a UserError naming both), never one request. The API key is read
from an environment variable, sent only in the Authorization header and scrubbed from every
error message.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Callable, TypeVar

import pipeline.engines.replies as replies  # not `from pipeline.engines import`: the registry imports this module
from pipeline.checkpoints import checkpoint, config_json
from pipeline.engines.base import Completion, GenRequest, eos_token_ids, to_completion, truncate_at_stop
from pipeline.engines.http import FatalError, Limits, RetryableError, post_json
from pipeline.engines.inflight import LOST_AFTER_S, POLL_S, LoadProbe, Runner, Tracker
from pipeline.engines.sections import PROMPT_FORMATS, OpenAISettings as Settings  # its params section
from pipeline.errors import UserError
from pipeline.engines.served_model import check_listed, check_reply
from pipeline.formats.chat import render_prompt

MAX_RETRY_AFTER = 60.0  # seconds; a server asking for longer is treated as a plain failure after that wait
T = TypeVar("T")


class OpenAIEngine:
    name = "openai"

    def __init__(self, model_dir: Path | str | None, settings: Settings, *, params_section: str = "engine",
                 backoff: float = 1.0, retry_on_length: bool = False, temperature: float = 0.0,
                 extra_body: dict | None = None):
        """settings: where the server is and the client's settings (params.yaml's `engine`, or the judge's own:
        params_section names the section its errors point at); the rest is what the caller adds: the first retry's
        wait (doubling), whether an answer cut at max_tokens is asked again, the sampling temperature, and fields
        a particular server takes in every request (vLLM: return_token_ids)."""
        base_url, model, prompt_format = settings.base_url, settings.model, settings.prompt_format
        if not base_url:
            raise UserError(f"params.yaml: {params_section}.base_url: the openai engine needs the endpoint's base URL, "
                            "e.g. http://127.0.0.1:8000/v1")
        if prompt_format not in PROMPT_FORMATS:
            raise UserError(f"params.yaml: {params_section}.prompt_format: {prompt_format!r}; use one of "
                            f"{', '.join(PROMPT_FORMATS)}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.prompt_format = prompt_format
        self._key = self._read_key(settings.api_key_env, params_section)
        self.concurrency, self.retries = settings.concurrency, settings.retries
        self.limits = Limits(deadline=settings.timeout, max_bytes=settings.max_response_bytes)
        self.backoff, self.retry_on_length, self.temperature = backoff, retry_on_length, temperature
        self.extra_body = dict(extra_body or {})  # server-specific request fields (vLLM: return_token_ids ...)
        self.model_dir = Path(model_dir) if model_dir else None
        self.load: LoadProbe | None = None  # the server's own count of requests it holds (vLLM: /metrics)
        self.lost_after, self.poll = LOST_AFTER_S, POLL_S  # the watchdog's (pipeline/engines/inflight.py)
        self.peak_in_flight = 0  # most requests in flight at once in a generate() call
        self.tokenizer, self.eos_ids, self.vocab_size = None, set(), None
        self.params_section, self.listed_checked = params_section, False
        self.image_markup = None  # a checkpoint with a vision tower: its image markup (lm-eval's image tasks run)
        if prompt_format != "chat":
            if self.model_dir is None or not config_json.present(self.model_dir):
                raise UserError(f"params.yaml: {params_section}.prompt_format: {prompt_format} renders prompts with "
                                "the checkpoint's own tokenizer; pass the checkpoint dir, or use prompt_format: chat")
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            self.eos_ids = eos_token_ids(self.tokenizer, config_json.generation_eos(self.model_dir))
            # token ids a reply may hold: the tokenizer's, or the model's (padded) embedding rows
            self.vocab_size = max(len(self.tokenizer), checkpoint.open(self.model_dir).vocab_size)
            if checkpoint.open(self.model_dir).has_vision:
                from pipeline.engines.vision import image_markup

                self.image_markup = image_markup(self.model_dir, self.tokenizer)

    @property
    def accepts_images(self) -> bool:
        """Whether lm-eval may hand it image tasks: a checkpoint with a vision tower, its prompts rendered here."""
        return self.image_markup is not None

    @property
    def served_model(self) -> str:
        """The name requests carry (`quantize bench` streams to it, as to vLLM's)."""
        return self.model

    @property
    def url(self) -> str:
        return self.base_url + ("/chat/completions" if self.prompt_format == "chat" else "/completions")

    @staticmethod
    def _read_key(env_name: str | None, params_section: str) -> str | None:
        if not env_name:
            return None
        key = os.environ.get(env_name)
        if not key:
            raise UserError(f"params.yaml: {params_section}.api_key_env: environment variable {env_name} is not set; "
                            "export it with the endpoint's API key")
        return key

    def __repr__(self) -> str:  # no key here, ever
        return f"OpenAIEngine(url={self.url!r}, model={self.model!r}, prompt_format={self.prompt_format!r})"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self._key}"} if self._key else {}

    def apply_chat_template(self, messages: list[dict], enable_thinking: bool | None = None) -> str:
        """tokens/text: rendered here by the checkpoint's template; chat: the messages as JSON, for the server (a
        request's thinking goes with it: chat_template_kwargs)."""
        if self.prompt_format == "chat":
            return json.dumps(messages, ensure_ascii=False)
        prompt = render_prompt(self.tokenizer, messages, enable_thinking)
        if self.image_markup is not None:  # lm-eval's image marker as the model's markup, as the hf engine renders it
            from pipeline.engines.vision import render_images

            return render_images(prompt, self.image_markup)
        return prompt

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def close(self) -> None:
        pass  # one HTTP client per generate() call: nothing held between calls

    @property
    def in_flight(self) -> int:
        """Requests this engine keeps in flight itself: callers hand it every request at once (no waves)."""
        return self.concurrency

    def runner(self, attempt, lost) -> Runner:
        """A Runner over this engine's server: `concurrency` in flight, the lost-request watchdog when `load`
        (a probe of the server's own count of requests it holds) is set."""
        self.check_served()
        return Runner(attempt, lost, self.concurrency, load=self.load, server=self.base_url, lost_after=self.lost_after,
                      poll=self.poll)

    def check_served(self) -> None:
        """Once, before the first request: the server's /v1/models lists the model asked for (WrongModel if not)."""
        if not self.listed_checked:
            check_listed(self.base_url, self.model, self.headers, self.limits.deadline, self.params_section,
                         redact=self._redact)
            self.listed_checked = True

    def generate(self, requests: list[GenRequest], on_done=None) -> list[Completion]:
        """on_done(index, completion), if given, is called (in this thread) for each request as its
        answer arrives, while the others are still in flight."""
        runner = self.runner(self._complete, lambda request, why: Completion("", 0, 0.0, error=why))
        completions = runner.run(requests, on_done)
        self.peak_in_flight = max(self.peak_in_flight, runner.peak)
        return completions

    def _is_chat(self, request: GenRequest) -> bool:
        return self.prompt_format == "chat" or bool(getattr(request, "images", None))

    async def _complete(self, http, request: GenRequest, tracker: Tracker | None = None) -> Completion:
        started = time.perf_counter()
        body = self._body(request)
        try:
            choice = await self.call(http, body, chat=self._is_chat(request), tracker=tracker)
        except (FatalError, RetryableError) as exc:
            return Completion("", 0, time.perf_counter() - started, error=str(exc))
        return self._completion(request, choice, time.perf_counter() - started)

    async def call(self, http, body: dict, chat: bool | None = None, read: Callable[[dict], T] | None = None,
                   tracker: Tracker | None = None) -> T:
        """POST to this engine's endpoint with retries; what `read` makes of the answer (default: its first
        choice, every field checked, pipeline/engines/replies.py), or Retryable/FatalError (messages
        scrubbed of the key) once retries are spent. A reply `read` refuses (BadReply) is retried as a
        timeout is. tracker: the watchdog's view of this request (pipeline/engines/inflight.py)."""
        last_error, last_retry_after = "no attempt made", None
        chat = self.prompt_format == "chat" if chat is None else chat
        url = self.base_url + ("/chat/completions" if chat else "/completions")
        read = read or (lambda data: self._read_choice(data, body, chat))
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self._delay(attempt, last_retry_after))
            last_retry_after = None
            if tracker is not None:
                tracker.sending()
            try:
                data = await post_json(http, url, body, self.headers, self.limits,
                                       on_headers=tracker.answered if tracker is not None else None)
                check_reply(data, self.model, self.base_url, self.params_section)  # WrongModel: the stage stops
                return read(data)
            except RetryableError as exc:
                last_error, last_retry_after = self._redact(str(exc)), exc.retry_after
            except FatalError as exc:
                raise FatalError(self._redact(str(exc))) from None
        raise RetryableError(f"gave up after {self.retries + 1} attempts: {last_error}")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, MAX_RETRY_AFTER)
        return self.backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)

    def _body(self, request: GenRequest) -> dict:
        body = {"model": self.model, "max_tokens": request.max_new_tokens, "temperature": self.temperature}
        if request.seed is not None and request.sampling is not None:  # one of a suite's k samples
            sampling = request.sampling
            body.update(seed=request.seed, temperature=sampling.temperature, top_p=sampling.top_p,
                        **({"top_k": sampling.top_k} if sampling.top_k else {}))
        images = getattr(request, "images", None)
        if images and self.prompt_format != "chat":
            from pipeline.engines.vision import image_data_url

            body["messages"] = [{"role": "user", "content": [{"type": "text", "text": request.prompt}] + [
                {"type": "image_url", "image_url": {"url": image_data_url(image)}} for image in images]}]
        elif self.prompt_format == "chat":
            try:
                messages = json.loads(request.prompt)
                if not isinstance(messages, list):
                    raise ValueError
            except ValueError:
                messages = [{"role": "user", "content": request.prompt}]
            body["messages"] = messages
        else:
            body["prompt"] = self.encode(request.prompt) if self.prompt_format == "tokens" else request.prompt
        if self._is_chat(request) and request.thinking is not None:  # the server's template, and its reasoning parser
            body["chat_template_kwargs"] = {"enable_thinking": request.thinking}
        if request.stop and request.thinking is None:  # a reasoning model's stops end its answer, never its reasoning
            body["stop"] = request.stop
        return body | self.extra_body

    def _read_choice(self, data: dict, body: dict, chat: bool) -> replies.Choice:
        choice = replies.completion_choice(data, chat=chat, max_tokens=body.get("max_tokens"),
                                           vocab_size=self.vocab_size)
        if self.retry_on_length and choice.finish_reason == "length":
            raise RetryableError("answer cut off (finish_reason 'length'); raise judge.judge_max_new_tokens")
        return choice

    def _completion(self, request: GenRequest, choice: replies.Choice, seconds: float) -> Completion:
        capped = choice.finish_reason == "length" if choice.finish_reason is not None else None
        if self.prompt_format != "chat" and choice.token_ids is not None:
            # vLLM's return_token_ids: decoded, the reasoning split off and cut at EOS / stop strings as the hf engine does
            done = to_completion(self.tokenizer, request, choice.token_ids, self.eos_ids, seconds, capped=capped)
            done.text, done.reasoning = self._redact(done.text), self._redact(done.reasoning)
            return done
        if request.thinking is None and choice.reasoning is None:
            answer = truncate_at_stop(choice.text, request.stop)
            return Completion(self._redact(answer), choice.completion_tokens or 0, seconds, replaced=choice.replaced,
                              cut="answer" if capped and answer == choice.text else None)
        return self._reasoned(request, choice, seconds, capped)

    def _reasoned(self, request: GenRequest, choice: replies.Choice, seconds: float, capped: bool | None) -> Completion:
        """A reasoning model's reply as text: its reasoning as the server's parser split it (`reasoning`), else split
        here at END_OF_THINKING; its tokens counted by the server (usage), else by the checkpoint's tokenizer."""
        from pipeline.engines.reasoning import START_OF_THINKING, split_text

        if choice.reasoning is not None:
            reasoning, text, closed = choice.reasoning.strip(), choice.text, bool(choice.text) or not capped
        else:
            reasoning, text, closed = split_text(choice.text, request.prompt.rstrip().endswith(START_OF_THINKING))
        answer = truncate_at_stop(text, request.stop)
        thought = choice.reasoning_tokens
        if thought is None and reasoning and self.tokenizer is not None:
            thought = len(self.encode(reasoning)) + 1  # and its closing marker
        cut = None if not capped else "reasoning" if not closed else "answer" if answer == text else None
        return Completion(self._redact(answer), choice.completion_tokens or 0, seconds, replaced=choice.replaced,
                          reasoning=self._redact(reasoning), reasoning_tokens=thought if reasoning else 0, cut=cut,
                          thinking=request.thinking if request.thinking is not None else bool(reasoning))

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "[REDACTED]") if self._key else text

