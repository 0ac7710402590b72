"""In-process transformers engine: greedy, left-padded batches sorted by prompt length."""

from __future__ import annotations

import time
from pathlib import Path

from pipeline.engines import Completion, GenRequest


def _truncate_at_stop(text: str, stops: list[str]) -> str:
    cut = min((text.find(s) for s in stops if s and s in text), default=-1)
    return text[:cut] if cut >= 0 else text


class HFEngine:
    name = "hf"

    def __init__(self, model_dir: Path | str, *, batch_size: int = 32, dtype: str = "float32",
                 threads: int = 0, progress=None):
        import torch
        from transformers import AutoTokenizer

        from pipeline.engines.loading import load_for_inference

        if threads:
            torch.set_num_threads(threads)
        self.model_dir = Path(model_dir)
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.model = load_for_inference(self.model_dir, getattr(torch, dtype)).to(self.device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.batch_size = batch_size
        self.progress = progress  # callable(n_done) or None

    def apply_chat_template(self, messages: list[dict]) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            return "\n\n".join(m["content"] for m in messages)
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i].prompt))
        results: list[Completion | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            batch = [order[i] for i in range(start, min(start + self.batch_size, len(order)))]
            for index, completion in zip(batch, self._generate_batch([requests[i] for i in batch])):
                results[index] = completion
            if self.progress:
                self.progress(len(batch))
        return results

    def _generate_batch(self, requests: list[GenRequest]) -> list[Completion]:
        import torch

        started = time.perf_counter()
        inputs = self.tokenizer([r.prompt for r in requests], return_tensors="pt", padding=True,
                                add_special_tokens=False).to(self.device)
        with torch.inference_mode():
            output = self.model.generate(
                **inputs, max_new_tokens=max(r.max_new_tokens for r in requests), do_sample=False,
                pad_token_id=self.tokenizer.pad_token_id,
            )
        new_tokens = output[:, inputs["input_ids"].shape[1]:]
        seconds = (time.perf_counter() - started) / len(requests)
        completions = []
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos]) | {self.tokenizer.eos_token_id}
        for request, row in zip(requests, new_tokens.tolist()):
            row = row[: request.max_new_tokens]
            n = next((i for i, t in enumerate(row) if t in eos_ids), len(row))
            text = self.tokenizer.decode(row[:n], skip_special_tokens=True)
            completions.append(Completion(_truncate_at_stop(text, request.stop), n, seconds))
        return completions
