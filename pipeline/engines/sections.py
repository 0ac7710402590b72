"""Every engine's params.yaml section: `engine:` is validated as the section of the engine `engine.name` names, each
default written once, here. The registry (pipeline/engines/__init__.py) pairs each section with its engine's class
by name ("pipeline.engines.vllm:VLLMEngine"), so what validates params.yaml imports none of an engine's code: a
stage that only reads `engine:` (resave, calib, quantize) does not depend on the engines' modules, and an edit to
vllm_server.py reruns the stages that run an engine, not the quantization (pipeline/cli/code_reach.py).

Nothing here imports the registry, params.py or an engine module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from pipeline.engines.settings import MAX_TIMEOUT_S, EngineSettings, HTTPSettings, ModelDtype, env_var_name
from pipeline.errors import UserError

KvCacheDtype = Literal["checkpoint", "auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"]
PromptFormat = Literal["tokens", "text", "chat"]  # the openai engine's: how a prompt is sent (openai.py says each)
PROMPT_FORMATS = PromptFormat.__args__


class HFSettings(EngineSettings):
    """`engine:` with `name: hf`: transformers in this process (CPU or GPU)."""

    name: Literal["hf"] = "hf"
    max_batch_tokens: int = Field(65536, ge=1, le=1 << 24)  # rows x (longest prompt + new tokens) per batch
    dtype: ModelDtype = "float32"
    threads: int = Field(0, ge=0, le=1024)  # CPU threads (0: torch's default)


class VLLMSettings(HTTPSettings):
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
    # planned, fitted, a vision-language model only: what its server holds beyond non_kv_memory_gib once images come
    # (the vision tower's activations and vLLM's encoder cache): GLM-4.6V-Flash's base server held 36.6 GiB under
    # images against 31.7 planned with a text model's 5 (one H100, 2026-12-07). A server's measured footprint replaces
    # its plan once it has run (its supervisor reads nvidia-smi: pipeline/engines/server_registry.py)
    vision_memory_gib: float = Field(5.0, ge=0, le=1024)
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


class LMDeploySettings(EngineSettings):
    """`engine:` with `name: lmdeploy`: lmdeploy's PyTorch engine in this process, on the GPUs."""

    name: Literal["lmdeploy"] = "lmdeploy"
    dtype: ModelDtype = "float32"  # float32: the checkpoint's own dtype (lmdeploy's auto)
    tensor_parallel_size: int = Field(1, ge=1, le=64)


class OpenAISettings(HTTPSettings):
    """`engine:` with `name: openai`: a server already running that serves the checkpoint being evaluated (vLLM,
    lmdeploy api_server, ...). The judge's openai backend takes the judge section's own settings."""

    name: Literal["openai"] = "openai"
    base_url: str | None = None  # e.g. http://127.0.0.1:8000/v1
    model: str | None = None  # the served model's name
    api_key_env: str | None = None  # NAME of the environment variable holding the key, never the key
    # tokens: our rendered prompt as token ids to /v1/completions (no token changes); text: the same as text;
    # chat: messages to /v1/chat/completions, the server's own chat template
    prompt_format: PromptFormat = "tokens"
    concurrency: int = Field(8, ge=1, le=256)  # requests in flight

    _key_is_named = field_validator("api_key_env")(lambda value: env_var_name(value))

    def check(self) -> None:
        if not self.model:
            raise UserError("params.yaml: engine.model: with the openai engine, set the served model's name")
