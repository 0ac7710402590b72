"""Sizes read off a checkpoint without loading it: weight bytes a decode step reads, KV-cache bytes
per token of context. What the bench's roofline and the engines' memory figures are built from."""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.checkpoints import checkpoint
from pipeline.checkpoints.headers import ITEMSIZE
from pipeline.errors import UserError


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 2) -> int:
    """KV cache bytes one token of context adds: 2 (K and V) x layers x KV heads x head dim."""
    layers, kv_heads, head_dim = checkpoint.open(model_dir).kv_cache_shape
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def checkpoint_weight_bytes(model_dir: Path) -> int:
    """Tensor bytes of a checkpoint, less its input embedding table (a decode step reads one row)
    unless the config ties it to the output layer."""
    from safetensors import safe_open

    tied = checkpoint.open(model_dir).tied_embeddings
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            for name in handle.keys():
                meta = handle.get_slice(name)
                is_embedding = "embed_tokens" in name or "word_embeddings" in name
                if not is_embedding or tied:
                    if meta.get_dtype() not in ITEMSIZE:
                        raise UserError(f"{path}: {name} has dtype {meta.get_dtype()}, which the roofline "
                                        "does not know the size of")
                    total += math.prod(meta.get_shape()) * ITEMSIZE[meta.get_dtype()]
    return total

