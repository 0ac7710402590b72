"""Quantize-then-prove pipeline: build AWQ / FP8 variants and judge them against the FP16 base."""

__version__ = "0.1.0"
