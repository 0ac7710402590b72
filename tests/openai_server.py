"""A real OpenAI-compatible HTTP server on 127.0.0.1, backed by a real (tiny) transformers model.

It speaks what the pipeline uses of vLLM's API: `/v1/completions` with token-id or text prompts,
`/v1/chat/completions` with image parts (data URLs) for a vision checkpoint (as vLLM does with `--chat-template-content-
format string`: text parts joined, one image placeholder added per image the text does not already mark,
then the server's `--chat-template` applied; streamed or not, its usage counting the prompt with each image's
tokens, as vLLM's does; run as a script, an access-log line per chat request with its images),
greedy decoding, `stream` (server-sent events, one token per event), vLLM's `return_token_ids`,
`ignore_eos` / `min_tokens` and `prompt_logprobs` (log-probability and rank of every prompt token),
plus `/health`, `/version` and `/v1/models`. The answers are the model's own, computed with
transformers' forward pass, so a test can compare them with the hf engine's.

Faults on cue (`server.fault`, every completion request): ("drip", seconds_per_byte) sends the answer one byte
at a time, ("dribble_headers", seconds_per_byte) sends the status line and headers so, ("huge", n_bytes) sends
an oversized answer. Faults for the next requests, one each (`server.faults`, a list): "drop" (the answer is
computed, counted out of the running ones, and never sent: the connection stays open), "never" (the request is
accepted and never read or answered), "close" (the request is read and the connection closed with no reply, as
a kept-alive connection closed under a request). `server.latency` seconds are added to every completion,
outside the model's lock, so requests run side by side as on a batching server; `server.decode_step` seconds
separate a streamed answer's tokens. `/metrics` reports, as vLLM's Prometheus page does,
`vllm:num_requests_running` (requests being answered) and `vllm:num_requests_waiting` (requests waiting for the
model); run as a script the server also logs vLLM's periodic stats line
(`Running: N reqs, Waiting: M reqs`, every --log-stats-interval seconds, the most seen since the last line).
Replies that break the API on purpose (`server.edits`): each /v1/completions request takes the next function
from the list (none left: the reply as it is) and sends fn(reply) as JSON; a streamed request sends fn(event)
for each of its events.

Run as a script it takes `vllm serve`'s command line (`MODEL --host H --port P --served-model-name N
...`; other flags are recorded, not used) so the vLLM engine's process handling can be tested on a
machine without vLLM: the real vLLM server runs on the GPU machine (benchmarks/gpu_vllm.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

VERSION = "0.0-test"


class TinyModel:
    """Greedy decoding and prompt log-probabilities of a checkpoint, one request at a time."""

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if config.get("vision_config"):  # loaded as the hf engine loads it (quantized MoE experts included)
            from pipeline.checkpoints.loading import load_model

            self.model = load_model(Path(model_dir), torch.float32).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        self.lock = threading.Lock()

    def tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return [int(t) for t in prompt]

    def stream(self, ids: list[int], max_tokens: int, ignore_eos: bool, min_tokens: int):
        """Yields generated token ids one by one (greedy, KV cache), stopping after EOS unless ignored."""
        torch = self.torch
        with self.lock, torch.inference_mode():
            past, inputs = None, torch.tensor([ids])
            for step in range(max_tokens):
                out = self.model(input_ids=inputs, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logits = out.logits[0, -1]
                if step < min_tokens or ignore_eos:
                    for eos in self.eos:
                        if eos is not None:
                            logits[eos] = float("-inf")
                token = int(logits.argmax())
                yield token
                if token in self.eos and not ignore_eos:
                    return
                inputs = torch.tensor([[token]])

    def chat_inputs(self, text: str, images: list):
        """A rendered prompt with images as the model takes it: each image token expanded per image grid."""
        from pipeline.engines.vision import ImagePrompter

        return ImagePrompter(self.model_dir, self.tokenizer).encode([text], [images])

    def chat_stream(self, inputs, max_tokens: int, ignore_eos: bool = False, min_tokens: int = 0):
        """Yields greedy token ids for chat_inputs' inputs as the model makes them (transformers' generate in a
        thread, a streamer handing each step's token over), stopping after EOS unless ignored."""
        import queue

        from transformers.generation.streamers import BaseStreamer

        arrived: queue.Queue = queue.Queue()

        class Handover(BaseStreamer):
            prompt_seen = False

            def put(self, value):
                if not self.prompt_seen:  # generate hands the prompt over first
                    self.prompt_seen = True
                    return
                for token in value.reshape(-1).tolist():
                    arrived.put(token)

            def end(self):
                arrived.put(None)

        def run():
            try:
                with self.lock, self.torch.inference_mode():
                    self.model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False, streamer=Handover(),
                                        min_new_tokens=max_tokens if ignore_eos else min_tokens,
                                        pad_token_id=self.tokenizer.pad_token_id)
            finally:
                arrived.put(None)

        threading.Thread(target=run, daemon=True).start()
        while (token := arrived.get()) is not None:
            yield token
            if token in self.eos and not ignore_eos:
                return

    def prompt_logprobs(self, ids: list[int]) -> list[dict | None]:
        torch = self.torch
        with self.lock, torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        result: list[dict | None] = [None]
        for position in range(1, len(ids)):
            row = logprobs[position - 1]
            token = ids[position]
            rank = int((row > row[token]).sum()) + 1
            top = int(row.argmax())
            entry = {str(token): {"logprob": float(row[token]), "rank": rank, "decoded_token": ""}}
            entry.setdefault(str(top), {"logprob": float(row[top]), "rank": 1, "decoded_token": ""})
            result.append(entry)
        return result


