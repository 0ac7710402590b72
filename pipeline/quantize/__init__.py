"""Quantization stages: AWQ W4A16 and FP8 W8A8 (+ FP8 KV cache), built on llm-compressor."""


def require_llmcompressor() -> None:
    """The quantization stages need the `quantize` extra (llm-compressor); say so instead of an ImportError."""
    try:
        import llmcompressor  # noqa: F401
    except ImportError:
        from pipeline.errors import UserError

        raise UserError("quantizing needs llm-compressor: pip install -e '.[quantize]' (it pins compressed-tensors "
                        "0.19, which vLLM's 0.17 pin excludes: keep vLLM in its own environment)") from None
