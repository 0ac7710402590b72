"""A real HTTP server on 127.0.0.1 that speaks /v1/chat/completions and injects faults on cue.

Each request takes the next action from `script` (then falls back to `default`, a function of
the request body returning the reply text). Actions:
  ("ok", text)                      a good answer
  ("sleep", seconds)                answer only after `seconds` (past the client's timeout)
  ("status", code)                  an HTTP error with a JSON error body
  ("429", retry_after_seconds)      rate limited, with a Retry-After header
  ("malformed", None)               HTTP 200 whose body is not JSON
  ("length", text)                  a good body with finish_reason "length" (cut off)
  ("redirect", url)                 HTTP 307 to url (a moved endpoint)
  ("edit", fn)                      the good body as a dict, passed through fn(body) -> what is sent as JSON
                                    (Python's json: NaN and Infinity as those literals, a lone surrogate
                                    as its "\\ud800" escape): a reply that breaks the API on purpose
Every request is recorded (headers, body, time) so tests can count retries and look for the key.
A reply names the model the request asked for, as a server of that model does; with `served` set, the server serves
that model alone: its /v1/models lists it and every reply names it (a server of another model than the one asked for).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

MAX_SLEEP = 5.0  # a scripted delay never holds a test longer than this


def completion_body(text: str, finish_reason: str = "stop", model: str = "test-judge") -> bytes:
    return json.dumps({
        "id": "chatcmpl-test", "object": "chat.completion", "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": 10, "completion_tokens": max(1, len(text.split()))},
    }).encode()


class ChatServer:
    def __init__(self, default: Callable[[dict], str] | None = None):
        self.script: list[tuple[str, object]] = []
        self.default = default or (lambda body: "Both are fine. [[C]]")
        self.requests: list[dict] = []
        self.served: str | None = None  # the one model it serves (None: whichever a request asks for)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> "ChatServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _next_action(self, body: dict) -> tuple[str, object]:
        with self._lock:
            if self.script:
                return self.script.pop(0)
        return ("ok", self.default(body))

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def do_GET(self):
                if self.path.rstrip("/") == "/v1/models" and server.served:
                    return self._send(200, json.dumps({"object": "list", "data": [
                        {"id": server.served, "object": "model"}]}).encode())
                self._send(404, b'{"error": "not found"}')

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw)
                except ValueError:
                    body = {}
                with server._lock:
                    server.requests.append({"path": self.path, "headers": dict(self.headers),
                                            "raw": raw.decode("utf-8", "replace"), "body": body,
                                            "time": time.monotonic()})
                if self.path.rstrip("/") != "/v1/chat/completions":
                    return self._send(404, b'{"error": "not found"}')
                kind, value = server._next_action(body)
                try:
                    self._act(kind, value, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout): expected

            def _act(self, kind, value, body):
                named = server.served or str(body.get("model"))
                if kind == "sleep":
                    time.sleep(min(float(value), MAX_SLEEP))
                    self._send(200, completion_body(server.default(body), model=named))
                elif kind == "status":
                    echoed = self.headers.get("Authorization", "")  # a careless server echoing the key
                    self._send(int(value), json.dumps({"error": f"server error for {echoed}"}).encode())
                elif kind == "429":
                    self._send(429, b'{"error": "rate limited"}', {"Retry-After": str(value)})
                elif kind == "malformed":
                    self._send(200, b'{"choices": [{"message": ')
                elif kind == "redirect":
                    self._send(307, b"", {"Location": str(value)})
                elif kind == "length":
                    self._send(200, completion_body(str(value), finish_reason="length", model=named))
                elif kind == "edit":
                    self._send(200, json.dumps(value(json.loads(completion_body(server.default(body),
                                                                                model=named)))).encode())
                else:
                    self._send(200, completion_body(str(value), model=named))

            def _send(self, code: int, payload: bytes, headers: dict | None = None):
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(payload)

        return Handler
