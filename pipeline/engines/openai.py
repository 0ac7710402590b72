"""An OpenAI-compatible chat-completions endpoint (OpenAI, vLLM, lmdeploy api_server, llama.cpp server).

Requests run on a thread pool. Timeouts, connection errors, HTTP 5xx, 429 (honouring
Retry-After), malformed JSON and, when asked, cut-off answers (finish_reason "length") are
retried with exponential backoff and jitter. A request that still fails comes back as a
Completion with `error` set, never as an exception: one bad response must not end a stage.
The API key is read from an environment variable, sent only in the Authorization header and
scrubbed from every error message.
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor

from pipeline.engines import Completion, GenRequest
from pipeline.errors import UserError

MAX_RETRY_AFTER = 60.0  # seconds; a server asking for longer is treated as a plain failure after that wait


class RetryableError(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class FatalError(Exception):
    """A client error (4xx other than 408, 409, 429): not retried."""


class OpenAIEngine:
    name = "openai"

    def __init__(self, *, base_url: str, model: str, api_key_env: str | None = None, concurrency: int = 4,
                 timeout: float = 60.0, retries: int = 3, backoff: float = 1.0, retry_on_length: bool = False,
                 temperature: float = 0.0, params_section: str = "judge", **_ignored):
        if not base_url:
            raise UserError(f"params.yaml: {params_section}.base_url: the openai engine needs the endpoint's base URL, "
                            "e.g. http://127.0.0.1:8000/v1")
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model = model
        self._key = self._read_key(api_key_env, params_section)
        self.concurrency, self.timeout, self.retries = max(1, concurrency), timeout, max(0, retries)
        self.backoff, self.retry_on_length, self.temperature = backoff, retry_on_length, temperature

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
        return f"OpenAIEngine(url={self.url!r}, model={self.model!r})"

    def apply_chat_template(self, messages: list[dict]) -> str:
        """The server applies its own template: the 'rendered' prompt is the messages as JSON."""
        return json.dumps(messages, ensure_ascii=False)

    def close(self) -> None:
        pass  # one HTTP client per generate() call: nothing held between calls

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        import httpx

        with httpx.Client(timeout=self.timeout) as client, ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda r: self._complete(client, r), requests))

    def _complete(self, client, request: GenRequest) -> Completion:
        started = time.perf_counter()
        last_error, last_retry_after = "no attempt made", None
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self._delay(attempt, last_retry_after))
            last_retry_after = None
            try:
                text, n_tokens = self._post(client, request)
                return Completion(self._redact(text), n_tokens, time.perf_counter() - started)
            except RetryableError as exc:
                last_error, last_retry_after = self._redact(str(exc)), exc.retry_after
            except FatalError as exc:
                return Completion("", 0, time.perf_counter() - started, error=self._redact(str(exc)))
        return Completion("", 0, time.perf_counter() - started,
                          error=f"gave up after {self.retries + 1} attempts: {last_error}")

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(retry_after, MAX_RETRY_AFTER)
        return self.backoff * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)

    def _post(self, client, request: GenRequest) -> tuple[str, int]:
        import httpx

        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        try:
            response = client.post(self.url, json=self._body(request), headers=headers)
        except httpx.TimeoutException:
            raise RetryableError(f"no answer within {self.timeout} s") from None
        except httpx.TransportError as exc:
            raise RetryableError(f"connection failed: {type(exc).__name__}: {exc}") from None
        if response.status_code == 429:
            raise RetryableError("HTTP 429 (rate limited)", _retry_after(response.headers.get("retry-after")))
        if response.status_code >= 500 or response.status_code in (408, 409):
            raise RetryableError(f"HTTP {response.status_code}: {response.text[:200]}")
        if response.status_code >= 400:
            # a bad key or model name will not get better by asking again
            raise FatalError(f"HTTP {response.status_code}: {response.text[:200]}")
        return self._parse(response.text)

    def _body(self, request: GenRequest) -> dict:
        try:
            messages = json.loads(request.prompt)
            if not isinstance(messages, list):
                raise ValueError
        except ValueError:
            messages = [{"role": "user", "content": request.prompt}]
        body = {"model": self.model, "messages": messages, "max_tokens": request.max_new_tokens,
                "temperature": self.temperature}
        if request.stop:
            body["stop"] = request.stop
        return body

    def _parse(self, body: str) -> tuple[str, int]:
        try:
            data = json.loads(body)
            choice = data["choices"][0]
            text = choice["message"]["content"]
            if not isinstance(text, str):
                raise TypeError("content is not a string")
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise RetryableError(f"malformed response ({type(exc).__name__}): {body[:200]!r}") from None
        if self.retry_on_length and choice.get("finish_reason") == "length":
            raise RetryableError("answer cut off (finish_reason 'length'); raise judge.judge_max_new_tokens")
        n_tokens = (data.get("usage") or {}).get("completion_tokens") or 0
        return text, int(n_tokens)

    def _redact(self, text: str) -> str:
        return text.replace(self._key, "[REDACTED]") if self._key else text


def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP-date: fall back to our own backoff
