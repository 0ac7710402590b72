"""holdout.jsonl: the held-out conversations `quantize calib` sets aside (never calibrated on).

One record per line: {"id", "messages": [... ending with the user's turn], "prompt": that last user
turn, "reference": the real assistant reply that followed, or null when the log ended on the user}.
Read by the judge (the prompts both models answer), `quantize kl` (whole conversations, reference
included), `quantize bench` (real prompt and reply lengths) and the quantize stages' per-layer check.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats.checked_json import unpaired_surrogate

ROLES = ("system", "user", "assistant")
SHAPE = '{"id", "messages": [... ending with the user turn], "prompt", "reference"}'


def holdout_record(record_id: str, messages: list[dict], reference: str | None) -> dict:
    return {"id": record_id, "messages": messages, "prompt": messages[-1]["content"], "reference": reference}


def write_holdout(path: Path, records: list[dict]) -> None:
    Path(path).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def read_holdout(path: Path, *, limit: int | None = None, purpose: str = "held-out conversations",
                 missing_ok: bool = False) -> list[dict]:
    """The records, checked (FILE:LINE and the expected shape on a bad one); `limit` keeps the first ones.
    missing_ok: a missing file, or one without records (calib.holdout: 0), is an empty list (the quantize
    stages fall back to calibration blocks)."""
    path = Path(path)
    if not path.exists():
        if missing_ok:
            return []
        raise UserError(f"{path}: no {purpose}; run `quantize calib` first (it writes holdout.jsonl)")
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (UnicodeDecodeError, OSError) as exc:
        raise UserError(f"{path}: unreadable ({exc}); rebuild it with `quantize calib`") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            messages = record["messages"]
            if not isinstance(messages, list) or not messages or messages[-1]["role"] != "user" or \
                    not all(isinstance(m.get("content"), str) and m.get("role") in ROLES for m in messages):
                raise ValueError("messages must be a list of system, user and assistant turns ending with the "
                                 "user's")
            if record.get("reference") is not None and not isinstance(record["reference"], str):
                raise ValueError("reference must be text or null")
            if (where := unpaired_surrogate(record)) is not None:
                raise ValueError(f"{where} holds an unpaired UTF-16 surrogate, which is not text")
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
            raise UserError(f"{path}:{number}: not a holdout record ({exc}); expected {SHAPE}; rebuild it with "
                            "`quantize calib`") from None
        records.append(record)
        if limit and len(records) >= limit:
            break
    if not records and not missing_ok:
        raise UserError(f"{path}: no {purpose} in the file; rebuild it with `quantize calib` from conversations "
                        "with user turns, and calib.holdout above 0")
    return records


def with_reference(record: dict) -> list[dict]:
    """The whole conversation: the held-out turns and, when there is one, the real reply."""
    reference = [{"role": "assistant", "content": record["reference"]}] if record.get("reference") else []
    return list(record["messages"]) + reference
