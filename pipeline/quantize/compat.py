"""Work-arounds for llm-compressor on machines it was not tested on (a CPU without an accelerator).

MoE checkpoints whose routed experts load as one Linear per expert: pipeline/checkpoints/linear_experts.py."""

from __future__ import annotations

import torch


def patch_cpu_pin_memory() -> None:
    """llm-compressor's AWQ pins its activation cache before each grid search; on a CPU-only
    torch `Tensor.pin_memory()` raises (there is no accelerator to pin for). Pinning only
    speeds host-to-device copies, so without an accelerator it is safely a no-op."""
    if torch.accelerator.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, batch_index, input_names=None: None


def _cpu_warning_once(record) -> None:
    if record["message"].startswith("No accelerator available"):
        record["extra"]["log_once"] = True  # llm-compressor's handlers print such records once


def quiet_cpu_warning() -> None:
    """llm-compressor warns "No accelerator available!" on every device lookup, hundreds of
    times a run on CPU; have it said once. A loguru patcher, so it holds for llm-compressor's
    import-time warnings too as long as this runs first (it replaces any other patcher)."""
    if torch.accelerator.is_available():
        return
    from loguru import logger

    logger.configure(patcher=_cpu_warning_once)
