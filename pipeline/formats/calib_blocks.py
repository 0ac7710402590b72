"""calib.jsonl: the fixed-length token blocks `quantize calib` writes and the quantize stages calibrate on.

One record per line: {"block": its index, "input_ids": [token ids, all blocks the same length]}.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats.conversations import BadRecord, iter_records


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
