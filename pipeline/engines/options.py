"""What each engine takes from params.yaml's `engine` section: one function per engine kind, named by its
EngineSpec (`options`), returning make_engine's keyword arguments.

Each gets the validated section (pipeline.settings.params.EngineParams, not imported here: params imports the
registry, so the registry imports no params) and reads the settings its engine uses.
"""

from __future__ import annotations

from pipeline.errors import UserError


def in_process(e) -> dict:
    """hf, and any in-process engine without its own: batches, dtype, CPU threads."""
    return {"batch_size": e.batch_size, "max_batch_tokens": e.max_batch_tokens, "dtype": e.dtype,
            "threads": e.threads}


def lmdeploy(e) -> dict:
    """In-process, over tensor_parallel_size GPUs."""
    return {**in_process(e), "tensor_parallel_size": e.tensor_parallel_size}


def vllm(e) -> dict:
    """`vllm serve`, started by the stage: vLLM's own settings, the server's and the HTTP client's."""
    return {"batch_size": e.batch_size, "tensor_parallel_size": e.tensor_parallel_size,
            "max_model_len": e.max_model_len, "gpu_memory_utilization": e.gpu_memory_utilization,
            "kv_cache_dtype": e.kv_cache_dtype, "enable_prefix_caching": e.enable_prefix_caching,
            "max_num_batched_tokens": e.max_num_batched_tokens, "max_num_seqs": e.max_num_seqs,
            "server_command": e.server_command, "server_env": e.server_env,
            "server_args": e.server_args, "start_timeout": e.start_timeout,
            "share_server": e.share_server, "server_idle_timeout": e.server_idle_timeout,
            "max_servers": e.max_servers, "kv_cache_memory": e.kv_cache_memory,
            "non_kv_memory_gib": e.non_kv_memory_gib, "device_memory_gib": e.device_memory_gib,
            "timeout": max(e.timeout, 600.0), "retries": min(e.retries, 1),
            "max_response_bytes": e.max_response_bytes, "enable_expert_parallel": e.enable_expert_parallel,
            "defect_workarounds": e.defect_workarounds,
            "dtype": e.dtype if e.dtype != "float32" else None}


def openai(e) -> dict:
    """A server already running: where it is, the served model's name and the HTTP client's settings."""
    if not e.model:
        raise UserError("params.yaml: engine.model: with the openai engine, set the served model's name")
    return {"base_url": e.base_url, "model": e.model, "api_key_env": e.api_key_env,
            "concurrency": e.concurrency, "timeout": e.timeout, "retries": e.retries,
            "batch_size": e.concurrency * 4, "params_section": "engine",
            "prompt_format": e.prompt_format, "max_response_bytes": e.max_response_bytes}
