"""vLLM's server, from a checkpoint and the engine's settings: the `vllm serve` command line (the KV-cache dtype
the checkpoint asks for, the serving dtype, the defect workarounds), the planned KV pool, and the run's early start
(`quantize warm`). The engine that talks to the server: pipeline/engines/vllm.py."""

from __future__ import annotations

from pathlib import Path

import pipeline.engines.vllm_defects as vllm_defects
from pipeline.checkpoints import checkpoint
from pipeline.engines.gpu_memory import GIB, device_memory_bytes
from pipeline.engines.reasoning import vllm_reasoning_parser
from pipeline.engines.vision import is_multimodal
from pipeline.engines.sections import VLLMSettings as Settings
from pipeline.errors import UserError

SERVED_NAME = "model"
# vLLM applies a chat template to /v1/chat/completions; ours renders the prompt already: pass it through
PASSTHROUGH_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
# the settings that shape the server (its command line, hence a shared server's key): the report names them
SERVER_SETTINGS = ("tensor_parallel_size", "enable_expert_parallel", "max_model_len", "gpu_memory_utilization",
                   "kv_cache_dtype", "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs", "dtype",
                   "server_args", "kv_cache_memory", "non_kv_memory_gib", "vision_memory_gib", "device_memory_gib", "defect_workarounds")


def server_settings(settings: Settings) -> dict:
    """The settings that shape the server, as the report names them (float32 dtype: the checkpoint's own, None)."""
    shown = settings.model_dump(include=set(SERVER_SETTINGS))
    return {key: shown[key] for key in SERVER_SETTINGS} | {"dtype": settings.dtype if settings.dtype != "float32"
                                                            else None}


def kv_cache_scheme(model_dir: Path) -> dict | None:
    return checkpoint.open(model_dir).kv_cache_scheme


def resolve_kv_cache_dtype(setting: str, model_dir: Path) -> str:
    """`checkpoint`: fp8 when the checkpoint carries FP8 KV-cache scales, else auto (the model's dtype)."""
    if setting != "checkpoint":
        return setting
    scheme = kv_cache_scheme(model_dir)
    return "fp8" if scheme and scheme.get("type") == "float" and scheme.get("num_bits") == 8 else "auto"


def serving_dtype(setting: str | None, kv_cache_dtype: str, model_dir: Path) -> str | None:
    """The model dtype to serve in. vLLM 0.24's FlashAttention-3 FP8 path writes bfloat16 only (on the H200
    a float16 model with an FP8 KV cache died at its first request: "For FP8 input, output must have dtype
    BF16"), so an FP8 KV cache is served in bfloat16 unless the user asked for float16, which is refused."""
    if not kv_cache_dtype.startswith("fp8"):
        return setting if setting in ("float16", "bfloat16") else None
    if setting == "float16":
        raise UserError(f"params.yaml: engine.dtype: float16 with an FP8 KV cache ({model_dir}): vLLM's FP8 attention "
                        "outputs bfloat16 only; use engine.dtype bfloat16, or engine.kv_cache_dtype auto")
    return "bfloat16"


def refuse_unservable(model_dir: Path) -> None:
    """Before any server starts: a checkpoint vLLM has no model for (pipeline/checkpoints/serving.py CANNOT: GLM-4.6V as
    transformers' glm46v type, with the way out), and a quantized one whose full-precision Linears vLLM would build
    quantized, are not served."""
    from pipeline.checkpoints.serving import cannot

    if why := cannot("vllm", checkpoint.open(model_dir).config):
        raise UserError(f"{model_dir}: {why}")
    if checkpoint.open(model_dir).quantization:
        from pipeline.checkpoints import serving_names

        serving_names.check(Path(model_dir))


