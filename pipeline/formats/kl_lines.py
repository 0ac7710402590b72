"""kl.jsonl: what `quantize kl` measured on each held-out sequence, written beside its kl.json summary
(pipeline/stages/kl.py) and read by `quantize report`, which recomputes the summary's figures from it.

One line a sequence: `sequence` (its index), `tokens` (positions scored), `top1_agree` (of those, how many
have the same top-1 token under both models) and `kl`: KL(base || variant) in nats at each position, 9
significant digits (a float32 exactly). A KL divergence is >= 0; summed in float32 over a vocabulary it can
come out a rounding error below 0, so only a value below -KL_ROUNDING is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.formats.checked_json import problem, read_checked_lines
from pipeline.outputs import write_atomic

LINE = {"sequence": "count", "tokens": "positive count", "top1_agree": "count", "kl": ["number"]}
KL_ROUNDING = 1e-4  # nats; float32 rounding of a per-token KL stays near 1e-6 (tests/test_kl.py measures it)
COMMAND = "quantize kl models/{model}"  # what writes it again


def lines_path(summary_path: Path | str) -> Path:
    """kl.jsonl beside kl.json (or <name>.jsonl beside any <name>.json the stage was told to write)."""
    return Path(summary_path).with_suffix(".jsonl")


def write_kl_lines(path: Path | str, sequences: list[tuple[list[float], int]]) -> Path:
    """One line per sequence from (per-token KL values, positions whose top-1 tokens agree), atomically."""
    write_atomic(path, kl_lines_text(sequences))
    return Path(path)


def kl_lines_text(sequences: list[tuple[list[float], int]]) -> str:
    """What write_kl_lines writes (the kl stage writes it together with its summary: outputs.write_together)."""
    return "".join(json.dumps({"sequence": i, "tokens": len(kl), "top1_agree": agree,
                               "kl": [float(f"{value:.9g}") for value in kl]}) + "\n"
                   for i, (kl, agree) in enumerate(sequences))


def read_kl_lines(path: Path | str) -> list[dict]:
    """Every line of a kl.jsonl, checked: the keys and types, one KL value a token, no more agreeing tokens than
    tokens, no KL below -KL_ROUNDING; the first that is not is a UserError naming the file, line and field."""
    path = Path(path)
    lines = []
    for where, line in read_checked_lines(path, lambda _: LINE, COMMAND, "kl line"):
        tokens = line["tokens"]
        if len(line["kl"]) != tokens:
            raise problem(path, where, f"kl: {len(line['kl'])} values for {tokens} tokens: one value a token", COMMAND)
        if line["top1_agree"] > tokens:
            raise problem(path, where, f"top1_agree: {line['top1_agree']} of {tokens} tokens: an agreement above 1",
                          COMMAND)
        low = min(line["kl"])
        if low < -KL_ROUNDING:
            raise problem(path, where, f"kl[{line['kl'].index(low)}]: {low:g} is negative: a KL divergence is >= 0 "
                                       f"(rounding leaves at most {KL_ROUNDING:g} below)", COMMAND)
        lines.append(line)
    if not lines:
        raise problem(path, "", "no sequence: `quantize kl` writes one line per held-out sequence it scored", COMMAND)
    return lines