class CompletionsServer:
    def __init__(self, model_dir: str | None = None, served_name: str = "model", port: int = 0,
                 chat_template: str | None = None):
        self.model = TinyModel(model_dir) if model_dir else None
        self.chat_template = chat_template  # --chat-template (content format string)
        self.served_name = served_name
        self.requests: list[dict] = []
        self.fault: tuple[str, float] | None = None
        self.edits: list = []  # functions of a reply (or streamed event), one per completion request
        self.die_after: int | None = None  # exit the whole process at this completion request (a crashed engine)
        self.faults: list[str] = []  # "drop" / "never" / "close", one per completion request, in order
        self.latency = 0.0  # seconds added to every completion, outside the model's lock
        self.decode_step = 0.0  # seconds between a streamed answer's tokens (a GPU's decoding step; the tiny model's
        # own is so short that a busy client reads several tokens at once, and their gaps are 0)
        self.log_requests = False  # run as a script: an access-log line per chat request (its images counted)
        self.fake_tokens: int | None = None  # answer with this many of the prompt's ids, the model not run (load tests)
        self.running = self.waiting = 0  # as vLLM's /metrics counts them
        self.peak_running = 0  # most running at once since the last stats line
        self.max_running = 0  # most running at once, ever
        self.hold = threading.Event()  # set at exit: releases the handlers of dropped and never-answered requests
        self._lock = threading.Lock()
        ThreadingHTTPServer.request_queue_size = 2048  # uvicorn's backlog: a burst of connections is not refused
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> "CompletionsServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.hold.set()
        self._server.shutdown()
        self._server.server_close()

    def metrics(self) -> str:
        labels = f'{{engine="0",model_name="{self.served_name}"}}'
        return (f"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{labels} {float(self.running)}\n"
                f"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{labels} {float(self.waiting)}\n")

    def stats_line(self) -> str:
        """vLLM's periodic stats line (its LoggingStatLogger), with the most requests running since the last one."""
        with self._lock:
            running, self.peak_running = max(self.peak_running, self.running), self.running
        return (f"(APIServer pid=1) INFO [loggers.py:123] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg "
                f"generation throughput: 0.0 tokens/s, Running: {running} reqs, Waiting: {self.waiting} reqs, GPU KV "
                "cache usage: 0.0%, Prefix cache hit rate: 0.0%")

    def _count(self, running: int = 0, waiting: int = 0) -> None:
        with self._lock:
            self.running += running
            self.waiting += waiting
            self.peak_running = max(self.peak_running, self.running)
            self.max_running = max(self.max_running, self.running)

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # connections kept alive between requests, as uvicorn (vLLM's server) keeps them

            def log_message(self, *args):
                pass

            def do_GET(self):
                if self.path == "/health":
                    return self._send(200, b"")
                if self.path == "/version":
                    return self._json(200, {"version": VERSION})
                if self.path == "/metrics":
                    return self._send(200, server.metrics().encode(), "text/plain; version=0.0.4")
                if self.path == "/v1/models":
                    return self._json(200, {"data": [{"id": server.served_name, "object": "model"}]})
                self._json(404, {"error": "not found"})

            def do_POST(self):
                with server._lock:
                    fault = server.faults.pop(0) if server.faults and self.path.endswith("/completions") else None
                if fault == "never":  # accepted, never read nor answered
                    server.hold.wait(600)
                    self.close_connection = True
                    return
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if fault == "close":  # the connection closed under the request: no reply at all
                    self.close_connection = True
                    return
                try:
                    body = json.loads(raw)
                except ValueError:
                    return self._json(400, {"error": "body is not JSON"})
                with server._lock:
                    server.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if self.path.rstrip("/") == "/v1/chat/completions":
                    return self._chat(body)
                if self.path.rstrip("/") != "/v1/completions":
                    return self._json(404, {"error": "not found"})
                if server.die_after is not None and len(server.requests) >= server.die_after:
                    print("EngineDeadError: EngineCore encountered an issue (a scripted crash)", flush=True)
                    import os

                    os._exit(4)
                if body.get("model") != server.served_name:
                    return self._json(404, {"error": f"model {body.get('model')!r} does not exist"})
                with server._lock:
                    edit = server.edits.pop(0) if server.edits else (lambda reply: reply)
                try:
                    if body.get("stream"):
                        self._stream(body, edit)
                    else:
                        self._complete(body, edit, drop=fault == "drop")
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def _complete(self, body, edit=lambda reply: reply, drop: bool = False):
                model = server.model
                ids = model.tokens(body["prompt"])
                server._count(running=1)
                try:
                    time.sleep(server.latency)
                    tokens = self._generate(ids, body) if server.fake_tokens is None else [
                        ids[i % len(ids)] for i in range(min(server.fake_tokens, int(body.get("max_tokens") or 16)))]
                    if body.get("prompt_logprobs") is not None:
                        prompt_logprobs = model.prompt_logprobs(ids)
                finally:
                    server._count(running=-1)
                if drop:  # computed, counted out, never sent: the client waits on an open connection
                    server.hold.wait(600)
                    self.close_connection = True
                    return
                text = model.tokenizer.decode([t for t in tokens if t not in model.eos], skip_special_tokens=True)
                choice = {"index": 0, "text": text, "finish_reason": "length" if len(tokens) >= int(
                    body.get("max_tokens") or 16) and tokens[-1] not in model.eos else "stop"}
                if body.get("return_token_ids"):
                    choice["token_ids"], choice["prompt_token_ids"] = tokens, ids
                if body.get("prompt_logprobs") is not None:
                    choice["prompt_logprobs"] = prompt_logprobs
                payload = edit({"id": "cmpl-test", "object": "text_completion", "model": server.served_name,
                                "choices": [choice], "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens)}})
                data = json.dumps(payload).encode()
                if server.fault and server.fault[0] == "huge":
                    pad = " " * int(server.fault[1])
                    payload["choices"][0]["text"] += pad
                    data = json.dumps(payload).encode()
                if server.fault and server.fault[0] == "dribble_headers":
                    head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                            "\r\n").encode()
                    for byte in head:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(float(server.fault[1]))
                    self.wfile.write(data)
                    return
                if server.fault and server.fault[0] == "drip":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    for byte in data:
                        self.wfile.write(bytes([byte]))
                        self.wfile.flush()
                        time.sleep(float(server.fault[1]))
                    return
                self._send(200, data)

            def _generate(self, ids: list[int], body: dict) -> list[int]:
                """The model's tokens (one request at a time: the others count as waiting meanwhile)."""
                server._count(running=-1, waiting=1)  # queued for the model, as vLLM's waiting ones
                started = False
                try:
                    tokens = []
                    for token in server.model.stream(ids, int(body.get("max_tokens") or 16), bool(body.get("ignore_eos")),
                                                     int(body.get("min_tokens") or 0)):
                        if not started:
                            server._count(running=1, waiting=-1)
                            started = True
                        tokens.append(token)
                    return tokens
                finally:
                    if not started:
                        server._count(running=1, waiting=-1)

            def _chat(self, body):
                """vLLM's chat path with content format `string` and the server's chat template: image parts are
                data URLs (what the engines send), decoded to the very pixels and run through the model's vision tower."""
                import base64
                import io

                import jinja2
                from PIL import Image

                model = server.model
                if body.get("model") != server.served_name:
                    return self._json(404, {"error": f"model {body.get('model')!r} does not exist"})
                placeholder = "<|begin_of_image|><|image|><|end_of_image|>"
                messages, images = [], []
                for message in body["messages"]:
                    content = message["content"]
                    if isinstance(content, list):
                        texts = [part["text"] for part in content if part["type"] == "text"]
                        found = [part for part in content if part["type"] == "image_url"]
                        for part in found:
                            data = part["image_url"]["url"].split(",", 1)[1]
                            images.append(Image.open(io.BytesIO(base64.b64decode(data))).convert("RGB"))
                        text = "\n".join(texts)
                        missing = len(found) - text.count(placeholder)
                        if missing < 0:
                            return self._json(400, {"error": f"Found more '{placeholder}' placeholders in input "
                                                             "prompt than actual multimodal data items."})
                        content = "\n".join([placeholder] * missing + [text])
                    messages.append({**message, "content": content})
                template = server.chat_template or model.tokenizer.chat_template
                text = jinja2.Template(template).render(messages=messages, add_generation_prompt=True)
                with server._lock:
                    server.requests[-1]["rendered"] = text
                inputs = model.chat_inputs(text, images)
                prompt_tokens, max_tokens = int(inputs["input_ids"].shape[1]), int(body.get("max_tokens") or 16)
                if server.log_requests:  # a line per request, as uvicorn's access log under `vllm serve`
                    print(f'INFO: 127.0.0.1 - "POST /v1/chat/completions HTTP/1.1" 200 OK ({len(images)} image(s))',
                          flush=True)
                server._count(running=1)  # counted as vLLM's /metrics counts every request it answers
                try:
                    tokens = model.chat_stream(inputs, max_tokens, bool(body.get("ignore_eos")),
                                               int(body.get("min_tokens") or 0))
                    if body.get("stream"):
                        return self._chat_stream(body, tokens, prompt_tokens)
                    tokens = list(tokens)
                finally:
                    server._count(running=-1)
                content = model.tokenizer.decode([t for t in tokens if t not in model.eos], skip_special_tokens=True)
                choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
                if body.get("return_token_ids"):
                    choice["token_ids"] = tokens
                self._json(200, {"id": "chat-test", "object": "chat.completion", "model": server.served_name,
                                 "choices": [choice], "usage": {"prompt_tokens": prompt_tokens,
                                                                "completion_tokens": len(tokens)}})

            def _chat_stream(self, body, tokens, prompt_tokens: int):
                """vLLM's streamed chat: a first chunk with the role, a chunk per token (delta.content, and its id
                with return_token_ids), the finish reason, then the usage when stream_options asks for it."""
                model = server.model
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                head = {"id": "chat-test", "object": "chat.completion.chunk", "model": server.served_name}
                self._event({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "finish_reason": None}]})
                count, last = 0, None
                for token in tokens:
                    count, last = count + 1, token
                    choice = {"index": 0, "delta": {"content": model.tokenizer.decode([token])}, "finish_reason": None}
                    if body.get("return_token_ids"):
                        choice["token_ids"] = [token]
                    self._event({**head, "choices": [choice]})
                finish = "stop" if last in model.eos and not body.get("ignore_eos") else "length"
                self._event({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
                if (body.get("stream_options") or {}).get("include_usage"):
                    self._event({**head, "choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": count,
                                                                  "total_tokens": prompt_tokens + count}})
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True

            def _stream(self, body, edit=lambda event: event):
                model = server.model
                ids = model.tokens(body["prompt"])
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                count = 0
                for token in model.stream(ids, int(body.get("max_tokens") or 16), bool(body.get("ignore_eos")),
                                          int(body.get("min_tokens") or 0)):
                    count += 1
                    choice = {"index": 0, "text": model.tokenizer.decode([token]), "finish_reason": None}
                    if body.get("return_token_ids"):
                        choice["token_ids"] = [token]
                    self._event(edit({"id": "cmpl-test", "object": "text_completion", "model": server.served_name,
                                      "choices": [choice]}))
                    time.sleep(server.decode_step)
                if (body.get("stream_options") or {}).get("include_usage"):
                    self._event(edit({"id": "cmpl-test", "choices": [], "model": server.served_name,
                                      "usage": {"prompt_tokens": len(ids), "completion_tokens": count}}))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()
                self.close_connection = True  # no Content-Length: the end of the stream is the end of the connection

            def _event(self, event):
                self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                self.wfile.flush()

            def _json(self, code, payload):
                self._send(code, json.dumps(payload).encode())

            def _send(self, code: int, payload: bytes, content_type: str = "application/json"):
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

        return Handler


def log_start_figures(model: TinyModel, args, seconds: float) -> None:
    """The start-up lines vLLM 0.24 logs (pipeline/engines/capacity.py reads them), with this model's own
    figures: its weights, and the KV pool of a pretend device of --device-memory-gib at
    --gpu-memory-utilization (or --kv-cache-tokens, or --kv-cache-memory-bytes as vLLM takes it)."""
    config = model.model.config.get_text_config()  # a vision model's text tower holds the KV cache
    weights = sum(p.numel() * p.element_size() for p in model.model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * 4
    pool = max(0, int(args.device_memory_gib * 2**30 * args.gpu_memory_utilization) - weights)
    tokens = args.kv_cache_tokens if args.kv_cache_tokens is not None else pool // per_token // 16 * 16
    if args.kv_cache_tokens is not None:
        pool = tokens * per_token
    planned = args.kv_cache_memory_bytes is not None  # vLLM skips its profiling and logs no available memory
    if planned:
        pool = args.kv_cache_memory_bytes
        tokens = pool // per_token // 16 * 16
    max_len = args.max_model_len or config.max_position_embeddings
    prefix = "(EngineCore_DP0 pid=1) INFO 12-01 10:00:00"
    print(f"{prefix} [gpu_model_runner.py:2602] Model loading took {weights / 2**30:.4f} GiB memory and "
          f"{seconds:.6f} seconds", flush=True)
    if not planned:
        print(f"{prefix} [gpu_worker.py:298] Available KV cache memory: {pool / 2**30:.2f} GiB", flush=True)
    print(f"{prefix} [kv_cache_utils.py:1087] GPU KV cache size: {tokens:,} tokens", flush=True)
    print(f"{prefix} [kv_cache_utils.py:1091] Maximum concurrency for {max_len:,} tokens per request: "
          f"{tokens / max_len:.2f}x", flush=True)


def _log_stats(server: CompletionsServer, interval: float) -> None:
    """vLLM logs its stats line every VLLM_LOG_STATS_INTERVAL seconds while it has had work since the last one."""
    while True:
        time.sleep(interval)
        if server.peak_running or server.running or server.waiting:
            print(server.stats_line(), flush=True)


def main(argv: list[str] | None = None) -> None:
    """`vllm serve`'s command line: MODEL --host H --port P --served-model-name N [other flags recorded]."""
    parser = argparse.ArgumentParser()
    parser.add_argument("serve", nargs="?")  # `... serve MODEL` or `... MODEL`
    parser.add_argument("model", nargs="?")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="model")
    parser.add_argument("--record", default=None, help="write the full command line here as JSON")
    parser.add_argument("--fail-start", action="store_true", help="exit with an error before listening")
    parser.add_argument("--die-after", type=int, default=None, help="exit at this completion request")
    parser.add_argument("--chat-template", default=None)
    parser.add_argument("--chat-template-content-format", default="auto")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--device-memory-gib", type=float, default=1.0, help="the pretend device's memory")
    parser.add_argument("--kv-cache-tokens", type=int, default=None, help="pretend the KV pool holds this many tokens")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="the KV pool's bytes (vLLM's flag)")
    parser.add_argument("--start-delay", type=float, default=0.0, help="seconds to sleep before listening")
    parser.add_argument("--latency", type=float, default=0.0, help="seconds added to every completion, side by side")
    parser.add_argument("--decode-step", type=float, default=0.0, help="seconds between a streamed answer's tokens")
    parser.add_argument("--fake-tokens", type=int, default=None, help="answer with this many prompt ids, no model run")
    parser.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between vLLM's stats lines")
    args, rest = parser.parse_known_args(argv)
    model = args.model or args.serve
    if args.record:
        Path(args.record).write_text(json.dumps(sys.argv[1:] if argv is None else argv))
    print(f"test server for {model}, flags {rest}", flush=True)
    if args.fail_start:
        print("RuntimeError: no CUDA device (a scripted start failure)", flush=True)
        sys.exit(3)
    started = time.perf_counter()
    server = CompletionsServer(model, args.served_model_name, args.port, chat_template=args.chat_template)
    server.die_after, server.latency, server.fake_tokens = args.die_after, args.latency, args.fake_tokens
    server.decode_step = args.decode_step
    server.log_requests = True
    log_start_figures(server.model, args, time.perf_counter() - started)
    threading.Thread(target=_log_stats, args=(server, args.log_stats_interval), daemon=True).start()
    time.sleep(args.start_delay)
    print(f"listening on {server.base_url}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    from warm_servers import run_there  # this folder is sys.path[0]: the script's own

    code = run_there()  # in a child of the test process's warm interpreter (tests/warm_servers.py), when one answers
    sys.exit(code) if code is not None else main()
