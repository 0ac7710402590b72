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
from typing import Literal

from pydantic import Field, model_validator

import pipeline.engines.openai as openai  # not `from pipeline.engines import`: the registry imports this module
import pipeline.engines.replies as replies
import pipeline.engines.vllm_defects as vllm_defects
from pipeline.checkpoints import checkpoint
from pipeline.engines.base import Completion, GenRequest
from pipeline.engines.http import FatalError, RetryableError, get_ok
from pipeline.engines.inflight import vllm_load
from pipeline.engines.openai import OpenAIEngine
from pipeline.engines.settings import MAX_TIMEOUT_S, EngineSpec, HTTPSettings
from pipeline.engines.server import ServerProcess, free_port
from pipeline.engines.vision import IMAGE_PLACEHOLDER, image_markup, is_multimodal, render_images
from pipeline.engines.vllm_server import (  # noqa: F401  (the server's command line, re-exported: the registry's warm)
    PASSTHROUGH_TEMPLATE, SERVED_NAME, SERVER_SETTINGS, server_settings, kv_cache_scheme, resolve_kv_cache_dtype,
    serving_dtype, refuse_unservable, server_args, server_command_for, planned_kv_cache_bytes, server_memory,
    fitted_share, warm,
)
from pipeline.errors import UserError

KvCacheDtype = Literal["checkpoint", "auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"]


class Settings(HTTPSettings):
    """`engine:` with `name: vllm`: `vllm serve`, started by the stage. vLLM's settings keep vLLM's own names."""

    name: Literal["vllm"] = "vllm"
    # float16 / bfloat16: served in it; None (or float32, an in-process engine's setting carried over): the
    # checkpoint's own dtype
    dtype: Literal["float32", "float16", "bfloat16"] | None = None
    timeout: float = Field(600.0, gt=0, le=MAX_TIMEOUT_S)  # seconds for a whole request: a long suite's last one waits
    retries: int = Field(1, ge=0, le=20)  # the lost-request watchdog asks a lost one again (inflight.py)
    tensor_parallel_size: int = Field(1, ge=1, le=64)
    enable_expert_parallel: bool = False  # MoE experts spread over the GPUs instead of sliced (--enable-expert-parallel)
    max_model_len: int | None = Field(None, ge=16, le=1 << 21)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    # checkpoint: fp8 when the checkpoint carries FP8 KV-cache scales (served with them), else the model's dtype
    kv_cache_dtype: KvCacheDtype = "checkpoint"
    enable_prefix_caching: bool | None = None  # None: vLLM's default
    max_num_batched_tokens: int | None = Field(None, ge=16, le=1 << 24)
    max_num_seqs: int | None = Field(None, ge=1, le=4096)
    server_command: list[str] = ["vllm", "serve"]  # another interpreter: [python3, -m, vllm.entrypoints.cli.main, serve]
    server_env: dict[str, str] = {}  # extra environment for the server only (e.g. PYTHONPATH of its own install)
    server_args: list[str] = []  # further `vllm serve` flags, passed as given
    # add the settings that avoid known vLLM defects hitting the checkpoint (vllm_defects.py, e.g. GLM-4.1V's image
    # positions under --enforce-eager); false: vLLM as it ships (the report still names them)
    defect_workarounds: bool = True
    start_timeout: float = Field(900.0, gt=0, le=7200)  # seconds for the server to answer /health
    # one server per checkpoint and settings for the whole `dvc repro` (shared.py): stages attach to the server an
    # earlier stage started; false: every stage starts and stops its own
    share_server: bool = True
    # seconds without a stage before a shared server stops; None: it lives until the run ends (DVC's stage order
    # can leave a model unused for many minutes before its next stage; a restart costs ~100 s on the H200)
    server_idle_timeout: float | None = Field(None, gt=0, le=86400)
    max_servers: int = Field(1, ge=1, le=16)  # servers kept at once (idle ones beyond: stopped, oldest first)
    # the KV pool: auto, sized by vLLM's start-up profiling (the server must have the GPU to itself while it starts:
    # the profiling reads the whole device's free memory); planned, gpu_memory_utilization x the GPU's memory less
    # the checkpoint's weights and non_kv_memory_gib, so a server can start while other work runs; fitted, the pool
    # its requests need (batch_size x plan_request_tokens tokens, at least one of max_model_len) or what is left,
    # each server sized from what it holds and gpu_memory_utilization the share of the GPU the run's servers hold
    # together: as many resident at once as fit (pipeline/engines/server_plan.py)
    kv_cache_memory: Literal["auto", "planned", "fitted"] = "auto"
    non_kv_memory_gib: float = Field(4.0, ge=0, le=1024)  # planned, fitted: activations, CUDA graphs, the CUDA context
    device_memory_gib: float | None = Field(None, gt=0, le=1 << 20)  # planned, fitted: one GPU's memory (None: nvidia-smi)
    # fitted: the tokens one request in flight holds in the KV cache (prompt + answer); GSM8K's prompt and its 512 new
    # tokens: 256 of them ran at once on the H200 in a 245,872-token pool (2026-12-02)
    plan_request_tokens: int = Field(768, ge=16, le=1 << 21)
    # inside a run, start each checkpoint's server as soon as the checkpoint exists and memory allows, so starts
    # overlap other stages' work (needs share_server and kv_cache_memory: planned)
    warm_servers: bool = False
    # while stages that load a model on the GPU in-process (quantize, kl) may still come, early starts leave at
    # least this fraction of the GPU's memory free
    build_memory_fraction: float = Field(0.5, ge=0, le=1)
    # inside a run, start each model's evaluation (and each variant's judging) in the background as soon as its
    # server is up, the stage collecting the results when DVC reaches it (pipeline/scoring/ahead.py; needs warm_servers)
    score_ahead: bool = False

    @model_validator(mode="after")
    def _warm_needs_planned_pools(self):
        if self.warm_servers and not (self.share_server and self.kv_cache_memory in ("planned", "fitted")):
            raise ValueError("warm_servers: true needs share_server: true and kv_cache_memory: fitted or planned (a "
                             "server that sizes its KV pool by profiling must start with the GPU to itself); set both, "
                             "or warm_servers: false")
        if self.score_ahead and not self.warm_servers:
            raise ValueError("score_ahead: true needs warm_servers: true (work starts ahead of its stage on a server "
                             "started ahead of it); set both, or score_ahead: false")
        return self


SPEC = EngineSpec("vllm", Settings, "pipeline.engines.vllm:VLLMEngine", "`vllm serve`, CUDA", "http", "vllm",
                  starts_server=True, likelihoods=True, images=True, deployed=True, package="vllm",
                  warm="pipeline.engines.vllm:warm", shown_as="vLLM")
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
        from pipeline.engines.long_context import context_length

        return int(self.settings.max_model_len or context_length(self.model_dir) or 4096)

    def apply_chat_template(self, messages: list[dict]) -> str:
        prompt = self.client.apply_chat_template(messages)
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
