"""In-process transformers engine: greedy, left-padded batches sorted by prompt length; and
token log-probabilities for likelihood suites (right-padded batches, longest first).

A sampled request (a seed: a suite's k samples) draws each token with its own torch generator seeded with the
request's seed (`RowSampler`, a logits processor that leaves greedy decoding only the token it drew), so a sample
never depends on another row's draws, and greedy rows beside it are unchanged."""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.engines.base import Completion, GenRequest, Timing, eos_token_ids, to_completion
from pipeline.engines.sections import HFSettings as Settings  # its params section
from pipeline.formats.chat import render_prompt

# Scoring a batch keeps the logits of the scored positions only, in float32: at most this many bytes
# of them per forward pass (a 150k-token vocabulary: ~870 positions; SmolLM2's 49k: ~2,700).
LOGITS_BYTES = 1 << 29


def fed_tokens(context: list[int], continuation: list[int]) -> tuple[int, ...]:
    """The tokens a scoring request feeds the model: its context and its continuation but the last token, which is
    only predicted."""
    return tuple(context) + tuple(continuation[:-1])


class HFEngine:
    name = "hf"
    fast_decoding = True  # pipeline/engines/decoding.py

    def __init__(self, model_dir: Path | str, settings: Settings | None = None, *, progress=None):
        import torch
        from transformers import AutoTokenizer

        from pipeline.checkpoints.loading import load_for_inference

        settings = settings or Settings()
        if settings.threads:
            torch.set_num_threads(settings.threads)
        self.model_dir = Path(model_dir)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # straight onto the GPU: a 9B checkpoint staged through host memory first costs minutes
        self.model = load_for_inference(self.model_dir, getattr(torch, settings.dtype),
                                        device="cuda" if self.device == "cuda" else None).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.batch_size = settings.batch_size
        self.max_batch_tokens = settings.max_batch_tokens
        self.progress = progress  # callable(n_done) or None
        # On an H200 (GLM-4-9B shapes, bf16) the preallocated cache paid and the grouped attention
        # did not (benchmarks/results/gpu_hf_decodings.json): there only the cache is used.
        self.preallocate = self.fast_decoding
        if self.fast_decoding and self.device == "cpu":
            from pipeline.engines.decoding import use_grouped_attention

            use_grouped_attention(self.model)

    def apply_chat_template(self, messages: list[dict], enable_thinking: bool | None = None) -> str:
        return render_prompt(self.tokenizer, messages, enable_thinking)

    def generate(self, requests: list[GenRequest], on_done=None) -> list[Completion]:
        """on_done(index, completion), if given, is called for each request as soon as its row
        finishes (its first EOS or its own max_new_tokens), while the batch goes on decoding."""
        results: list[Completion | None] = [None] * len(requests)
        for batch in self.batches(requests):
            report = (lambda j, completion, batch=batch: on_done(batch[j], completion)) if on_done else None
            for index, completion in zip(batch, self._generate_batch([requests[i] for i in batch], report)):
                results[index] = completion
            if self.progress:
                self.progress(len(batch))
        return results

    def batches(self, requests: list[GenRequest]) -> list[list[int]]:
        """Request indices, longest prompt first, cut at batch_size rows or when rows x (longest
        prompt + new tokens), the KV cache the batch fills, would pass max_batch_tokens."""
        if not requests:
            return []
        lengths = [len(ids) for ids in self.tokenizer([r.prompt for r in requests], add_special_tokens=False)["input_ids"]]
        batches: list[list[int]] = []
        for index in sorted(range(len(requests)), key=lambda i: -lengths[i]):
            batch = batches[-1] if batches else []
            rows = batch + [index]
            tokens = len(rows) * (lengths[rows[0]] + max(requests[i].max_new_tokens for i in rows))
            if batch and len(rows) <= self.batch_size and tokens <= self.max_batch_tokens:
                batch.append(index)
            else:
                batches.append([index])
        return batches

    def _generate_batch(self, requests: list[GenRequest], on_done=None) -> list[Completion]:
        import torch

        started = time.perf_counter()
        inputs = self.tokenizer([r.prompt for r in requests], return_tensors="pt", padding=True,
                                add_special_tokens=False).to(self.device)
        max_new_tokens = max(r.max_new_tokens for r in requests)
        prompt_len = inputs["input_ids"].shape[1]
        watcher = self._finish_watcher(requests, prompt_len, started, on_done)
        with torch.inference_mode():
            output = self.model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.tokenizer.pad_token_id,
                past_key_values=self._cache(prompt_len + max_new_tokens),
                **({"stopping_criteria": [watcher]} if watcher else {}), **row_sampling(requests, self.device),
            )
        seconds = (time.perf_counter() - started) / len(requests)
        completions = self._decode(requests, output[:, prompt_len:].tolist(), seconds)
        if watcher:
            completions = watcher.finish(completions)
        return completions

    def _finish_watcher(self, requests: list[GenRequest], prompt_len: int, started: float, on_done):
        """A stopping criterion that never stops anything: after each decoding step it hands each row
        that has just finished to on_done, decoded exactly as the batch's end would decode it."""
        if on_done is None:
            return None
        from transformers import StoppingCriteria

        engine, eos_ids = self, eos_token_ids(self.tokenizer, self.model.generation_config.eos_token_id)

        class FinishWatcher(StoppingCriteria):
            def __init__(self):
                self.reported: dict[int, Completion] = {}

            def __call__(self, input_ids, scores, **kwargs):
                import torch

                steps = input_ids.shape[1] - prompt_len
                last = input_ids[:, -1].tolist()
                for row, request in enumerate(requests):
                    if row in self.reported:
                        continue
                    if last[row] in eos_ids or steps >= request.max_new_tokens:
                        tokens = input_ids[row, prompt_len:].tolist()
                        seconds = (time.perf_counter() - started) / len(requests)
                        self.report(row, to_completion(engine.tokenizer, request, tokens, eos_ids, seconds))
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

            def report(self, row: int, completion: Completion) -> None:
                self.reported[row] = completion
                on_done(row, completion)

            def finish(self, completions: list[Completion]) -> list[Completion]:
                """Rows not reported yet (generation ended first) are reported now; reported rows keep
                the completion handed out (same text and tokens; the seconds when it finished)."""
                for row, completion in enumerate(completions):
                    if row not in self.reported:
                        self.report(row, completion)
                return [self.reported[row] for row in range(len(completions))]

        return FinishWatcher()

    def _decode(self, requests: list[GenRequest], rows: list[list[int]], seconds: float) -> list[Completion]:
        eos_ids = eos_token_ids(self.tokenizer, self.model.generation_config.eos_token_id)
        return [to_completion(self.tokenizer, request, row, eos_ids, seconds) for request, row in zip(requests, rows)]

    def _cache(self, capacity: int):
        if not self.preallocate:
            return None
        from pipeline.engines.decoding import preallocated_cache

        return preallocated_cache(self.model, capacity)

    # ---------------------------------------------------------------- likelihoods (pipeline/scoring/likelihood.py)

    @property
    def max_length(self) -> int:
        """Context window in tokens: the config's, as lm-eval's HFLM resolves it."""
        from lm_eval.models.utils import resolve_max_length

        return resolve_max_length(self.model.config, self.tokenizer)

    def token_logprobs(self, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """For each (context, continuation): the summed log-probability of the continuation and whether
        each of its tokens is the argmax. Right-padded batches, longest first, up to batch_size rows,
        max_batch_tokens of input and LOGITS_BYTES of scored logits per forward pass. Requests that feed the
        model the same tokens (one-token choices after one context: a multiple-choice question, a judge's
        verdict) share one row: the model runs once for all of them."""
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for batch in self.scoring_batches(requests):
            for index, score in zip(batch, self._score_batch([requests[i] for i in batch])):
                results[index] = score
        return results

    def scoring_batches(self, requests: list[tuple[list[int], list[int]]]) -> list[list[int]]:
        for context, continuation in requests:
            if not context or not continuation:
                raise ValueError("token_logprobs: every request needs a context token (BOS or a prefix) and a continuation")
        vocab = self.model.get_output_embeddings().weight.shape[0]
        max_positions = max(1, LOGITS_BYTES // (4 * vocab))
        fed = [fed_tokens(c, x) for c, x in requests]  # the last continuation token is only predicted
        batches: list[list[int]] = []
        rows: set[tuple[int, ...]] = set()  # the distinct rows the last batch feeds
        for index in sorted(range(len(requests)), key=lambda i: -len(fed[i])):
            batch = batches[-1] if batches else []
            distinct = rows | {fed[index]}
            if (batch and len(distinct) <= self.batch_size
                    and len(distinct) * len(fed[batch[0]]) <= self.max_batch_tokens
                    and sum(len(requests[i][1]) for i in batch + [index]) <= max_positions):
                batch.append(index)
                rows = distinct
            else:
                batches.append([index])
                rows = {fed[index]}
        return batches

    def _score_batch(self, requests: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """One forward pass; the output layer sees only the positions that predict a continuation token
        (a pre-hook gathers them), so whatever the model does after it (soft-capping, scaling) still applies."""
        import torch

        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        fed = [fed_tokens(c, x) for c, x in requests]
        row_of = {tokens: row for row, tokens in enumerate(dict.fromkeys(fed))}  # the same tokens fed: one row
        width = max(len(f) for f in fed)
        ids = torch.full((len(row_of), width), pad, dtype=torch.long)
        mask = torch.zeros((len(row_of), width), dtype=torch.long)
        for tokens, row in row_of.items():
            ids[row, :len(tokens)] = torch.tensor(tokens)
            mask[row, :len(tokens)] = 1
        positions, targets = [], []
        for (context, continuation), tokens in zip(requests, fed):
            row = row_of[tokens]
            start = len(context) - 1  # the position whose output predicts the first continuation token
            positions += [row * width + start + k for k in range(len(continuation))]
            targets += list(continuation)
        index = torch.tensor(positions, device=self.device)

        def gather(module, args):
            hidden = args[0]
            return (hidden.reshape(-1, hidden.shape[-1])[index].unsqueeze(0), *args[1:])

        hook = self.model.get_output_embeddings().register_forward_pre_hook(gather)
        try:
            with torch.inference_mode():
                logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                                    use_cache=False).logits[0]
        finally:
            hook.remove()
        target = torch.tensor(targets, device=logits.device)
        logprobs, greedy = torch.empty(len(targets), dtype=torch.float64), torch.empty(len(targets), dtype=torch.bool)
        for start in range(0, len(targets), 512):  # in slices: log-softmax's temporaries stay small
            part, wanted = logits[start:start + 512].float(), target[start:start + 512]
            logprobs[start:start + 512] = (part.gather(1, wanted[:, None])[:, 0] - torch.logsumexp(part, dim=-1)).double().cpu()
            greedy[start:start + 512] = (part.argmax(dim=-1) == wanted).cpu()
        scores, offset = [], 0
        for _, continuation in requests:
            n = len(continuation)
            scores.append((float(logprobs[offset:offset + n].sum()), bool(greedy[offset:offset + n].all())))
            offset += n
        return scores

    # ---------------------------------------------------------------- timing, for `quantize bench`

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def timed_generate(self, prompts: list[list[int]], output_tokens: list[int], concurrency: int | None,
                       rate: float | None = None, seed: int = 0, images: list | None = None) -> list[Timing]:
        """Static batches of `concurrency` requests (what transformers' generate can do), each request
        decoding exactly output_tokens[i] tokens (EOS ignored); every batch counts from its own start.
        images: per request its PromptImages (pipeline/engines/vision.py; a model with a vision tower), else None."""
        if rate is not None:
            from pipeline.errors import UserError

            raise UserError("bench.request_rates: request-rate sweeps need a server engine (vllm or openai)")
        timings = []
        for start in range(0, len(prompts), concurrency):
            end = start + concurrency
            timings += self._timed_batch(prompts[start:end], output_tokens[start:end], images[start:end] if images else None)
            if self.progress:
                self.progress(len(prompts[start:end]))
        return timings

    def _timed_inputs(self, prompts: list[list[int]], images: list | None):
        """The batch's model inputs (left-padded) and each prompt's length in tokens."""
        if images:
            raise ValueError(f"{self.model_dir}: a text-only model takes no images")
        return self.tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(self.device), [len(p) for p in prompts]

    def _timed_batch(self, prompts: list[list[int]], output_tokens: list[int], images: list | None = None) -> list[Timing]:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        steps: list[float] = []

        class StepClock(LogitsProcessor):  # called once per decoding step, right after its forward pass
            def __call__(self, input_ids, scores):
                steps.append(time.perf_counter())
                return scores

        started = time.perf_counter()  # the inputs' preparation (an image's processing) counts, as on a server
        batch, lengths = self._timed_inputs(prompts, images)
        longest = max(output_tokens)
        with torch.inference_mode():
            self.model.generate(**batch, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                                pad_token_id=self.tokenizer.pad_token_id,
                                past_key_values=self._cache(batch["input_ids"].shape[1] + longest),
                                logits_processor=LogitsProcessorList([StepClock()]))
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        return [Timing(ttft=steps[0] - started, seconds=steps[n - 1] - started, n_tokens=n, input_tokens=length,
                       itl=gaps[:n - 1])
                for length, n in zip(lengths, output_tokens)]

    def device_memory_used(self) -> int | None:
        import torch

        if self.device == "cuda":
            return torch.cuda.max_memory_allocated()
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak RSS of this process

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights read to decode one token, as held in memory (quantized variants are
        dequantized by this engine), except the input embedding table unless the output layer shares it."""
        embedding = self.model.get_input_embeddings().weight
        tied = self.model.get_output_embeddings() is not None and \
            self.model.get_output_embeddings().weight.data_ptr() == embedding.data_ptr()
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return total if tied else total - embedding.numel() * embedding.element_size()

    def close(self) -> None:
        pass


def row_sampling(requests: list[GenRequest], device) -> dict:
    """generate()'s logits_processor for a batch with sampled requests ({} for an all-greedy batch)."""
    if not any(r.seed is not None for r in requests):
        return {}
    from transformers import LogitsProcessorList

    return {"logits_processor": LogitsProcessorList([RowSampler(requests, device)])}


class RowSampler:
    """Draws the next token of each sampled row (temperature, top-k, top-p) with the row's own generator, seeded
    with its request's seed, and leaves greedy decoding that token alone; greedy rows pass through untouched."""

    def __init__(self, requests: list[GenRequest], device):
        import torch

        self.rows = [(row, r.sampling, torch.Generator(device=device).manual_seed(r.seed))
                     for row, r in enumerate(requests) if r.seed is not None and r.sampling is not None]

    def __call__(self, input_ids, scores):
        import torch

        for row, sampling, generator in self.rows:
            logits = scores[row].float()
            if sampling.temperature > 0:
                logits = logits / sampling.temperature
                if sampling.top_k:
                    logits[logits < torch.topk(logits, min(sampling.top_k, logits.numel())).values[-1]] = float("-inf")
                probs = torch.softmax(logits, dim=-1)
                if sampling.top_p < 1:
                    ordered, order = torch.sort(probs, descending=True)
                    drop = ordered.cumsum(0) - ordered > sampling.top_p  # past the nucleus: the first token stays
                    probs[order[drop]] = 0
                token = int(torch.multinomial(probs / probs.sum(), 1, generator=generator))
            else:
                token = int(logits.argmax())
            scores[row] = float("-inf")
            scores[row, token] = 0
        return scores
