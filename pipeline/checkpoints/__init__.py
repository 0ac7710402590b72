"""Checkpoint normalisation: any supported source -> a plain Hugging Face safetensors directory."""
