"""In-process transformers engine: greedy, left-padded batches sorted by prompt length."""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.engines.base import Completion, GenRequest, Timing, eos_token_ids, to_completion
from pipeline.formats.chat import render_prompt


class HFEngine:
    name = "hf"
    fast_decoding = True  # pipeline/engines/decoding.py

    def __init__(self, model_dir: Path | str, *, batch_size: int = 32, max_batch_tokens: int = 65536,
                 dtype: str = "float32", threads: int = 0, progress=None):
        import torch
        from transformers import AutoTokenizer

        from pipeline.engines.loading import load_for_inference

        if threads:
            torch.set_num_threads(threads)
        self.model_dir = Path(model_dir)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        # straight onto the GPU: a 9B checkpoint staged through host memory first costs minutes
        self.model = load_for_inference(self.model_dir, getattr(torch, dtype),
                                        device="cuda" if self.device == "cuda" else None).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.batch_size = batch_size
        self.max_batch_tokens = max_batch_tokens
        self.progress = progress  # callable(n_done) or None
        # On an H200 (GLM-4-9B shapes, bf16) the preallocated cache paid and the grouped attention
        # did not (benchmarks/results/gpu_hf_decodings.json): there only the cache is used.
        self.preallocate = self.fast_decoding
        if self.fast_decoding and self.device == "cpu":
            from pipeline.engines.decoding import use_grouped_attention

            use_grouped_attention(self.model)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return render_prompt(self.tokenizer, messages)

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        results: list[Completion | None] = [None] * len(requests)
        for batch in self.batches(requests):
            for index, completion in zip(batch, self._generate_batch([requests[i] for i in batch])):
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

    def _generate_batch(self, requests: list[GenRequest]) -> list[Completion]:
        import torch

        started = time.perf_counter()
        inputs = self.tokenizer([r.prompt for r in requests], return_tensors="pt", padding=True,
                                add_special_tokens=False).to(self.device)
        max_new_tokens = max(r.max_new_tokens for r in requests)
        with torch.inference_mode():
            output = self.model.generate(
                **inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=self.tokenizer.pad_token_id,
                past_key_values=self._cache(inputs["input_ids"].shape[1] + max_new_tokens),
            )
        seconds = (time.perf_counter() - started) / len(requests)
        return self._decode(requests, output[:, inputs["input_ids"].shape[1]:].tolist(), seconds)

    def _decode(self, requests: list[GenRequest], rows: list[list[int]], seconds: float) -> list[Completion]:
        eos_ids = eos_token_ids(self.tokenizer, self.model.generation_config.eos_token_id)
        return [to_completion(self.tokenizer, request, row, eos_ids, seconds) for request, row in zip(requests, rows)]

    def _cache(self, capacity: int):
        if not self.preallocate:
            return None
        from pipeline.engines.decoding import preallocated_cache

        return preallocated_cache(self.model, capacity)

    # ---------------------------------------------------------------- timing, for `quantize bench`

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def timed_generate(self, prompts: list[list[int]], output_tokens: list[int], concurrency: int | None,
                       rate: float | None = None, seed: int = 0) -> list[Timing]:
        """Static batches of `concurrency` requests (what transformers' generate can do), each request
        decoding exactly output_tokens[i] tokens (EOS ignored); every batch counts from its own start."""
        if rate is not None:
            from pipeline.errors import UserError

            raise UserError("bench.request_rates: request-rate sweeps need a server engine (vllm or openai)")
        timings = []
        for start in range(0, len(prompts), concurrency):
            timings += self._timed_batch(prompts[start:start + concurrency], output_tokens[start:start + concurrency])
            if self.progress:
                self.progress(len(prompts[start:start + concurrency]))
        return timings

    def _timed_batch(self, prompts: list[list[int]], output_tokens: list[int]) -> list[Timing]:
        import torch
        from transformers import LogitsProcessor, LogitsProcessorList

        steps: list[float] = []

        class StepClock(LogitsProcessor):  # called once per decoding step, right after its forward pass
            def __call__(self, input_ids, scores):
                steps.append(time.perf_counter())
                return scores

        batch = self.tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(self.device)
        longest = max(output_tokens)
        started = time.perf_counter()
        with torch.inference_mode():
            self.model.generate(**batch, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                                pad_token_id=self.tokenizer.pad_token_id,
                                past_key_values=self._cache(batch["input_ids"].shape[1] + longest),
                                logits_processor=LogitsProcessorList([StepClock()]))
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        return [Timing(ttft=steps[0] - started, seconds=steps[n - 1] - started, n_tokens=n, input_tokens=len(p),
                       itl=gaps[:n - 1])
                for p, n in zip(prompts, output_tokens)]

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
