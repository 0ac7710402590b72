"""Checkpoint normalisation: any supported source -> a plain Hugging Face safetensors directory;
config.json's facts (config_json) and model loading (loading) beside it."""
