"""Quantization stages: AWQ W4A16 and FP8 W8A8 (+ FP8 KV cache), built on llm-compressor."""
