"""What `quantize bench` sends and how it measures it (pipeline/stages/bench.py is the stage): the workloads (fixed
lengths of real text; the held-out conversations' real lengths; for a model with a vision tower, requests with
images), a closed-loop level at a concurrency and an open-loop level at a Poisson request rate, their latency
metrics and goodput against the SLOs, and a server engine's requests timed over HTTP with streamed
`/v1/completions` (requests with images: streamed `/v1/chat/completions`, the images as PNG data URLs)."""

from __future__ import annotations

import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.engines import Timing
from pipeline.errors import UserError
from pipeline.settings import suites as registry

log = logging.getLogger(__name__)
STATS = ("mean", "median", "p90", "p99")


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    output_tokens: list[int]
    images: list | None = None  # per prompt its PromptImages (pipeline/engines/vision.py): a workload with images
    facts: dict = field(default_factory=dict)  # what bench.json states of it beside its levels (image_workload)

    def take(self, n: int) -> tuple[list[list[int]], list[int]]:
        """n requests, cycling through the workload's prompts."""
        picks = [i % len(self.prompts) for i in range(n)]
        return [self.prompts[i] for i in picks], [self.output_tokens[i] for i in picks]

    def images_of(self, n: int) -> dict:
        """The images of the n requests `take(n)` gives, as timed_generate's keyword (none: {})."""
        return {"images": [self.images[i % len(self.prompts)] for i in range(n)]} if self.images else {}


