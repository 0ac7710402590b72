"""Loading a checkpoint: for inference (quantized variants included, the same way for every engine
that runs in-process), for quantization, and on the meta device (names and shapes, no weights).

A compressed-tensors checkpoint is decompressed once at load (packed int4 / fp8 weights become
dense weights holding exactly the quantized values). Activation and KV-cache quantization stay
on: compressed-tensors fake-quantizes inputs with the calibrated scales in each forward, so an
FP8 W8A8 variant is scored with its activations and KV cache in FP8, not as weights-only.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoints import checkpoint, config_json


def auto_model_class(config):
    """The transformers Auto class that builds this config's model: image-text-to-text for VLMs
    (Glm4v and kin), causal LM otherwise."""
    import transformers

    if type(config) in transformers.AutoModelForImageTextToText._model_mapping:
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def meta_model(model_dir: Path | str):
    """The checkpoint's model built on the meta device: shapes and names, no memory, no weights read."""
    import torch

    config = config_json.load(model_dir)
    with torch.device("meta"):
        return auto_model_class(config).from_config(config)


def load_model(model_dir: Path, dtype, **kwargs):
    """The checkpoint as transformers builds it; MoE routed experts as one Linear per expert
    where llm-compressor knows how (see linear_experts.load_linearized)."""
    config = config_json.load(model_dir)
    auto = auto_model_class(config)
    if config_json.routed_experts(config.to_dict()):
        from pipeline.checkpoints import linear_experts

        if linear_experts.loads_linearized(config.model_type):
            model_cls = auto._model_mapping[type(config)]
            return linear_experts.load_linearized(model_cls, model_dir, config.model_type, dtype=dtype, **kwargs)
    return auto.from_pretrained(model_dir, dtype=dtype, **kwargs)


def load_for_inference(model_dir: Path | str, dtype, device: str | None = None):
    """`device` loads the weights straight onto it (a 9B model staged through host memory first
    costs minutes); None keeps them on the CPU."""
    model_dir = Path(model_dir)
    placement = {"device_map": device} if device else {}
    if not checkpoint.open(model_dir).is_compressed_tensors:
        return load_model(model_dir, dtype, **placement)
    import warnings

    from compressed_tensors.quantization import QuantizationStatus
    from transformers import CompressedTensorsConfig

    from pipeline.checkpoints.unpack import fast_unpacking

    with warnings.catch_warnings(), fast_unpacking():  # int4 codes unpacked bytewise: the same codes, faster
        warnings.simplefilter("ignore")  # "the model already has a quantization_config": intended
        model = load_model(model_dir, dtype, quantization_config=CompressedTensorsConfig(dequantize=True), **placement)
    for module in model.modules():
        if getattr(module, "quantization_status", None) == QuantizationStatus.DECOMPRESSED:
            # The dense weights already sit on the quantization grid: re-quantizing them in every
            # forward would change nothing and cost a pass over all weights per token.
            module.quantization_status = QuantizationStatus.COMPRESSED
    if device is None:
        plain_forwards(model)
    return model


def plain_forwards(model) -> int:
    """On the CPU, each quantized Linear as a plain one where its wrappers do nothing: compressed-tensors
    "offloads" every module from the CPU to the CPU (each weight read through its cache) and wraps the forward of
    each in one that fake-quantizes activations; a W4A16 module has none to quantize, its weights already hold their
    quantized values (above), so its forward is Linear's own, with the same weight: the same numbers, and no
    per-call overhead (0.25 -> 0.16 ms a call, 210 calls per decoding step of the demo model). An FP8 module keeps
    its activations' fake quantization. Returns the modules made plain."""
    from compressed_tensors.offload.dispatch import remove_dispatch
    from compressed_tensors.quantization import QuantizationStatus

    remove_dispatch(model)  # the tensors stay where they are: on the CPU
    plain = 0
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if (scheme is not None and "forward" in vars(module) and not scheme.input_activations
                and not scheme.output_activations
                and getattr(module, "quantization_status", None) == QuantizationStatus.COMPRESSED):
            del module.forward  # the class's forward again
            plain += 1
    return plain
