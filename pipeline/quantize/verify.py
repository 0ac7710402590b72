"""Checks run on every fresh variant before it is renamed into place; results go to quant.json."""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import UserError


def _tensors(model_dir: Path) -> dict[str, "object"]:
    from safetensors import safe_open

    tensors = {}
    for shard in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            for key in f.keys():
                tensors[key] = (shard, key)
    return tensors


def vision_tensors_identical(variant_dir: Path, base_dir: Path) -> dict:
    """Every vision-tower tensor of the variant must equal the base's, bit for bit."""
    import torch
    from safetensors import safe_open

    base, variant = _tensors(base_dir), _tensors(variant_dir)
    vision = [k for k in base if ".visual." in k or k.startswith("visual.")]
    mismatched = []
    for key in vision:
        if key not in variant:
            mismatched.append(f"{key} (missing)")
            continue
        with safe_open(base[key][0], "pt") as fb, safe_open(variant[key][0], "pt") as fv:
            if not torch.equal(fb.get_tensor(key), fv.get_tensor(key)):
                mismatched.append(key)
    return {"vision_tensors": len(vision), "mismatched": mismatched}


def reload_and_generate(variant_dir: Path) -> dict:
    import torch
    from transformers import AutoTokenizer

    from pipeline.engines.loading import load_for_inference

    model = load_for_inference(variant_dir, torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(variant_dir)
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    text = tokenizer.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    return {"reloads": True, "sample": text}


def verify(variant_dir: Path, base_dir: Path, quantized: dict[str, str]) -> dict:
    vision = vision_tensors_identical(variant_dir, base_dir)
    if vision["mismatched"]:
        raise UserError(f"{variant_dir}: vision-tower tensors changed: {vision['mismatched'][:5]}")
    if not quantized:
        raise UserError(f"{variant_dir}: no module was quantized; check the recipe's targets")
    return {"vision": vision, **reload_and_generate(variant_dir)}