def fixed_workload(encode, input_len: int, output_len: int, n: int = 64, configured=()) -> Workload:
    """n different windows of real text, each exactly input_len tokens (`configured`: the run's suites,
    pipeline/settings/suites.py bench_suites)."""
    text = registry.bench_file("text", configured)  # the long text a suite declares for the bench (the long-context book)
    tokens = encode(text.read_text(encoding="utf-8"))
    if len(tokens) < input_len + n:
        raise UserError(f"{text}: too short for {input_len}-token prompts")
    stride = max(1, (len(tokens) - input_len) // n)
    return Workload("fixed", [tokens[i * stride:i * stride + input_len] for i in range(n)], [output_len] * n)


def holdout_workload(engine, holdout: Path, max_output: int, context: int | None, max_prompts: int = 64) -> Workload:
    """The held-out prompts (conversations ending with the user's turn, pipeline/formats/holdout.py),
    each answered with as many tokens as the real reply (`reference`) had, capped at max_output;
    conversations without a reply (the log ended on the user's turn) or longer than the context are
    left out."""
    from pipeline.formats.holdout import read_holdout

    prompts, lengths = [], []
    for record in read_holdout(holdout, limit=max_prompts, purpose="held-out conversations"):
        if not record.get("reference"):
            continue  # the log ended on the user's turn: no real reply to take the length from
        prompt = engine.encode(engine.apply_chat_template(record["messages"]))
        length = max(2, min(max_output, len(engine.encode(record["reference"]))))
        if context is None or len(prompt) + length <= context:
            prompts.append(prompt)
            lengths.append(length)
    if not prompts:
        raise UserError(f"{holdout}: no held-out conversation with a real reply fits the model's {context}-token "
                        "context; set bench.holdout: false")
    return Workload("holdout", prompts, lengths)


def image_label(count: int) -> str:
    """"1 image", "4 images": how the report names an image workload's load."""
    return f"{count} image{'s' if count != 1 else ''}"


def image_workload(engine, model_dir: Path, fixed: Workload, per_request: int, image_size: int | None,
                   context: int | None, configured=()) -> Workload:
    """Requests with `per_request` images each, as a deployer's client sends them: one user turn holding the fixed
    workload's text (its input_len tokens of real text, decoded) as the context, the images and the question of the
    run's suites with images (`suite_images`: each suite's images at the size it scored them, or scaled to `image_size`
    pixels on their longest side), rendered by the checkpoint's chat template with the model's image markup, each
    answered with as many tokens as the fixed workload's requests. Each image takes the tokens the model's own
    processor gives it (grid t*h*w / merge^2, pipeline/engines/vision.py: image_tokens), so a request's prompt is its
    text tokens plus those (`facts`: over the workload's distinct prompts, and per suite its images' sizes and tokens;
    the KV tokens per request are taken from the requests measured, `kv_tokens`). Refused (UserError) when a request
    does not fit the context."""
    from pipeline.checkpoints import checkpoint
    from pipeline.engines.vision import PromptImages, image_markup, load_image_processor, render_images

    needed = len(fixed.prompts) * per_request
    sources = image_sources(configured)
    items = suite_images(-(-needed // max(1, len(sources))), image_size, load_image_processor(model_dir), configured)
    markup = image_markup(model_dir, engine.tokenizer)
    image_token_id = checkpoint.open(model_dir).config["image_token_id"]
    prompts, images, used, text_tokens = [], [], [], []
    for index, context_ids in enumerate(fixed.prompts):
        picked = [items[(index * per_request + k) % len(items)] for k in range(per_request)]
        content = engine.tokenizer.decode(context_ids) + "\n" + "<image>" * per_request + "\n" + picked[0]["question"]
        text = render_images(engine.apply_chat_template([{"role": "user", "content": content}]), markup)
        ids = engine.encode(text)
        if ids.count(image_token_id) != per_request:
            raise UserError(f"{model_dir}: its tokenizer does not keep the image markup {markup!r} as tokens "
                            f"({ids.count(image_token_id)} image tokens for {per_request} images); requests with "
                            "images cannot be built for it: set bench.images: []")
        tokens = len(ids) - per_request + sum(item["tokens"] for item in picked)
        prompts.append(ids)
        images.append(PromptImages(tuple(i["image"] for i in picked), tuple(i["url"] for i in picked), text, tokens))
        used += picked
        text_tokens.append(len(ids) - per_request)
    output_len = fixed.output_tokens[0]
    refuse_beyond_context(model_dir, per_request, max(i.prompt_tokens for i in images), max(i["tokens"] for i in used),
                          image_size, output_len, context)
    sizes = {tuple(item["image"].size) for item in used}
    facts = {"label": image_label(per_request), "images_per_request": per_request,
             "image_size": list(next(iter(sizes))) if len(sizes) == 1 else None,
             "image_tokens_per_image": _whole(sum(item["tokens"] for item in used) / len(used)),
             "image_tokens_rule": "the model's image processor: grid t*h*w / merge^2 per image",
             "images_from": ("the visual suites' items at the sizes they were scored at" if image_size is None else
                             f"the visual suites' items scaled to {image_size} pixels on their longest side"),
             "image_sizes": _sizes_by_suite(used),
             "text_tokens_mean": _whole(sum(text_tokens) / len(text_tokens)),
             "prompt_tokens_mean": _whole(sum(i.prompt_tokens for i in images) / len(images))}
    return Workload(image_label(per_request).replace(" ", "-"), prompts, [output_len] * len(prompts), images, facts)


def image_sources(configured=()) -> list:
    """The suites whose items carry images (`registry.bench_suites`: the run's own, `configured`, else the shipped
    ones), in params.yaml's order: those that hand the bench their items (their hooks' bench_images: the generated
    visual suites, evals/visual/) and those that declare a file of them (metadata.suite.bench.images: VQA's)."""
    found = registry.bench_suites("images", configured)
    if not found:
        raise UserError(f"no suite under {registry.EVALS_DIR} with `needs: [images]` hands the bench its items (a hooks "
                        "module's bench_images, or metadata.suite.bench.images); requests with images cannot be built: "
                        "set bench.images: []")
    return found


def suite_images(per_suite: int, image_size: int | None, processor, configured=()) -> list[dict]:
    """Up to `per_suite` items of each suite with images (`image_sources`), taken in turn (one of each suite, then the
    next of each): {"suite", "question", "image" (PIL, at the suite's own size, or scaled so that its longest side is
    `image_size`), "url" (its PNG data URL: lossless, the server decodes these very pixels), "tokens" (the image tokens
    the model's processor gives it)}."""
    import json
    from itertools import zip_longest

    from PIL import Image

    from pipeline.engines.vision import image_data_url, image_tokens

    groups = []
    for suite in image_sources(configured):
        if hook := suite.hook("bench_images"):
            groups.append(hook(per_suite))
            continue
        path = suite.bench["images"]
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        group = []
        for row in rows[:per_suite]:
            with Image.open(path.parent / row["image"]) as shipped:
                group.append({"image": shipped.convert("RGB"), "question": row["question"], "suite": suite.name})
        groups.append(group)
    items = [item for turn in zip_longest(*groups) for item in turn if item is not None]
    for item in items:
        image = item["image"]
        if image_size is not None:
            scale = image_size / max(image.size)
            image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                                 Image.BICUBIC)
        item.update(image=image, url=image_data_url(image), tokens=image_tokens(processor, [image])[0])
    return items


def _sizes_by_suite(items: list[dict]) -> dict:
    """Per suite the images a workload sent: how many, their distinct sizes and their tokens per image."""
    out: dict[str, dict] = {}
    for suite in dict.fromkeys(item["suite"] for item in items):
        own = [item for item in items if item["suite"] == suite]
        tokens = [item["tokens"] for item in own]
        out[suite] = {"images": len(own), "sizes": [list(size) for size in sorted({item["image"].size for item in own})],
                      "tokens_per_image": {"min": min(tokens), "mean": _whole(sum(tokens) / len(tokens)),
                                           "max": max(tokens)}}
    return out


def refuse_beyond_context(model_dir: Path, per_request: int, prompt_tokens: int, per_image: int,
                          image_size: int | None, output_len: int, context: int | None) -> None:
    """A request with images whose prompt and output do not fit the model's context: UserError naming the settings."""
    if context is not None and prompt_tokens + output_len > context:
        sent = "at the suites' own sizes" if image_size is None else f"at bench.image_size {image_size}"
        raise UserError(f"bench.images: a request with {per_request} images ({prompt_tokens} prompt tokens: each image "
                        f"{per_image} tokens {sent}) + --output-len {output_len} exceeds {model_dir}'s "
                        f"{context}-token context; set a smaller bench.image_size or take {per_request} out of "
                        "bench.images")


def check_image_requests(model_dir: Path, counts: list[int], image_size: int | None, input_len: int, output_len: int,
                         context: int | None, configured=()) -> None:
    """Before any weight loads: the checkpoint's image processor must load, and the image workloads' requests, counted
    at their least (input_len text tokens and, for each image, the fewest tokens an image of the suites takes at
    image_size; image_workload checks each request in full), must fit the context; else a UserError saying what to
    change."""
    from pipeline.engines.vision import load_image_processor

    if not counts:
        return
    try:
        processor = load_image_processor(model_dir)
    except ValueError as exc:  # no preprocessor_config.json, or a processor transformers lacks
        raise UserError(f"{exc}; or measure without images: bench.images: [] (--images none)") from None
    per_image = min(item["tokens"] for item in suite_images(1, image_size, processor, configured))
    most = max(counts)
    if context is not None:
        refuse_beyond_context(model_dir, most, input_len + most * per_image, per_image, image_size, output_len,
                              context)


def _whole(value: float) -> float | int:
    """A mean that is a whole number as an int (every image the same size: its tokens per image, exactly)."""
    return int(value) if float(value).is_integer() else round(value, 1)


def kv_tokens(workload: dict) -> tuple[float | int | None, bool]:
    """KV-cache tokens one request of a measured workload holds at its end, and whether the server counted its
    prompt: the server's own count (usage.prompt_tokens) where every level reports it, else as measured here (the
    image tokens by the model's processor), plus its output."""
    levels = workload["levels"]
    if not levels:
        return None, False
    output = sum(level["output_tokens_mean"] for level in levels) / len(levels)
    served = [level.get("server_prompt_tokens_mean") for level in levels]
    counted_by_server = None not in served
    prompt = served if counted_by_server else [level["input_tokens_mean"] for level in levels]
    return _whole(round(sum(prompt) / len(prompt) + output, 1)), counted_by_server


def distribution(values: list[float]) -> dict | None:
    """Mean, median, p90 and p99 (numpy's linear interpolation, as vLLM's bench computes them)."""
    import numpy as np

    if not values:
        return None
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), "median": float(np.percentile(array, 50)),
            "p90": float(np.percentile(array, 90)), "p99": float(np.percentile(array, 99))}


