"""quant.json: a variant's record (scheme, sizes, calibration, timings, verification, which engines
can serve it), written into the variant's folder by the quantize stages (pipeline/stages/quantize.py)
and read by `quantize report`. The reader checks what the report uses of it."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.formats.checked_json import read_checked_json
from pipeline.outputs import write_atomic

NAME = "quant.json"
SERVING = ({"*": ({"serves?": "flag", "how?": ("text", None)}, None)}, None)  # engine -> can it serve, and how
SPEC = {"scheme": "text", "size_bytes": "count", "quantized_modules": "count",
        "calibration": {"blocks": "count", "seq_len": "count", "sha256": "text"},
        "seconds": {"total": "non-negative number"}, "device": "text", "peak_rss_bytes?": ("count", None),
        "ignored?": {"*": "any"}, "serving?": SERVING, "checkpoint?": ("text", None),
        "verify?": {"reloads?": "flag", "sample?": "any",
                    "vision?": {"vision_tensors": "count", "mismatched": ["any"], "dtypes?": ["text"]}}}
COMMAND = "quantize variant {model}"  # what writes it again


def write_quant_json(model_dir: Path | str, info: dict) -> Path:
    """<model_dir>/quant.json (a variant being built: its temporary folder)."""
    path = Path(model_dir) / NAME
    write_atomic(path, json.dumps(info, indent=2) + "\n")
    return path


def read_quant_json(path: Path | str) -> dict | None:
    """A variant's quant.json (the file, or the variant's folder), checked; None when absent."""
    path = Path(path)
    if path.name != NAME:
        path = path / NAME
    return read_checked_json(path, SPEC, COMMAND)
