"""vLLM, the way a deployment runs it: `vllm serve DIR ...` as a child process, spoken to over its
OpenAI-compatible API (the `vllm` extra on a CUDA machine).

The stage starts the server with the settings from params.yaml's `engine` section under vLLM's own
names (tensor_parallel_size, max_model_len, gpu_memory_utilization, kv_cache_dtype,
enable_prefix_caching, max_num_batched_tokens, max_num_seqs), waits for `/health`, and stops it at
the end; its log is kept beside the stage's results. A server in its own process also keeps vLLM's
pinned packages (compressed-tensors 0.17) apart from llm-compressor's (0.19): `engine.server_command`
and `engine.server_env` say how to start it when it lives in another environment.

Prompts are rendered and tokenized by the checkpoint's own tokenizer here and sent to
`/v1/completions` as token ids; answers come back as token ids (`return_token_ids`) and are decoded
and cut at EOS / stop strings by the same code as the hf engine's, so switching engine changes no
token on either side. `--generation-config vllm` keeps the checkpoint's generation_config.json
(repetition penalties and the like) out of the sampling: requests are greedy, as with every engine.
Log-likelihoods come from `prompt_logprobs`: the log-probability and rank of every prompt token.

Images (vision models: Glm4v, Glm4vMoe): the prompt is rendered here with the image markup in place, as
the hf engine renders it, and sent with its images to `/v1/chat/completions`; the server is started
with a chat template that passes the text through (`PASSTHROUGH_TEMPLATE`, content format `string`),
so vLLM tokenizes exactly that text, finds one image placeholder per image and adds none (see
pipeline/engines/openai.py). A quantized vision checkpoint whose ignore list vLLM would not match
under its own module names is refused before the server starts (pipeline/checkpoints/serving_names.py), and so
is a checkpoint of transformers' glm46v type, which vLLM 0.24 has no model for, with the resave that writes it in the
layout vLLM serves (pipeline/checkpoints/serving.py CANNOT).

Parallelism: `tensor_parallel_size` and, for MoE, `enable_expert_parallel` (experts placed whole on
the GPUs instead of sliced across them) are engine settings passed to `vllm serve` as they are.

FP8 KV cache: `kv_cache_dtype: checkpoint` (the default) serves a checkpoint that carries FP8
KV-cache scales with `--kv-cache-dtype fp8`, so its calibrated (per-head) scales are used, and any
other checkpoint with the model's dtype.
"""

from __future__ import annotations

import time
from pathlib import Path

import pipeline.engines.openai as openai  # not `from pipeline.engines import`: the registry imports this module
import pipeline.engines.replies as replies
import pipeline.engines.vllm_defects as vllm_defects
from pipeline.checkpoints import checkpoint
from pipeline.engines.base import Completion, GenRequest
from pipeline.engines.http import FatalError, RetryableError, get_ok
from pipeline.engines.inflight import vllm_load
from pipeline.engines.openai import OpenAIEngine
from pipeline.engines.sections import VLLMSettings as Settings  # its params section
from pipeline.engines.server import ServerProcess, free_port
from pipeline.engines.vision import IMAGE_PLACEHOLDER, image_markup, is_multimodal, render_images
from pipeline.engines.vllm_server import (  # noqa: F401  (the server's command line, re-exported: the registry's warm)
    PASSTHROUGH_TEMPLATE, SERVED_NAME, SERVER_SETTINGS, server_settings, kv_cache_scheme, resolve_kv_cache_dtype,
    serving_dtype, refuse_unservable, server_args, server_command_for, planned_kv_cache_bytes, server_memory,
    fitted_share, warm,
)
from pipeline.errors import UserError

