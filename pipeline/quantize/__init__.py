"""The quantize stage (stage.py) and what it runs on: the plan, llm-compressor's calibration, verification. The
methods it runs are registered in pipeline/methods/ (one module each)."""


def require_llmcompressor() -> None:
    """The quantization stages need the `quantize` extra (llm-compressor); say so instead of an ImportError."""
    try:
        import llmcompressor  # noqa: F401
    except ImportError:
        from pipeline.errors import UserError

        raise UserError("quantizing needs llm-compressor: pip install -e '.[quantize]' (it pins compressed-tensors "
                        "0.19, which vLLM's 0.17 pin excludes: keep vLLM in its own environment)") from None
