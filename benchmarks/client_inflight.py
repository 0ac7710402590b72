"""Which HTTP client keeps `engine.batch_size` requests in flight: measured side by side, in one run, against one
server (issue 42, item 1).

Four clients send the same requests (/v1/completions, token-id prompts, greedy, `max_tokens` each) with the same
concurrency:
- `threads, httpx.Client()`: what the engines did before issue 42: a thread pool of `concurrency` over one shared
  client with httpx's default pool (100 connections, 20 kept alive);
- `threads, sized pool`: the same threads over an httpx client whose pool holds `concurrency` connections;
- `asyncio, httpx`: one event loop, a semaphore of `concurrency`, httpx's AsyncClient with that many connections;
- `asyncio, aiohttp (ours)`: pipeline/engines/inflight.py: the same loop and semaphore over an aiohttp connector
  of that many connections (what the vLLM and OpenAI engines use now).
While each runs, the server's own count of requests it holds (vLLM's /metrics: vllm:num_requests_running) is
read every 0.2 s; the table gives items/s and the most the server held at once.

On the CPU (`--tiny`): tests/openai_server.py answering every request after `--latency` seconds, side by side,
without running its model (`--fake-tokens`): what is measured is the client, not the test server's model. On the
GPU machine: `--url` of a running vLLM server and `--model-dir` of the checkpoint it serves (its tokenizer
renders the GSM8K prompts).

    python benchmarks/client_inflight.py --tiny [--requests 512 --concurrency 256 --latency 1.0]
    python benchmarks/client_inflight.py --url http://127.0.0.1:PORT --model-dir models/base [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]


class ServerWatch:
    """Reads the server's running-request gauge every 0.2 s in a thread; `peak` is the most seen."""

    def __init__(self, root: str):
        self.url, self.peak, self._stop = root.rstrip("/") + "/metrics", 0, threading.Event()

    def __enter__(self):
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _watch(self):
        import httpx

        with httpx.Client(timeout=2.0) as http:
            while not self._stop.wait(0.2):
                try:
                    text = http.get(self.url).text
                except httpx.HTTPError:
                    continue
                found = re.findall(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.eE+-]+)", text, re.MULTILINE)
                if found:
                    self.peak = max(self.peak, int(sum(float(v) for v in found)))


def bodies(model_dir: Path, n: int, max_tokens: int) -> list[dict]:
    """GSM8K questions rendered with the checkpoint's chat template, as token ids (what the math suite sends)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [json.loads(line) for line in (REPO / "evals" / "math" / "gsm8k_test.jsonl").read_text().splitlines()]
    out = []
    for i in range(n):
        text = tokenizer.apply_chat_template([{"role": "user", "content": rows[i % len(rows)]["question"]}],
                                             tokenize=False, add_generation_prompt=True)
        out.append({"model": "model", "prompt": tokenizer(text, add_special_tokens=False)["input_ids"],
                    "max_tokens": max_tokens, "temperature": 0.0})
    return out


def threads(url: str, jobs: list[dict], concurrency: int, sized: bool) -> int:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency) if sized else None
    with (httpx.Client(limits=limits) if sized else httpx.Client()) as http, ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda body: http.post(url, json=body, timeout=600).status_code, jobs))
    return sum(code == 200 for code in answers)


def httpx_async(url: str, jobs: list[dict], concurrency: int) -> int:
    import httpx

    async def send_all() -> list[int]:
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits, timeout=600) as http:
            async def one(body: dict) -> int:
                async with gate:
                    return (await http.post(url, json=body)).status_code
            return list(await asyncio.gather(*(one(body) for body in jobs)))

    return sum(code == 200 for code in asyncio.run(send_all()))


def ours(url: str, jobs: list[dict], concurrency: int) -> int:
    from pipeline.engines.http import Limits, post_json
    from pipeline.engines.inflight import Runner

    async def attempt(http, body, tracker):
        tracker.sending()
        await post_json(http, url, body, {}, Limits(deadline=600), on_headers=tracker.answered)
        return True

    return sum(Runner(attempt, lambda body, why: False, concurrency).run(jobs))


def measure(root: str, jobs: list[dict], concurrency: int) -> list[dict]:
    url = root.rstrip("/") + "/v1/completions"
    clients = [("threads, httpx.Client()", lambda: threads(url, jobs, concurrency, sized=False)),
               ("threads, sized pool", lambda: threads(url, jobs, concurrency, sized=True)),
               ("asyncio, httpx", lambda: httpx_async(url, jobs, concurrency)),
               ("asyncio, aiohttp (ours)", lambda: ours(url, jobs, concurrency))]
    rows = []
    for name, send in clients:
        with ServerWatch(root) as watch:
            started = time.perf_counter()
            answered = send()
            seconds = time.perf_counter() - started
        rows.append({"client": name, "requests": len(jobs), "answered": answered, "concurrency": concurrency,
                     "seconds": round(seconds, 2), "items_per_s": round(answered / seconds, 2),
                     "server_peak_running": watch.peak})
    return rows


def tiny_server(latency: float):
    import subprocess

    from tiny import save_tiny_llama

    model = Path("/tmp/client-inflight-model")
    if not (model / "config.json").exists():
        save_tiny_llama(model)
    port = 18731
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "openai_server.py"), str(model), "--port", str(port),
                             "--latency", str(latency), "--fake-tokens", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    from pipeline.engines.http import get_ok

    deadline = time.monotonic() + 120
    while not get_ok(f"http://127.0.0.1:{port}/health") and time.monotonic() < deadline:
        time.sleep(0.5)
    return proc, f"http://127.0.0.1:{port}", model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU: tests/openai_server.py with a tiny model")
    parser.add_argument("--url", help="a running vLLM server (http://HOST:PORT)")
    parser.add_argument("--model-dir", type=Path, help="the checkpoint it serves (its tokenizer renders the prompts)")
    parser.add_argument("--requests", type=int, default=None, help="default: 512 (--tiny), 1319 (GSM8K)")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 2 (--tiny), 128")
    parser.add_argument("--latency", type=float, default=1.0, help="--tiny: seconds per request at the server")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    proc = None
    if args.tiny:
        proc, root, model_dir = tiny_server(args.latency)
    elif args.url and args.model_dir:
        root, model_dir = args.url, args.model_dir
    else:
        parser.error("--tiny, or --url with --model-dir")
    try:
        jobs = bodies(model_dir, args.requests or (512 if args.tiny else 1319), args.max_tokens or (2 if args.tiny else 128))
        rows = measure(root, jobs, args.concurrency)
    finally:
        if proc is not None:
            proc.terminate()
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "tiny": args.tiny, "rows": rows}, indent=1))
    print("\n| client | requests | concurrency | s | items/s | most running at the server |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['client']} | {r['answered']}/{r['requests']} | {r['concurrency']} | {r['seconds']} | "
              f"{r['items_per_s']} | {r['server_peak_running']} |")


if __name__ == "__main__":
    main()
