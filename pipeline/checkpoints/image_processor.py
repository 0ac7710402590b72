"""A vision-language checkpoint's image preparation, as its own files say it (no engine): its image processor
(PIL backend: GLM's processor bundles a video processor that needs torchvision, which images do not), the markup
that stands for one image in a rendered prompt, and the image tokens each image expands to. The engines
(pipeline/engines/vision.py) and `quantize calib` (a VLM's image samples) share them.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.checkpoints import checkpoint


def tokens_per_grid(grid_thw, merge_size: int) -> list[int]:
    """Image tokens per image from the processor's grids: t*h*w / merge^2 (the vision tower merges merge x merge
    patches into one token)."""
    return (grid_thw.prod(-1) // merge_size ** 2).tolist()


def image_tokens(image_processor, images) -> list[int]:
    """The image tokens each image takes, as the model's processor computes them (what the hf engine expands an
    image token to, and what vLLM's processor for the model does)."""
    grid = image_processor(images=list(images), return_tensors="pt")["image_grid_thw"]
    return tokens_per_grid(grid, image_processor.merge_size)


def load_image_processor(model_dir: Path | str):
    """The checkpoint's image processor, PIL backend (no torchvision needed)."""
    import transformers

    path = Path(model_dir) / "preprocessor_config.json"
    if not path.exists():
        raise ValueError(f"{model_dir}: no preprocessor_config.json, so images cannot be prepared for this "
                         "model; copy it from the base checkpoint")
    kind = json.loads(path.read_text())["image_processor_type"]
    cls = getattr(transformers, kind.removesuffix("Fast") + "Pil", None)
    if cls is None:
        raise ValueError(f"{model_dir}: no PIL image processor for {kind!r} in transformers")
    return cls.from_pretrained(model_dir)


def image_markup(model_dir: Path | str, tokenizer) -> str:
    """What stands for one image in a rendered prompt: <|begin_of_image|><|image|><|end_of_image|> for GLM-4.1V
    and kin, from the config's token ids (the string vLLM's GLM-4V processor looks for, too)."""
    config = checkpoint.open(model_dir).config
    ids = (config.get("image_start_token_id"), config["image_token_id"], config.get("image_end_token_id"))
    return "".join(tokenizer.convert_ids_to_tokens(i) if i is not None else "" for i in ids)


def image_inputs(image_processor, ids: list[int], images, image_token_id: int) -> dict:
    """One prompt's model inputs with its images, as plain lists (a calibration dataset's row): each image token
    expanded to the tokens its image takes, the pixel values and grids the processor makes, mm_token_type_ids (1 at
    each image token)."""
    pixels = image_processor(images=list(images), return_tensors="pt")
    counts = iter(tokens_per_grid(pixels["image_grid_thw"], image_processor.merge_size))
    expanded = [t for token in ids for t in ([token] * next(counts) if token == image_token_id else [token])]
    return {"input_ids": expanded, "attention_mask": [1] * len(expanded),
            "mm_token_type_ids": [int(token == image_token_id) for token in expanded],
            "pixel_values": pixels["pixel_values"].tolist(), "image_grid_thw": pixels["image_grid_thw"].tolist()}
