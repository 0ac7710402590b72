"""calib.jsonl: the fixed-length token blocks `quantize calib` writes and the quantize stages calibrate on; and
calib_images.jsonl beside it (a vision-language model's): the conversations with images, one sample each.

calib.jsonl, one record per line: {"block": its index, "input_ids": [token ids, all blocks the same length]}.
calib_images.jsonl, one record per line: {"sample": its index, "input_ids": [the rendered conversation's token ids,
one image token per image], "images": ["images/<sha256>.png", ...: the folder's PNGs, in the order of the image
tokens], "image_tokens": [what each image expands to, as the model's processor computes it]}.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats.conversation_shapes import BadRecord
from pipeline.formats.conversations import iter_records


def blocks_text(blocks: list[list[int]]) -> str:
    """The file's text for `blocks` (written by the calib stage inside its atomic output dir)."""
    return "".join(json.dumps({"block": i, "input_ids": ids}, sort_keys=True) + "\n" for i, ids in enumerate(blocks))


def read_blocks(path: Path) -> list[list[int]]:
    """The token blocks, checked: each a non-empty list of token ids (FILE:LINE on a bad one)."""
    blocks = []
    for where, record in iter_records(path):
        if isinstance(record, BadRecord) or not isinstance(record, dict) or "input_ids" not in record:
            raise UserError(f"{where}: not a calibration block; build blocks with `quantize calib`")
        ids = record["input_ids"]
        if not isinstance(ids, list) or not ids or not all(type(i) is int and 0 <= i < 1 << 31 for i in ids):
            raise UserError(f"{where}: input_ids must be a non-empty list of token ids (whole numbers >= 0); "
                            "build blocks with `quantize calib`")
        blocks.append(ids)
    return blocks


def is_blocks_file(path: Path) -> bool:
    """Whether `path` holds token blocks (else it is a raw conversation file to be prepared first)."""
    for _, record in iter_records(path):
        return isinstance(record, dict) and "input_ids" in record
    return False


IMAGE_SAMPLES = "calib_images.jsonl"


def image_samples_text(samples: list[dict]) -> str:
    """calib_images.jsonl's text for `samples` ({"input_ids", "images", "image_tokens"} each); no samples (a text
    build): one blank line, not an empty file, which `dvc repro` would warn about as if something had failed."""
    return "".join(json.dumps({"sample": i, **sample}, sort_keys=True) + "\n" for i, sample in enumerate(samples)) or "\n"


def read_image_samples(path: Path) -> list[dict]:
    """The image samples, checked: token ids, and as many images (each a PNG of the file's folder) as image tokens
    counted (FILE:LINE on a bad one); [] when the file is not there (a text-only build)."""
    if not path.exists():
        return []
    samples = []
    for where, record in iter_records(path):
        ids = record.get("input_ids") if isinstance(record, dict) else None
        images = record.get("images") if isinstance(record, dict) else None
        if not isinstance(ids, list) or not ids or not all(type(i) is int and 0 <= i < 1 << 31 for i in ids) or \
                not isinstance(images, list) or not images or not all(isinstance(i, str) for i in images):
            raise UserError(f"{where}: not an image calibration sample (input_ids and images); build it with "
                            "`quantize calib`")
        missing = [name for name in images if Path(name).is_absolute() or ".." in Path(name).parts
                   or not (path.parent / name).is_file()]
        if missing:
            raise UserError(f"{where}: image {missing[0]} is not in {path.parent}; build the folder again with "
                            "`quantize calib`")
        samples.append({"input_ids": ids, "images": [path.parent / name for name in images],
                        "image_tokens": record.get("image_tokens")})
    return samples