def meets_slo(timing: Timing, slo: dict) -> bool:
    checks = {"ttft_ms": timing.ttft * 1000, "tpot_ms": (timing.tpot or 0.0) * 1000, "e2el_ms": timing.seconds * 1000}
    return all(checks[name] <= limit for name, limit in slo.items() if limit is not None)


def level_metrics(timings: list[Timing], wall: float, slo: dict | None = None, **label) -> dict:
    """The figures of one level (a concurrency or a request rate) from its requests' timings."""
    good = [t for t in timings if t.error is None]
    if not good:
        raise UserError(f"every request failed at {label}: {timings[0].error}")
    ms = lambda values: distribution([1000 * v for v in values])  # noqa: E731
    ttft, tpot = ms([t.ttft for t in good]), ms([t.tpot for t in good if t.tpot is not None])
    generated = sum(t.n_tokens for t in good)
    slo = {k: v for k, v in (slo or {}).items() if v is not None}
    served = [t.server_prompt_tokens for t in good]
    return {
        **label, "requests": len(timings), "failed": len(timings) - len(good),
        "input_tokens_mean": sum(t.input_tokens for t in good) / len(good),
        # the server's own count of each prompt (usage.prompt_tokens), where it reports it for every request
        **({"server_prompt_tokens_mean": sum(served) / len(served)} if None not in served else {}),
        "output_tokens_mean": generated / len(good),
        "ttft_ms": ttft, "tpot_ms_stats": tpot, "itl_ms": ms([gap for t in good for gap in t.itl]),
        "e2el_ms": ms([t.seconds for t in good]),
        # the figures the speed table and the verdict read
        "ttft_p50_ms": ttft["median"], "ttft_p90_ms": ttft["p90"], "tpot_ms": tpot["mean"] if tpot else None,
        "output_tokens_per_s": generated / wall, "requests_per_s": len(good) / wall,
        "goodput_requests_per_s": sum(meets_slo(t, slo) for t in good) / wall if slo else None,
        "slo": slo or None, "wall_s": wall,
    }


