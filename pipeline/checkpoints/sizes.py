"""Sizes read off a checkpoint without loading it: weight bytes a decode step reads, KV-cache bytes
per token of context. What the bench's roofline and the engines' memory figures are built from."""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.checkpoints import checkpoint
from pipeline.checkpoints.headers import ITEMSIZE
from pipeline.errors import UserError


def kv_bytes_per_token(kv_cache_shape: tuple[int, int, int], element_bytes: int = 2, tensor_parallel: int = 1) -> int:
    """KV cache bytes one token of context adds on one GPU: 2 (K and V) x layers x KV heads (split over the GPUs of
    tensor parallelism, at least one each) x head dim x the cache's element size (kv_element_bytes). The shape is
    a checkpoint's `kv_cache_shape` (checkpoint.open(dir), or config_json.kv_cache_shape(config))."""
    layers, kv_heads, head_dim = kv_cache_shape
    return 2 * layers * max(1, math.ceil(kv_heads / tensor_parallel)) * head_dim * element_bytes


def kv_element_bytes(kv_cache_dtype: str, model_dtype_bytes: int = 2) -> int:
    """A KV cache element's bytes: 1 for an FP8 cache (fp8, fp8_e4m3, ...), else the model's dtype's."""
    return 1 if kv_cache_dtype.startswith("fp8") else model_dtype_bytes


def stored_bits_per_weight(bits: float, group_size: int | None, zero_point_bits: float = 0.0) -> float:
    """Bits a quantized weight takes in its checkpoint: its own, and per group of group_size weights a 16-bit scale
    and (asymmetric) a zero point of zero_point_bits; per channel (group_size None) its own bits (one scale a row is
    negligible)."""
    return bits + ((16 + zero_point_bits) / group_size if group_size else 0.0)


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

