"""The one-layer probe behind `quantize awq|fp8 --plan`: how long one decoder layer's calibration
takes on this machine, with the real recipe, the real calibration blocks and batch size, and the
real placement (whole model on the device, or offloaded to the host), and how much device memory
it peaks at. Multiplied out by the number of layers of each kind, that is the expected run.

The probe model is the checkpoint's own architecture and widths, cut to one decoder layer of each
kind (a dense one and an MoE one for GLM-4.5V-style models), a one-block vision tower, with random
weights: time and memory do not depend on the values (every expert sees every token with
calibrate-all-experts, whatever the router says). Nothing is read from the checkpoint but its
config, and nothing is written.
"""

from __future__ import annotations

import copy
from pathlib import Path

from pipeline.checkpoints import config_json
from pipeline.quantize import plan


def probe_config(model_dir: Path):
    """The checkpoint's config cut to one decoder layer per kind."""
    config = config_json.load(model_dir)
    text = config.get_text_config()
    layers = text.num_hidden_layers
    dense_first = int(getattr(text, "first_k_dense_replace", 0) or 0)
    keep = min(layers, 2 if config_json.routed_experts(config.to_dict()) and dense_first else 1)
    if dense_first:
        text.first_k_dense_replace = min(dense_first, 1)
    for key, value in list(vars(text).items()):  # per-layer lists (layer_types, ...)
        if isinstance(value, list) and len(value) == layers and key != "eos_token_id":
            setattr(text, key, value[:keep])
    text.num_hidden_layers = keep
    vision = getattr(config, "vision_config", None)
    if vision is not None and hasattr(vision, "depth"):
        vision.depth = 1
    return config


def build(model_dir: Path, dtype, device: str):
    """The probe model with random weights, built on `device`."""
    import torch

    from pipeline.checkpoints.loading import auto_model_class
    from pipeline.checkpoints import linear_experts

    config = probe_config(model_dir)
    model_cls = auto_model_class(config)._model_mapping[type(config)]
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            if config_json.routed_experts(config.to_dict()) and linear_experts.loads_linearized(config.model_type):
                model = linear_experts.build_linearized(model_cls, config)
            else:
                model = model_cls(config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(dtype).eval()


def run(recipe: list, model_dir: Path, tokenizer, blocks: list[list[int]], batch_size: int, dtype,
        placement: str) -> dict:
    """Times one layer of each kind. `recipe` is copied: the run's own modifiers stay unused."""
    import gc

    import torch
    from llmcompressor.core import active_session

    from pipeline.quantize.calibrate import activations_device_for, calibrate

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    model = build(model_dir, dtype, device)
    if placement == "offload":
        model.to("cpu")
    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    probe_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kinds = {name: plan.layer_kind(layer) for name, layer in plan.decoder_layers(model)}
    layer_params = sum(sum(p.numel() for p in layer.parameters()) for _, layer in plan.decoder_layers(model))
    try:
        result = calibrate(model, tokenizer, blocks, [copy.deepcopy(m) for m in recipe], batch_size,
                           activations_device=activations_device_for(device, on_gpu, placement == "offload"))
    finally:
        del model
        active_session().reset()
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    per_kind = {}
    for name, kind in kinds.items():
        per_kind[kind] = {"seconds": result.layers["seconds"][name],
                          "peak_gpu_bytes": (result.layers["peak_gpu_bytes"] or {}).get(name)}
    return {"kinds": per_kind, "seconds": round(result.seconds, 2), "before_layers_s": round(result.before_layers_s, 2),
            "after_layers_s": round(result.after_layers_s, 2), "layer_params": layer_params,
            "model_bytes": probe_bytes, "device": torch.cuda.get_device_name() if on_gpu else "cpu",
            "placement": placement}