def sweep_level(engine, workload: Workload, concurrency: int, requests: int, slo: dict | None = None) -> dict:
    """Closed loop: `requests` requests, at most `concurrency` in flight."""
    from pipeline.console import progress

    prompts, outputs = workload.take(requests)
    with progress(f"bench {workload.name} c={concurrency}", requests, "requests") as advance:
        engine.progress = advance  # each engine reports finished requests (hf: finished batches)
        started = time.perf_counter()
        timings = engine.timed_generate(prompts, outputs, concurrency, **workload.images_of(requests))
        wall = time.perf_counter() - started
        engine.progress = None
    level = level_metrics(timings, wall, slo, concurrency=concurrency)
    level["memory_bytes"] = engine.device_memory_used()
    return level


def rate_level(engine, workload: Workload, rate: float, requests: int, slo: dict | None = None,
               seed: int = 0) -> dict:
    """Open loop: `requests` requests arriving as a Poisson process of `rate` per second."""
    from pipeline.console import progress

    prompts, outputs = workload.take(requests)
    with progress(f"bench {workload.name} {rate:g} req/s", requests, "requests") as advance:
        engine.progress = advance
        started = time.perf_counter()
        timings = engine.timed_generate(prompts, outputs, None, rate=rate, seed=seed, **workload.images_of(requests))
        wall = time.perf_counter() - started
        engine.progress = None
    level = level_metrics(timings, wall, slo, request_rate=rate)
    level["memory_bytes"] = engine.device_memory_used()
    return level