def server_args(model_dir: Path, port: int | None, settings: Settings) -> list[str]:
    """vLLM's CLI arguments for `settings`; port None leaves `--port` out (a shared server's port is appended
    when it starts, pipeline/engines/shared.py)."""
    kv = resolve_kv_cache_dtype(settings.kv_cache_dtype, model_dir)
    args = [str(model_dir), "--host", "127.0.0.1", *(["--port", str(port)] if port is not None else []),
            "--served-model-name", SERVED_NAME,
            "--generation-config", "vllm", "--seed", "0",
            "--tensor-parallel-size", str(settings.tensor_parallel_size)]
    if settings.kv_cache_memory == "fitted":  # its own share of the GPU, and the pool it was fitted
        share, device = fitted_share(model_dir, settings)
        args += ["--gpu-memory-utilization", str(share.utilization(device)), "--kv-cache-dtype", kv,
                 "--kv-cache-memory-bytes", str(share.pool_bytes)]
    else:
        args += ["--gpu-memory-utilization", str(settings.gpu_memory_utilization), "--kv-cache-dtype", kv]
    for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
        if getattr(settings, name):
            args += [f"--{name.replace('_', '-')}", str(getattr(settings, name))]
    if settings.enable_prefix_caching is not None:
        args.append("--enable-prefix-caching" if settings.enable_prefix_caching else "--no-enable-prefix-caching")
    dtype = serving_dtype(settings.dtype, kv, model_dir)
    if dtype:
        args += ["--dtype", dtype]
    if settings.kv_cache_memory == "planned":
        args += ["--kv-cache-memory-bytes", str(planned_kv_cache_bytes(model_dir, settings))]
    if settings.enable_expert_parallel:
        args.append("--enable-expert-parallel")
    if is_multimodal(model_dir):
        args += ["--chat-template", PASSTHROUGH_TEMPLATE, "--chat-template-content-format", "string"]
    user_args = [str(a) for a in settings.server_args]
    if "--reasoning-parser" not in user_args and (parser := vllm_reasoning_parser(checkpoint.open(model_dir).config,
                                                                                model_dir)):
        args += ["--reasoning-parser", parser]  # a thinking template: the chat endpoint answers as served
    args += vllm_defects.server_args(checkpoint.open(model_dir).config, user_args, settings.defect_workarounds)
    return args + user_args


def server_command_for(model_dir: Path, settings: Settings) -> list[str]:
    """The whole `vllm serve` command line for this checkpoint and these settings, without its port: what a
    shared server is keyed by (pipeline/engines/shared.py), so a server started early for the checkpoint
    (`warm`) is the very one a stage asks for later."""
    return list(settings.server_command) + server_args(Path(model_dir), None, settings)


def fitted_share(model_dir: Path, settings: Settings, *, device: int | None = None, name: str | None = None,
                 estimated_weights: int | None = None, kv_cache_dtype: str | None = None):
    """engine.kv_cache_memory: fitted. This checkpoint's server share of the GPU (pipeline/engines/server_plan.py):
    its weights, the KV pool its requests need or what is left, the reserve; and the GPU's memory (device: given, else
    device_bytes). A checkpoint not built yet (the run's plan, pipeline/stages/warm.py): model_dir the base, whose
    shapes it has, with its estimated weights and the KV cache dtype it will be served with."""
    import pipeline.engines.server_plan as server_plan
    from pipeline.checkpoints import config_json
    from pipeline.checkpoints.sizes import kv_bytes_per_token, kv_element_bytes

    device = device or device_bytes(settings, "fitted")
    model_dir = Path(model_dir)
    tp = settings.tensor_parallel_size
    config = checkpoint.open(model_dir).config
    kv = kv_cache_dtype or resolve_kv_cache_dtype(settings.kv_cache_dtype, model_dir)
    weights = estimated_weights if estimated_weights is not None else server_plan.weight_bytes(model_dir, tp)
    share = server_plan.fit(
        name or model_dir.name, weights, kv_bytes_per_token(config_json.kv_cache_shape(config), kv_element_bytes(kv), tp),
        device_bytes=device, fraction=settings.gpu_memory_utilization, reserve_bytes=reserve_bytes(model_dir, settings),
        batch_size=settings.batch_size, request_tokens=settings.plan_request_tokens,
        max_model_len=int(settings.max_model_len or checkpoint.open(model_dir).max_positions or 4096),
        estimated=estimated_weights is not None)
    return share, device


