"""lmdeploy's PyTorch engine, in-process (GPU only; the `gpu` extra).

lmdeploy serves neither compressed-tensors checkpoints (beyond one symmetric group-32 layout) nor
the native `Glm` architecture, so a checkpoint that needs it is first exported once, with
`quantize export --engine lmdeploy`, into `.cache/lmdeploy/` (AWQ -> AutoAWQ GEMM layout, Glm ->
ChatGLM names); FP8 variants are refused there with the reason and the alternative (vLLM).

Prompts are tokenized here with the checkpoint's own Hugging Face tokenizer and handed to lmdeploy
as token ids, and outputs are decoded with it too: the hf and lmdeploy engines see and score the
very same tokens. Scripts that create this engine need an `if __name__ == "__main__":` guard,
because lmdeploy starts worker processes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from pathlib import Path

from pipeline.checkpoints import checkpoint, config_json
from pipeline.engines.base import Completion, GenRequest, Timing, eos_token_ids, to_completion
from pipeline.engines.replies import token_ids
from pipeline.engines.sections import LMDeploySettings as Settings  # its params section
from pipeline.errors import UserError
from pipeline.formats.chat import render_prompt

log = logging.getLogger(__name__)
EXPORT_CACHE = Path(".cache") / "lmdeploy"


def require_lmdeploy() -> None:
    try:
        import lmdeploy  # noqa: F401  (only present with the GPU extra)
    except ImportError:
        raise UserError("engine 'lmdeploy' needs the lmdeploy extra on a CUDA machine (pip install -e '.[lmdeploy]'); "
                        "here use engine hf, or openai against a running `lmdeploy serve api_server`") from None


# lmdeploy 0.18 loads these under their Hugging Face names; anything else goes through `quantize export`
LMDEPLOY_NATIVE = {"LlamaForCausalLM", "Glm4ForCausalLM", "Glm4vForConditionalGeneration",
                   "ChatGLMForConditionalGeneration", "ChatGLMModel", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def needs_export(config: dict) -> bool:
    return config_json.is_compressed_tensors(config) or not LMDEPLOY_NATIVE.intersection(config.get("architectures") or [])


def _stat_key(model_dir: Path) -> str:
    """Cheap identity of a checkpoint (names, sizes, mtimes): hashing 18 GB of weights per start would cost minutes."""
    digest = hashlib.sha256(str(model_dir.resolve()).encode())
    for path in sorted(model_dir.iterdir()):
        if path.is_file():
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()[:12]


def servable_dir(model_dir: Path, cache_root: Path = EXPORT_CACHE) -> tuple[Path, bool]:
    """(directory lmdeploy loads, whether it is our export, whose ChatGLM config is remote code)."""
    config = checkpoint.open(model_dir).config
    if not needs_export(config):
        return model_dir, False
    from pipeline.checkpoints import export

    target = cache_root / f"{model_dir.name}-{_stat_key(model_dir)}"
    if not config_json.present(target):
        log.info(export.run(model_dir, target, engine="lmdeploy").summary())
        remove_stale_exports(model_dir, target, cache_root)
    return target, True


def remove_stale_exports(model_dir: Path, current: Path, cache_root: Path) -> None:
    """Earlier exports of the same checkpoint, made before it was rebuilt (18 GB each for a 9B base)."""
    from pipeline.outputs import dir_size, human_size, remove_output

    source = str(model_dir.resolve())
    for record in sorted(cache_root.glob("*/export.json")):  # export.run names the checkpoint it read
        old = record.parent
        if old != current and json.loads(record.read_text()).get("source") == source:
            size = dir_size(old)
            try:
                remove_output(old, "export")  # only a folder the export stage wrote, holding nothing else
            except UserError as exc:
                log.warning(f"export: left {old} in place: {exc}")
                continue
            log.info(f"export: removed {old} ({human_size(size)}), an export of {model_dir} made before it changed")


class LMDeployEngine:
    name = "lmdeploy"

    def __init__(self, model_dir: Path | str, settings: Settings | None = None, *, progress=None,
                 session_len: int | None = None, cache_max_entry_count: float = 0.5):
        require_lmdeploy()
        import torch
        from lmdeploy import PytorchEngineConfig, pipeline
        from transformers import AutoTokenizer

        settings = settings or Settings()
        batch_size, dtype, tensor_parallel_size = settings.batch_size, settings.dtype, settings.tensor_parallel_size
        if tensor_parallel_size > torch.cuda.device_count():
            raise UserError(f"params.yaml: engine.tensor_parallel_size: {tensor_parallel_size} GPUs asked, "
                            f"{torch.cuda.device_count()} visible; use at most that many (or set CUDA_VISIBLE_DEVICES)")
        self.parallel = {"tensor_parallel_size": tensor_parallel_size, "devices": [
            torch.cuda.get_device_name(i) for i in range(tensor_parallel_size)]}

        self.model_dir = Path(model_dir)
        self.served_dir, exported = servable_dir(self.model_dir)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.batch_size = batch_size
        self.progress = progress
        engine_config = PytorchEngineConfig(
            max_batch_size=batch_size, cache_max_entry_count=cache_max_entry_count, session_len=session_len,
            tp=tensor_parallel_size,
            dtype=dtype if dtype in ("float16", "bfloat16") else "auto")
        self.pipe = pipeline(str(self.served_dir), backend_config=engine_config, log_level="ERROR",
                             trust_remote_code=exported)
        self.eos_ids = eos_token_ids(self.tokenizer, config_json.generation_eos(self.model_dir))
        # ids an answer may hold (checked before decoding): the tokenizer's, or the model's padded embedding rows
        self.vocab_size = max(len(self.tokenizer), checkpoint.open(self.model_dir).vocab_size)

    def apply_chat_template(self, messages: list[dict], enable_thinking: bool | None = None) -> str:
        return render_prompt(self.tokenizer, messages, enable_thinking)

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def generate(self, requests: list[GenRequest], on_done=None) -> list[Completion]:
        """on_done(index, completion), if given, is called for each request as it finishes (on the
        pipeline's event-loop thread, while this one waits), the others still decoding."""
        ids = [self.encode(r.prompt) for r in requests]
        completion = lambda i, timing: to_completion(  # noqa: E731
            self.tokenizer, requests[i], timing.token_ids, self.eos_ids, timing.seconds, timing.error)
        finished = (lambda i, timing: on_done(i, completion(i, timing))) if on_done else None
        timings = self._run([(i, r.max_new_tokens, False, r) for i, r in zip(ids, requests)], self.batch_size, finished)
        return [completion(i, timing) for i, timing in enumerate(timings)]

    def timed_generate(self, prompts: list[list[int]], output_tokens: list[int], concurrency: int | None,
                       rate: float | None = None, seed: int = 0) -> list[Timing]:
        """Exactly output_tokens[i] tokens per request (EOS ignored), `concurrency` requests in flight."""
        if rate is not None:
            raise UserError("bench.request_rates: request-rate sweeps need a server engine (vllm, or openai against "
                            "`lmdeploy serve api_server`)")
        return self._run([(p, n, True) for p, n in zip(prompts, output_tokens)], concurrency)

    def _run(self, jobs: list[tuple[list[int], int, bool]], concurrency: int, on_done=None) -> list[Timing]:
        # The pipeline's own infer() takes text and re-tokenizes it; its async engine takes token ids
        # and streams each token, which gives TTFT. Both run on the pipeline's event-loop thread.
        async def all_jobs():
            gate = asyncio.Semaphore(concurrency)

            async def guarded(index, job):
                async with gate:
                    timing = await self._one(*job)
                if on_done:
                    on_done(index, timing)
                if self.progress:
                    self.progress(1)
                return timing

            return await asyncio.gather(*(guarded(i, job) for i, job in enumerate(jobs)))

        return asyncio.run_coroutine_threadsafe(all_jobs(), self.pipe.internal_thread.loop).result()

    async def _one(self, input_ids: list[int], max_new_tokens: int, ignore_eos: bool,
                   request: GenRequest | None = None) -> Timing:
        from lmdeploy import GenerationConfig

        engine = self.pipe.async_engine
        sampled = request is not None and request.seed is not None and request.sampling is not None
        sampling = {"do_sample": True, "random_seed": request.seed, "temperature": request.sampling.temperature,
                    "top_p": request.sampling.top_p, "top_k": request.sampling.top_k} if sampled else {"do_sample": False}
        config = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos, skip_special_tokens=True,
                                  **sampling)
        started = time.perf_counter()
        first, last, tokens, error, itl = None, None, [], None, []
        try:
            request = await engine.preprocess(None, self.pipe.session_mgr.get(), gen_config=config,
                                              input_ids=input_ids)
            async for out in engine.generate(request, stream_response=True):
                response = out.to_response(0)
                if response.token_ids:
                    # checked as a server's reply is (pipeline/engines/replies.py): a bad id fails this request
                    ids = token_ids(list(response.token_ids), "token_ids", self.vocab_size)
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
                    tokens += ids
                if response.finish_reason == "error":
                    error = str(response.error_message or "lmdeploy reported an error")[:500]
        except Exception as exc:  # one bad request (too long, out of memory) must not end the run
            error = f"{type(exc).__name__}: {exc}"
        done = time.perf_counter()
        return Timing(ttft=(first or done) - started, seconds=done - started, n_tokens=len(tokens),
                      input_tokens=len(input_ids), token_ids=tokens, error=error, itl=itl)

    def device_memory_used(self) -> int | None:
        import torch

        used = 0
        for index in range(self.parallel["tensor_parallel_size"]):  # every GPU the model is split over
            free, total = torch.cuda.mem_get_info(index)
            used += total - free
        return used

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights read to decode one token: every tensor the served checkpoint holds,
        except the input embedding table (one row is read), unless the output layer shares it."""
        from pipeline.checkpoints.sizes import checkpoint_weight_bytes

        return checkpoint_weight_bytes(self.served_dir)

    def kv_dtype_bytes(self) -> int:
        """Bytes per KV-cache element: lmdeploy's PyTorch engine keeps its cache in 16 bits (no quant_policy)."""
        return 2

    def close(self) -> None:
        """Stops the engine and returns its GPU memory (weights and KV pool) before the next one starts."""
        import gc

        import torch

        self.pipe.close()
        del self.pipe
        gc.collect()
        torch.cuda.empty_cache()
