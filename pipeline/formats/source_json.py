"""source.json: where the base checkpoint came from (the source `quantize resave` converted, its kind and dtype) and
what the source states of its origin (licence, Hub repository: pipeline/checkpoints/origin.py), written into
models/base by resave and read by the report for the variants' model cards."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.formats.checked_json import read_checked_json

NAME = "source.json"
TEXT_OR_NULL = ("text", None)
ORIGIN = {"license?": TEXT_OR_NULL, "license_name?": TEXT_OR_NULL, "license_link?": TEXT_OR_NULL, "hub_id?": TEXT_OR_NULL,
          "name?": TEXT_OR_NULL, "read_from?": TEXT_OR_NULL}
# a GGUF source's quantization type and checksum (pipeline/checkpoints/origin.py: gguf_file), for the model cards
SPEC = {"source": "text", "kind": "text", "dtype": "text", "origin?": (ORIGIN, None), "file_type?": TEXT_OR_NULL,
        "sha256?": TEXT_OR_NULL}
COMMAND = "quantize resave"  # what writes it again


def write_source_json(folder: Path, source: Path, kind: str, dtype: str, origin: dict | None,
                      file: dict | None = None) -> Path:
    """<folder>/source.json (the base being written: resave's temporary folder); `file`: a GGUF source's file_type
    and sha256."""
    path = Path(folder) / NAME
    path.write_text(json.dumps({"source": str(source), "kind": kind, "dtype": dtype, "origin": origin, **(file or {})},
                               indent=2) + "\n")
    return path


def read_source_json(model_dir: Path | str) -> dict | None:
    """The base's source.json, checked; None when the folder has none (a base resaved before it was written)."""
    return read_checked_json(Path(model_dir) / NAME, SPEC, COMMAND)
