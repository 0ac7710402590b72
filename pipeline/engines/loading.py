"""Loading a checkpoint for inference, quantized variants included, the same way for every engine
that runs in-process.

A compressed-tensors checkpoint is decompressed once at load (packed int4 / fp8 weights become
dense weights holding exactly the quantized values). Activation and KV-cache quantization stay
on: compressed-tensors fake-quantizes inputs with the calibrated scales in each forward, so an
FP8 W8A8 variant is scored with its activations and KV cache in FP8, not as weights-only.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.quantize import plan


def is_compressed_tensors(model_dir: Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return (config.get("quantization_config") or {}).get("quant_method") == "compressed-tensors"


def load_model(model_dir: Path, dtype, **kwargs):
    """The checkpoint as transformers builds it; MoE routed experts as one Linear per expert
    where llm-compressor knows how (see compat.load_linearized)."""
    import transformers

    from pipeline.checkpoints import auto_model_class

    config = transformers.AutoConfig.from_pretrained(model_dir)
    auto = auto_model_class(config)
    if plan.routed_experts(config.to_dict()):
        from pipeline.quantize import compat

        if compat.loads_linearized(config.model_type):
            model_cls = auto._model_mapping[type(config)]
            return compat.load_linearized(model_cls, model_dir, config.model_type, dtype=dtype, **kwargs)
    return auto.from_pretrained(model_dir, dtype=dtype, **kwargs)


def load_for_inference(model_dir: Path | str, dtype, device: str | None = None):
    """`device` loads the weights straight onto it (a 9B model staged through host memory first
    costs minutes); None keeps them on the CPU."""
    model_dir = Path(model_dir)
    placement = {"device_map": device} if device else {}
    if not is_compressed_tensors(model_dir):
        return load_model(model_dir, dtype, **placement)
    import warnings

    from compressed_tensors.quantization import QuantizationStatus
    from transformers import CompressedTensorsConfig

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "the model already has a quantization_config": intended
        model = load_model(model_dir, dtype, quantization_config=CompressedTensorsConfig(dequantize=True), **placement)
    for module in model.modules():
        if getattr(module, "quantization_status", None) == QuantizationStatus.DECOMPRESSED:
            # The dense weights already sit on the quantization grid: re-quantizing them in every
            # forward would change nothing and cost a pass over all weights per token.
            module.quantization_status = QuantizationStatus.COMPRESSED
    return model
