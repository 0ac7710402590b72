"""The run's server plan (engine.kv_cache_memory: fitted): every model the run serves, sized from its checkpoint or,
not built yet, from the base's tensors and its method (pipeline/engines/server_plan.py), side by side on this GPU.

`quantize warm` prints it before the first server starts (warm@base, right after resave) and again as each checkpoint
is built, and keeps it in the servers' registry, where `quantize bench` reads it into bench.json; `quantize warm
--plan` prints it alone. A GPU on which a model does not fit alone, or a variant not beside the base whose server
judges it, stops the run there (exit 2, with the setting to change).
"""

from __future__ import annotations

from pathlib import Path

from pipeline.outputs import STAGE_RECORD

GROUP_WHEN_AUTO = 128  # a group_size of `auto` in the estimate: the first int4.GROUP_SIZES that divides GLM's widths


def served_models(p) -> list[str]:
    """base, the variants and their fixes, in the run's order."""
    from pipeline.settings import fixes

    return fixes.models(p)


def model_dir(p, name: str) -> Path:
    return Path(p.model.base_dir) if name == "base" else Path("models") / name


def _bits_and_group(p, name: str) -> tuple[float, int | None]:
    """A variant's bits per quantized weight and its group (None: per channel), from params.yaml."""
    from pipeline import methods
    from pipeline.settings import fixes

    fixed = name.removesuffix(fixes.SUFFIX) if name.endswith(fixes.SUFFIX) else None
    settings = p.variants[fixed] if fixed in p.variants else p.variants[name]
    group = getattr(settings, "group_size", None)
    group = group if isinstance(group, int) else (GROUP_WHEN_AUTO if group is not None else None)
    if fixed is not None:
        return float(p.fix.max_bits), group
    bits = getattr(methods.method(settings.method), "WEIGHT_BITS", None)  # none: a budget of its own (mixed)
    return float(bits if bits is not None else settings.max_bits), group


def shares(p, device_bytes: int):
    """Each served model's share (server_plan.Share) with the run's engine settings on a GPU of device_bytes: a built
    checkpoint's as its server will be started with (vllm_server.fitted_share), or what a server of it was measured to
    hold in this run where that is more (pipeline/engines/gpu_room.py); one not built yet estimated."""
    from pipeline.engines import server_plan
    from pipeline.engines.server_registry import model_peak_bytes
    from pipeline.engines.vllm_server import fitted_share

    e = p.engine
    base = Path(p.model.base_dir)
    found = []
    for name in served_models(p):
        directory = model_dir(p, name)
        if (directory / STAGE_RECORD).is_file() and any(directory.glob("*.safetensors")):
            share, _ = fitted_share(directory, e, device=device_bytes, name=name)
            share = share.measured(model_peak_bytes(directory))  # what its server was seen to hold, if more
        else:
            bits, group = _bits_and_group(p, name)
            share, _ = fitted_share(
                base, e, device=device_bytes, name=name, kv_cache_dtype=_planned_kv_dtype(p, name, e.kv_cache_dtype),
                estimated_weights=server_plan.estimated_weight_bytes(base, bits, group, e.tensor_parallel_size))
        found.append(share)
    return found


def _planned_kv_dtype(p, name: str, setting: str) -> str:
    """The KV cache an unbuilt variant will be served with: `checkpoint` gives FP8 to a variant whose method writes
    FP8 KV-cache scales (fp8 with kv per-head or per-tensor)."""
    if setting != "checkpoint":
        return setting
    settings = p.variants.get(name)
    return "fp8" if settings is not None and getattr(settings, "kv", "none") != "none" else "auto"


def run_plan(p):
    """The run's plan (server_plan.Plan), or None when the engine does not fit its servers (kv_cache_memory other
    than fitted, or no server engine). Raises UserError when a model does not fit this GPU."""
    from pipeline.engines import capability, server_plan
    from pipeline.engines.vllm_server import device_bytes

    e = p.engine
    if not capability(e.name, "starts_server") or getattr(e, "kv_cache_memory", None) != "fitted":
        return None
    device = device_bytes(e, "fitted")
    pinned = "base" if p.judge.model == "base" and capability(p.judge.backend, "starts_server") else None
    return server_plan.plan(shares(p, device), device_bytes=device, fraction=e.gpu_memory_utilization,
                            pinned=pinned, device_source="engine.device_memory_gib" if e.device_memory_gib
                            else "nvidia-smi")


def announce(p) -> list[str]:
    """The plan's lines, kept in the servers' registry for bench.json; [] when the engine plans nothing."""
    from pipeline.engines import server_plan, shared

    found = run_plan(p)
    if found is None:
        return []
    server_plan.write(found, shared.registry_dir())
    return found.lines()

