"""sensitivity.json: which of a variant's quantized groups cost it most, written into results/<variant>/ by
`quantize kl --rank` (pipeline/stages/kl.py: the rank stage's pass, the KL and the ranking at once) or by
`quantize sensitivity` (pipeline/stages/sensitivity.py: the ranking alone, either measure), and read by the `mixed`
method (pipeline/methods/mixed.py), which keeps the first groups in 8 bits.

`kl_mean` is the variant's mean per-token KL(base || variant) on the held-out conversations; each entry of `groups`
(one fused layer as vLLM runs it: pipeline/checkpoints/fused.py) holds its Linears (`modules`), their weight count
(`weights`), the mean KL with only that group's weights restored to the base's (`kl_restored`) and what that
removes (`kl_removed` = kl_mean - kl_restored; `share_removed` = kl_removed / kl_mean), most removed first.
`seconds` is what the ranking cost: the whole run of `quantize sensitivity` (its loads, `load_seconds`, and its
passes, `measure_seconds`), or in `quantize kl --rank` (`measured_in`) the backward passes and products it added to
the KL's pass (`pass_seconds`, the loads shared); `share_of_quantize_time` sets it beside quant.json's total.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.errors import UserError
from pipeline.formats.checked_json import problem, read_checked_json
from pipeline.outputs import json_text, write_atomic

GROUP = {"name": "text", "layer": ("count", None), "kind": "text", "modules": ["text"], "weights": "positive count",
         "kl_restored": "number", "kl_removed": "number", "share_removed": "number"}
SPEC = {"base": "text", "variant": "text", "holdout": "text", "sequences": "positive count", "tokens": "positive count",
        "kl_mean": "non-negative number", "measure?": ("text", None), "groups": [GROUP], "device": "text", "dtype": "text",
        "seconds": "non-negative number", "load_seconds?": ("non-negative number", None),
        "measure_seconds?": ("non-negative number", None),
        "measured_in?": ("text", None), "pass_seconds?": ("non-negative number", None), "quantize_seconds?": ("non-negative number", None),
        "share_of_quantize_time?": ("non-negative number", None)}
COMMAND = "quantize sensitivity models/{model}"  # what writes it again
NAME = "sensitivity.json"


def write_sensitivity(path: Path | str, summary: dict) -> Path:
    """The summary, its groups sorted most KL removed first, atomically."""
    write_atomic(path, sensitivity_text(summary))
    return Path(path)


def sensitivity_text(summary: dict) -> str:
    """What write_sensitivity writes (`quantize kl --rank` writes it together with kl.json: outputs.write_together)."""
    return json_text({**summary, "groups": sorted(summary["groups"], key=lambda g: -g["kl_removed"])})


def read_sensitivity(path: Path | str) -> dict:
    """A sensitivity.json, checked: its keys and types, at least one group, each group and each Linear named once,
    groups most KL removed first; a missing file is a UserError saying which command writes it."""
    path = Path(path)
    found = read_checked_json(path, SPEC, COMMAND)
    if found is None:
        raise UserError(f"{path}: no sensitivity ranking; run `quantize sensitivity models/<W4A16 variant>` first "
                        "(it writes results/<variant>/sensitivity.json), or name the ranking to read (the variant's "
                        "`sensitivity`, `--sensitivity`)")
    groups = found["groups"]
    if not groups:
        raise problem(path, "", "groups: empty; every quantized group of the variant is measured", COMMAND)
    seen: set[str] = set()
    for i, group in enumerate(groups):
        if group["name"] in seen or seen & set(group["modules"]) or not group["modules"]:
            raise problem(path, "", f"groups[{i}] ({group['name']}): a group or Linear named twice, or no Linear",
                          COMMAND)
        seen |= {group["name"], *group["modules"]}
        if i and group["kl_removed"] > groups[i - 1]["kl_removed"]:
            raise problem(path, "", f"groups[{i}] ({group['name']}): removes more KL than the group before it; the "
                                    "groups are ranked, most KL removed first", COMMAND)
    return found
