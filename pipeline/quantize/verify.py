"""Checks run on every fresh variant before it is renamed into place; results go to quant.json.

- the plan: the modules quantized (in memory and in the checkpoint) are exactly every Linear
  outside plan.IGNORE, as listed from the loaded model before calibration;
- every vision-tower tensor is bit-identical to the base checkpoint;
- the checkpoint reloads with transformers and generates;
- the relative output error ||y_q - y_ref|| / ||y_ref|| of each decoder layer on a few held-out
  blocks, each layer fed the base model's own input (a local error, not an accumulated one);
- MoE: every routed expert saw calibration tokens (checked right after calibration, before saving).

A model calibrated offloaded (larger than the device) is reloaded the same way: on the host, each
module brought to the device to run.

Memory: the base model's per-layer inputs and outputs for those blocks are captured before
calibration and kept on the CPU: 2 x blocks x tokens x hidden x layers values (GLM-4-9B, 2
blocks of 256 tokens in float32: 2 x 512 x 4096 x 40 x 4 B = 0.67 GB). The variant is
reloaded only after the calibrated model is freed, so two models never share the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.errors import UserError
from pipeline.checkpoints import serving_names
from pipeline.quantize import plan

def _tensors(model_dir: Path) -> dict[str, "object"]:
    from safetensors import safe_open

    tensors = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                tensors[key] = (shard, key)
    return tensors


def vision_tensors_identical(variant_dir: Path, base_dir: Path) -> dict:
    """Every vision-tower tensor of the variant must equal the base's, bit for bit; also the dtypes the variant
    stores them in (safetensors' names, e.g. BF16: the report says what the tower is kept in)."""
    import torch
    from safetensors import safe_open

    base, variant = _tensors(base_dir), _tensors(variant_dir)
    vision = [k for k in base if ".visual." in k or k.startswith("visual.")]
    mismatched, dtypes = [], set()
    for key in vision:
        if key not in variant:
            mismatched.append(f"{key} (missing)")
            continue
        with safe_open(base[key][0], "pt") as fb, safe_open(variant[key][0], "pt") as fv:
            dtypes.add(fv.get_slice(key).get_dtype())
            if not torch.equal(fb.get_tensor(key), fv.get_tensor(key)):
                mismatched.append(key)
    return {"vision_tensors": len(vision), "mismatched": mismatched, "dtypes": sorted(dtypes)}


# ---------------------------------------------------------------- the plan

def quantized_in_checkpoint(variant_dir: Path) -> set[str]:
    """Modules the checkpoint stores quantized: every compressed-tensors format gives each one a
    `weight_scale` (int4 packed and FP8 alike; KV-cache scales are k_scale / v_scale)."""
    return {key.removesuffix(".weight_scale") for key in _tensors(variant_dir) if key.endswith(".weight_scale")}


def _differences(expected: set[str], found: set[str], where: str) -> list[str]:
    problems = []
    if missing := sorted(expected - found):
        problems.append(f"{len(missing)} planned but not quantized {where}: {', '.join(missing[:8])}"
                        + (" ..." if len(missing) > 8 else ""))
    if extra := sorted(found - expected):
        problems.append(f"{len(extra)} quantized {where} but not planned: {', '.join(extra[:8])}"
                        + (" ..." if len(extra) > 8 else ""))
    return problems


def check_plan(variant_dir: Path, expected: list[str], quantized: dict[str, str]) -> dict:
    """What was quantized must be the plan: each Linear outside plan.IGNORE, no more, no less."""
    planned = set(expected)
    if not planned:
        raise UserError(f"{variant_dir}: the plan quantizes nothing: no Linear module outside the ignore list "
                        f"{plan.ignore_patterns()}")
    problems = (_differences(planned, set(quantized), "in memory")
                + _differences(planned, quantized_in_checkpoint(variant_dir), "in the checkpoint"))
    if problems:
        raise UserError(f"{variant_dir}: quantized modules differ from the plan (every Linear outside "
                        f"{plan.ignore_patterns()}): " + "; ".join(problems))
    return {"planned": len(planned), "quantized": len(quantized), "matches": True}


# ---------------------------------------------------------------- per-layer error

@dataclass
class LayerCalls:
    """A decoder layer's inputs and outputs on the probe blocks, one entry per block, on CPU."""
    name: str
    calls: list[tuple[tuple, dict, "object"]] = field(default_factory=list)


decoder_layers = plan.decoder_layers


def _to(value, device):
    """Tensors moved to `device`, containers rebuilt, KV caches dropped (each call stands alone)."""
    import torch
    from transformers.cache_utils import Cache

    if isinstance(value, torch.Tensor):
        return value.detach().to(device)
    if isinstance(value, Cache):
        return None
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _hidden(output):
    return output[0] if isinstance(output, (tuple, list)) else output


def execution_device(model):
    """Where the model's inputs go: its onload device when offloaded, else where its weights are."""
    from compressed_tensors.offload import get_execution_device

    return get_execution_device(model)


def capture_layer_io(model, blocks: list[list[int]], device=None) -> list[LayerCalls]:
    """Runs the (not yet quantized) model on the probe blocks and keeps each decoder layer's
    arguments and output."""
    import torch

    layers = decoder_layers(model)
    records = [LayerCalls(name) for name, _ in layers]
    device = device or execution_device(model)

    def recorder(record: LayerCalls):
        def hook(module, args, kwargs, output):
            kwargs = _to({**kwargs, "use_cache": False}, "cpu")
            record.calls.append((_to(args, "cpu"), kwargs, _hidden(output).detach().cpu()))
        return hook

    handles = [layer.register_forward_hook(recorder(record), with_kwargs=True)
               for (_, layer), record in zip(layers, records)]
    try:
        with torch.no_grad():
            for block in blocks:
                model(input_ids=torch.tensor([block], device=device), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return records


def layer_errors(model, reference: list[LayerCalls]) -> list[float]:
    """||y_q - y_ref|| / ||y_ref|| per decoder layer, over all probe blocks."""
    import torch

    layers = dict(decoder_layers(model))
    device = execution_device(model)
    errors = []
    with torch.no_grad():
        for record in reference:
            diff = norm = 0.0
            for args, kwargs, expected in record.calls:
                actual = _hidden(layers[record.name](*_to(args, device), **_to(kwargs, device))).float().cpu()
                diff += (actual - expected.float()).pow(2).sum().item()
                norm += expected.float().pow(2).sum().item()
            errors.append(round(math.sqrt(diff / norm), 6) if norm else float("nan"))
    return errors


# ---------------------------------------------------------------- reload

def _generate(model, variant_dir: Path) -> str:
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(variant_dir)
    ids = tokenizer("The capital of France is", return_tensors="pt").to(execution_device(model))
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    return tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


def reload_and_check(variant_dir: Path, reference: list[LayerCalls], dtype, offload: bool = False) -> dict:
    """Reloads the variant the way the evaluation engine does, then the layer errors and a sample.
    offload: a model larger than the device stays on the host and each module visits the device
    to run (as during calibration)."""
    import torch

    from pipeline.checkpoints.loading import load_for_inference

    device = "cuda" if torch.cuda.is_available() else None
    model = load_for_inference(variant_dir, dtype, device=None if offload else device)
    if offload:
        from compressed_tensors.offload import set_onload_device

        set_onload_device(model, device or "cpu")
    errors = layer_errors(model, reference)
    sample = _generate(model, variant_dir)
    worst = max(range(len(errors)), key=lambda i: errors[i] if math.isfinite(errors[i]) else math.inf, default=None)
    return {
        "reloads": True,
        "sample": sample,
        "layer_error": {
            "relative": errors,
            "max": errors[worst] if worst is not None else None,
            "worst_layer": reference[worst].name if worst is not None else None,
            "blocks": len(reference[0].calls) if reference else 0,
        },
    }


def verify(variant_dir: Path, base_dir: Path, expected: list[str], quantized: dict[str, str],
           reference: list[LayerCalls], dtype, offload: bool = False) -> dict:
    vision = vision_tensors_identical(variant_dir, base_dir)
    if vision["mismatched"]:
        raise UserError(f"{variant_dir}: vision-tower tensors changed: {vision['mismatched'][:5]}")
    planned = check_plan(variant_dir, expected, quantized)
    names = serving_names.check(variant_dir)
    reloaded = reload_and_check(variant_dir, reference, dtype, offload=offload)
    error = reloaded["layer_error"]
    if error["relative"]:
        print(f"verify: decoder-layer relative output error max {error['max']:.4f} ({error['worst_layer']}), "
              f"mean {sum(error['relative']) / len(error['relative']):.4f} over {len(error['relative'])} layers")
    return {"vision": vision, "plan": planned, "serving_names": names, **reloaded}


# ---------------------------------------------------------------- MoE experts

def check_experts(counts: dict | None, needs_data: bool) -> dict | None:
    """Every routed expert must have seen calibration tokens (its AWQ scales and activation
    scales come from them); an expert that saw none fails the run, listed by name. A data-free
    recipe needs no tokens and is not checked."""
    if counts is None:
        return None
    summary = {"experts": sum(layer["experts"] for layer in counts["layers"].values()),
               "min_tokens_seen": min((layer["tokens_seen"]["min"] for layer in counts["layers"].values()), default=0),
               "never_routed": sum(layer["experts_never_routed"] for layer in counts["layers"].values()),
               "checked": needs_data}
    starved = counts["starved"]
    if needs_data and starved:
        shown = ", ".join(starved[:16]) + (f" ... ({len(starved)} in all)" if len(starved) > 16 else "")
        raise UserError(f"{len(starved)} MoE experts saw no calibration tokens, so their scales would be "
                        f"guesses: {shown}; calibrate with every expert on every token (the default) or "
                        "with more, and more varied, calibration blocks")
    return summary
