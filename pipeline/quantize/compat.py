"""Work-arounds for llm-compressor on machines it was not tested on."""

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