class VLLMEngine:
    name = "vllm"

    def __init__(self, model_dir: Path | str, settings: Settings | None = None, *, log_path: Path | str | None = None,
                 progress=None):
        """log_path: where the server's log goes (default results/<checkpoint dir's name>/vllm-server.log)."""
        self.model_dir = Path(model_dir)
        checkpoint.open(self.model_dir)  # a missing or broken config.json: one message naming it and the fix
        settings = self.settings = settings or Settings()
        refuse_unservable(self.model_dir)
        self.accepts_images = is_multimodal(self.model_dir)
        self.batch_size = settings.batch_size  # requests in flight
        self.progress = progress
        self.launch = {"server_env": settings.server_env, "start_timeout": settings.start_timeout,
                       "idle_timeout": settings.server_idle_timeout, "max_servers": settings.max_servers,
                       "share": settings.share_server, **server_memory(self.model_dir, settings),
                       "log_path": Path(log_path) if log_path else Path("results") / self.model_dir.name /
                       "vllm-server.log"}
        self.command = server_command_for(self.model_dir, settings)
        # the tokenizer side works without the server: a suite whose requests are all cached starts none
        # (constructed, not validated again: the values are this section's, batch_size beyond the openai engine's
        # bound on concurrency included)
        client = openai.Settings.model_construct(
            base_url="http://127.0.0.1:0/v1", model=SERVED_NAME, prompt_format="tokens", concurrency=settings.batch_size,
            timeout=settings.timeout, retries=settings.retries, max_response_bytes=settings.max_response_bytes)
        self.client = OpenAIEngine(self.model_dir, client,
                                   extra_body={"return_token_ids": True, "skip_special_tokens": False})
        self.tokenizer = self.client.tokenizer
        self.server = None
        self.version = None

    def start(self) -> "VLLMEngine":
        """The server, started (or attached to, when the run already has it: pipeline/engines/shared.py) the
        first time anything needs it; what that cost is recorded with the engines this process made."""
        if self.server is not None:
            return self
        from pipeline.engines.records import STARTS

        started = time.perf_counter()
        launch = self.launch
        if launch["share"]:  # one server per checkpoint and settings for the whole run (pipeline/engines/shared.py)
            import pipeline.engines.shared as shared

            self.server = shared.acquire(self.command, "--port", model_dir=self.model_dir,
                                         log_path=launch["log_path"], env=launch["server_env"],
                                         start_timeout=launch["start_timeout"], idle_timeout=launch["idle_timeout"],
                                         max_servers=launch["max_servers"], name="vLLM server",
                                         gpu_bytes=launch["gpu_bytes"], gpu_budget=launch["gpu_budget"])
        else:
            port = free_port()
            self.server = ServerProcess([*self.command, "--port", str(port)], port=port, log_path=launch["log_path"],
                                        env=launch["server_env"], name="vLLM server",
                                        start_timeout=launch["start_timeout"]).start()
        try:
            self.client.base_url = self.server.base_url + "/v1"
            self.client.load = vllm_load(self.server.base_url)  # the lost-request watchdog asks the server itself
            self.version = self._version()
        except BaseException:
            self.server.stop()
            self.server = None
            raise
        STARTS.append({"engine": self.name, "model": str(self.model_dir), "seconds": time.perf_counter() - started,
                       "server": "started" if getattr(self.server, "started", True) else "attached"})
        return self

    # ------------------------------------------------------------------ what every engine offers

    @property
    def base_url(self) -> str:
        self.start()
        return self.client.base_url

    @property
    def headers(self) -> dict:
        return self.client.headers

    @property
    def served_model(self) -> str:
        return SERVED_NAME

    @property
    def in_flight(self) -> int:
        """Requests kept in flight (engine.batch_size): callers hand every request at once, the client keeps this
        many at the server until the last (pipeline/engines/inflight.py)."""
        return self.batch_size

    @property
    def peak_in_flight(self) -> int:
        return self.client.peak_in_flight

    @property
    def max_length(self) -> int:
        return int(self.settings.max_model_len or checkpoint.open(self.model_dir).max_positions or 4096)

    def apply_chat_template(self, messages: list[dict], enable_thinking: bool | None = None) -> str:
        prompt = self.client.apply_chat_template(messages, enable_thinking)
        if self.accepts_images and IMAGE_PLACEHOLDER in prompt:
            return render_images(prompt, image_markup(self.model_dir, self.tokenizer))
        return prompt

    def encode(self, prompt: str) -> list[int]:
        return self.client.encode(prompt)

    def generate(self, requests: list[GenRequest], on_done=None) -> list[Completion]:
        """on_done(index, completion): as in OpenAIEngine.generate, each answer as it arrives."""
        self.start()
        completions = self.client.generate(requests, on_done=on_done)
        failed = [c for c in completions if c.error]
        if failed:  # never score a request that got no answer as a wrong answer
            self._raise_if_dead()
            raise UserError(f"vLLM server at {self.base_url}: {len(failed)} of {len(requests)} requests failed; the "
                            f"first: {failed[0].error}; its log: {self.server.log_path}")
        if self.progress:
            self.progress(len(requests))
        return completions

    def _raise_if_dead(self) -> None:
        proc = self.server.proc
        if proc is not None and proc.poll() is not None:
            raise UserError(f"the vLLM server died (exit code {proc.returncode}); the end of {self.server.log_path}:\n"
                            f"{self.server.log_tail()}")

    def token_logprobs(self, requests: list[tuple[list[int], list[int]]], on_done=None) -> list[tuple[float, bool]]:
        """Sum of log P(continuation | context) and whether every continuation token is the argmax,
        from vLLM's prompt_logprobs (log-probability and rank of each prompt token); on_done(index, score) as
        each arrives (all requests go out at once, batch_size of them in flight)."""
        self.start()
        try:
            return prompt_logprobs(self.client, requests, on_done)
        except UserError:
            self._raise_if_dead()
            raise

    def describe(self) -> dict:
        """Engine, version and settings, as the report names them."""
        self.start()
        return {"engine": "vllm", "version": self.version, "settings": server_settings(self.settings),
                "kv_cache_dtype": resolve_kv_cache_dtype(self.settings.kv_cache_dtype, self.model_dir),
                "tensor_parallel_size": self.settings.tensor_parallel_size,
                "enable_expert_parallel": self.settings.enable_expert_parallel,
                "accepts_images": self.accepts_images,
                "defects": self.defects(),
                "server_start_seconds": round(self.server.start_seconds or 0.0, 1),
                "server_attached": not getattr(self.server, "started", True),  # shared: started by an earlier stage
                "log": str(self.server.log_path)}

    def defects(self) -> list[dict]:
        """The known vLLM defects this checkpoint is exposed to, each with whether the server avoids it
        (pipeline/engines/vllm_defects.py); needs no server."""
        return vllm_defects.described(checkpoint.open(self.model_dir).config, self.settings.defect_workarounds)

    @property
    def start_seconds(self) -> float:
        """What this stage paid to start the server: 0 when it attached to a running one."""
        return float(self.server.start_seconds or 0.0) if self.server is not None else 0.0

    def capacity(self) -> dict:
        """KV-cache capacity and weight memory as the server itself logged them at start (capacity.py)."""
        from pipeline.engines.capacity import from_vllm_log, planned_kv_figures

        self.start()
        return {**planned_kv_figures(self.command), **from_vllm_log(self.server.log_path)}

    def server_plan(self) -> dict | None:
        """engine.kv_cache_memory: fitted. What this server was measured at (bench.json's capacity.plan): its share
        of the GPU (pipeline/engines/server_plan.py), the servers resident beside it now, and the run's plan as
        `quantize warm` printed it (None outside a run)."""
        if self.settings.kv_cache_memory != "fitted":
            return None
        import pipeline.engines.shared as shared
        import pipeline.engines.server_plan as server_plan

        share, device = fitted_share(self.model_dir, self.settings)
        beside = sorted(Path(e.get("model_path") or "?").name for e in shared.entries().values()
                        if Path(e.get("model_path") or "").resolve() != self.model_dir.resolve())
        return {"server": share.as_dict(device), "device_bytes": device,
                "budget_bytes": int(self.settings.gpu_memory_utilization * device),
                "resident_beside": beside, "run": server_plan.read(shared.registry_dir())}

    def _version(self) -> str | None:
        import httpx

        try:
            answer = httpx.get(self.server.base_url + "/version", timeout=5).json()
        except (httpx.HTTPError, ValueError, RecursionError):
            return None
        return replies.version(answer.get("version")) if isinstance(answer, dict) else None

    def healthy(self) -> bool:
        return self.server is not None and get_ok(self.server.base_url + "/health")

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def weight_bytes_per_token(self) -> int:
        from pipeline.checkpoints.sizes import checkpoint_weight_bytes

        return checkpoint_weight_bytes(self.model_dir)

    def kv_dtype_bytes(self) -> int:
        return 1 if self.describe()["kv_cache_dtype"].startswith("fp8") else 2

    def device_memory_used(self) -> int | None:
        """What the GPUs hold, vLLM's preallocated KV pool included (nvidia-smi; None without it)."""
        import shutil
        import subprocess

        if not shutil.which("nvidia-smi"):
            return None
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10).stdout
            return sum(int(v) for v in out.split()) << 20
        except (OSError, ValueError, subprocess.TimeoutExpired):
            return None

    def __enter__(self) -> "VLLMEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def prompt_logprobs(client: OpenAIEngine, requests: list[tuple[list[int], list[int]]],
                    on_done=None) -> list[tuple[float, bool]]:
    """VLLMEngine.token_logprobs through `client` (its in-flight count and watchdog): one request per (context,
    continuation), its reply's prompt_logprobs checked entry by entry (pipeline/engines/replies.py: a malformed
    one is asked again, then a UserError, for a likelihood a server gave no answer to cannot be scored)."""

    async def one(http, request: tuple[list[int], list[int]], tracker) -> tuple[float, bool]:
        context, continuation = request
        ids = list(context) + list(continuation)
        body = {"model": client.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 1}
        try:
            scored = await client.call(http, body, chat=False, tracker=tracker,
                                       read=lambda data: replies.prompt_logprobs(data, ids, len(context)))
        except (RetryableError, FatalError) as exc:
            raise UserError(f"vLLM server at {client.base_url}: prompt_logprobs failed: {exc}") from None
        if scored is None:
            raise UserError(f"vLLM server at {client.base_url}: no prompt_logprobs in its answer; it may be too "
                            "old (vLLM >= 0.24 returns them)")
        return scored

    def lost(request, why: str):
        raise UserError(f"vLLM server at {client.base_url}: prompt_logprobs failed: {why}")

    runner = client.runner(one, lost)
    scores = runner.run(requests, on_done)
    client.peak_in_flight = max(client.peak_in_flight, runner.peak)
    return scores


def wait_gone(url: str, seconds: float = 10.0) -> bool:
    """True once nothing answers at url (the server is down)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not get_ok(url, timeout=0.5):
            return True
        time.sleep(0.2)
    return False