class HttpTiming:
    """`timed_generate` for a server engine: streamed /v1/completions with token-id prompts, each
    chunk timed on arrival; a request with images (PromptImages) goes to streamed /v1/chat/completions as the
    rendered text (image markup in place) followed by its images as PNG data URLs, as the VQA suite sends them
    (pipeline/engines/openai.py). Wraps the engine (vllm or openai) and adds nothing between the clock and the
    socket but JSON parsing of each event. Every level sends the workload's prompts again, and vLLM caches prompt
    prefixes by default: each vLLM request carries a salt of its own (`cache_salt`, which vLLM mixes into its prefix
    cache's block hashes), so every request is prefilled, as a deployment's distinct prompts are, instead of being
    served the KV blocks of an earlier level's identical prompt."""

    def __init__(self, engine, vllm_extras: bool):
        self.engine, self.vllm_extras = engine, vllm_extras
        self.progress = None  # callable(n) told of each finished request

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def _body(self, prompt: list[int], output_len: int, images=None) -> dict:
        body = {"model": self.engine.served_model, "max_tokens": output_len, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        if images is None:
            body["prompt"] = prompt
        else:
            body["messages"] = [{"role": "user", "content": [{"type": "text", "text": images.text}] + [
                {"type": "image_url", "image_url": {"url": url}} for url in images.urls]}]
        if self.vllm_extras:  # exactly output_len tokens each, counted by id; a prefill of its own (cache_salt)
            body |= {"ignore_eos": True, "min_tokens": output_len, "return_token_ids": True,
                     "cache_salt": uuid.uuid4().hex}
        return body

    async def _one(self, http, prompt: list[int], output_len: int, images=None) -> Timing:
        """One streamed request, timed chunk by chunk, the whole of it within one wall-clock deadline; a chunk
        that is not what the API specifies (pipeline/engines/replies.py: stream_chunk) makes it a failed request,
        with the reason."""
        from pipeline.engines.http import FatalError, Limits, RetryableError, within

        limits = Limits(deadline=max(600.0, self.engine.limits.deadline if hasattr(self.engine, "limits") else 600.0),
                        max_bytes=256 << 20)
        prompt_tokens = images.prompt_tokens if images is not None else len(prompt)
        started = time.perf_counter()
        seen = {"first": None, "last": None, "itl": [], "n": 0, "usage": None, "prompt_tokens": None}
        try:
            await within(limits, self._consume(http, prompt, output_len, limits, seen, images), "stream not finished")
        except (RetryableError, FatalError) as exc:
            done = time.perf_counter()
            return Timing(ttft=done - started, seconds=done - started, n_tokens=0, input_tokens=prompt_tokens,
                          error=str(exc))
        done = time.perf_counter()
        if self.progress:
            self.progress(1)
        n_tokens = seen["usage"] if seen["usage"] and not self.vllm_extras else seen["n"]
        return Timing(ttft=(seen["first"] or done) - started, seconds=done - started, n_tokens=n_tokens,
                      input_tokens=prompt_tokens, itl=seen["itl"], server_prompt_tokens=seen["prompt_tokens"])

    async def _consume(self, http, prompt: list[int], output_len: int, limits, seen: dict, images=None) -> None:
        from pipeline.engines.http import stream_events
        from pipeline.engines.replies import BadReply, stream_chunk
        from pipeline.engines.served_model import check_reply

        url = self.engine.base_url + ("/completions" if images is None else "/chat/completions")
        async for arrived, event in stream_events(http, url, self._body(prompt, output_len, images),
                                                  self.engine.headers, limits):
            check_reply(event, self.engine.served_model, self.engine.base_url)  # another model's: the stage stops
            chunk = stream_chunk(event, output_len, chat=images is not None)
            seen["usage"] = chunk.completion_tokens if chunk.completion_tokens is not None else seen["usage"]
            seen["prompt_tokens"] = chunk.prompt_tokens if chunk.prompt_tokens is not None else seen["prompt_tokens"]
            if not chunk.tokens:
                continue
            if seen["first"] is None:
                seen["first"] = arrived
            else:
                seen["itl"].append(arrived - seen["last"])
            seen["last"] = arrived
            seen["n"] += chunk.tokens
            if self.vllm_extras and seen["n"] > output_len:  # counted by id: never more than asked
                raise BadReply("choices[0].token_ids", f"{output_len} tokens in all", seen["n"])

    def timed_generate(self, prompts: list[list[int]], output_tokens: list[int], concurrency: int | None,
                       rate: float | None = None, seed: int = 0, images: list | None = None) -> list[Timing]:
        """Closed loop (`concurrency` in flight, the next sent as one finishes) or open loop (Poisson arrivals of
        `rate` per second, each sent when it arrives, however many are in flight): one event loop, a connection of
        its own for every request in flight (pipeline/engines/http.py: client). images: per request its
        PromptImages, else None."""
        import asyncio

        if callable(getattr(self.engine, "check_served", None)):  # the openai engine: its /v1/models, once
            self.engine.check_served()
        jobs = list(zip(prompts, output_tokens, images or [None] * len(prompts)))
        return asyncio.run(self._timed(jobs, concurrency, rate, seed))

    async def _timed(self, jobs: list[tuple], concurrency: int | None, rate: float | None,
                     seed: int) -> list[Timing]:
        import asyncio

        from pipeline.engines.http import client

        width = len(jobs) if rate is not None else max(1, concurrency or 1)
        gate = asyncio.Semaphore(width)
        due = _arrivals(len(jobs), rate, seed) if rate is not None else [0.0] * len(jobs)
        async with client(width + 4) as http:
            start = time.perf_counter()

            async def one(job: tuple, at: float) -> Timing:
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                async with gate:
                    return await self._one(http, *job)

            return list(await asyncio.gather(*(one(job, at) for job, at in zip(jobs, due))))


def _arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of n requests arrives: a Poisson process of `rate` per second."""
    rng = random.Random(seed)
    due, at = [], 0.0
    for index in range(n):
        if index:
            at += rng.expovariate(rate)
        due.append(at)
    return due