def reserve_bytes(model_dir: Path, settings: Settings) -> int:
    """What a server holds beside its weights and KV pool: engine.non_kv_memory_gib, and for a vision-language model
    engine.vision_memory_gib more (its images' activations and encoder cache)."""
    vision = settings.vision_memory_gib if is_multimodal(model_dir) else 0.0
    return int((settings.non_kv_memory_gib + vision) * GIB)


def server_memory(model_dir: Path, settings: Settings) -> dict:
    """What a shared server is admitted by (pipeline/engines/shared.py): fitted, its planned bytes and the budget of
    the run's servers together; otherwise none (engine.max_servers alone bounds them)."""
    if settings.kv_cache_memory != "fitted" or not settings.share_server:
        return {"gpu_bytes": None, "gpu_budget": None}
    from pipeline.engines.server_registry import model_peak_bytes

    share, device = fitted_share(model_dir, settings)
    seen = model_peak_bytes(model_dir) or 0  # a server of this checkpoint measured earlier in the run, under load
    return {"gpu_bytes": max(share.total_bytes, seen), "gpu_budget": int(settings.gpu_memory_utilization * device)}


def device_bytes(settings: Settings, mode: str) -> int:
    """One GPU's memory for engine.kv_cache_memory `mode` (fitted, planned): refused, saying what to set, without it."""
    device = device_memory_bytes(settings.device_memory_gib)
    if device is None:
        raise UserError(f"params.yaml: engine.kv_cache_memory: {mode} needs the GPU's memory: no nvidia-smi here; "
                        "set engine.device_memory_gib, or use engine.kv_cache_memory: auto")
    return device


def planned_kv_cache_bytes(model_dir: Path, settings: Settings) -> int:
    """engine.kv_cache_memory: planned. The KV pool of one GPU, fixed before the server starts instead of
    measured by vLLM's start-up profiling: gpu_memory_utilization x the GPU's memory, less this GPU's share
    of the checkpoint's weights and engine.non_kv_memory_gib (activations, CUDA graphs, the CUDA context).
    vLLM's profiling reads the whole device's free memory, so a server that profiles while another process
    allocates or frees GPU memory sizes its pool wrongly or stops; a planned pool lets a server start while
    other work runs (pipeline/engines/shared.py: warm)."""
    import pipeline.engines.server_plan as server_plan

    device = device_bytes(settings, "planned")
    tp = settings.tensor_parallel_size
    weights = server_plan.weight_bytes(Path(model_dir), tp)
    reserve = reserve_bytes(Path(model_dir), settings)
    budget = int(settings.gpu_memory_utilization * device)
    pool = budget - weights - reserve
    if pool <= 0:
        raise UserError(f"params.yaml: engine.gpu_memory_utilization {settings.gpu_memory_utilization} of "
                        f"{device / GIB:.0f} GiB leaves no KV cache for {model_dir} (weights {weights / GIB:.1f} GiB, "
                        f"engine.non_kv_memory_gib {reserve / GIB:g}); raise gpu_memory_utilization")
    return pool


def warm(model_dir: Path | str, settings: Settings, *, log_path: Path | str | None = None) -> str | None:
    """Starts the run's shared server for this checkpoint in the background (pipeline/engines/shared.py: warm),
    with the very command line VLLMEngine will ask for, so the stage that needs it attaches. Returns the key of
    a server it started, None when one was up or starting already (or max_servers are up). A checkpoint vLLM
    could not serve as it is is left to the stage that asks for it, which says why."""
    import pipeline.engines.shared as shared

    model_dir = Path(model_dir)
    try:
        refuse_unservable(model_dir)
        command = server_command_for(model_dir, settings)
    except UserError:
        return None
    return shared.warm(command, "--port", model_dir=model_dir,
                       log_path=Path(log_path) if log_path else Path("results") / model_dir.name / "vllm-server.log",
                       env=settings.server_env, start_timeout=settings.start_timeout,
                       idle_timeout=settings.server_idle_timeout, max_servers=settings.max_servers, name="vLLM server",
                       **server_memory(model_dir, settings))
