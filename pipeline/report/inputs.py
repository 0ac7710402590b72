"""What `quantize report` reads, checked before anything is computed or written: the result lines
and <suite>.json summaries (pipeline/formats/results.py), each variant's quant.json
(pipeline/formats/quant_json.py), and the summaries only the report reads (kl.json, judge.json,
bench.json, calib stats.json), whose schemas are here.

Each is checked for the keys and types the report uses (pipeline/formats/checked_json.py); any
problem is a UserError naming the file, the line or key, and the command that writes the file again.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.formats import quant_json, results
from pipeline.formats.checked_json import CHECKS, kind_of, problem, read_checked_json

# ---------------------------------------------------------------- what the report uses of each file

COUNT_OR_NULL = ("count", None)
NUMBER_OR_NULL = ("number", None)
DISTRIBUTION = ({"mean?": "non-negative number", "median": "non-negative number", "p90": "non-negative number",
                 "p99": "non-negative number"}, None)  # milliseconds (pipeline/bench.py: distribution)
LEVEL_AT_RATE = {"output_tokens_per_s?": ("non-negative number", None), "ttft_ms?": DISTRIBUTION,
                 "tpot_ms_stats?": DISTRIBUTION, "requests_per_s?": ("non-negative number", None),
                 "goodput_requests_per_s?": ("non-negative number", None)}
LEVEL = {**LEVEL_AT_RATE, "concurrency": "positive count", "tpot_ms?": ("non-negative number", None),
         "ttft_p50_ms": "non-negative number", "output_tokens_per_s": ("non-negative number", None),
         "memory_bytes?": COUNT_OR_NULL, "itl_ms?": DISTRIBUTION, "e2el_ms?": DISTRIBUTION}
SCHEMAS = {  # file name -> (spec, command that writes it again)
    "kl.json": ({"tokens": "count", "kl_mean": "number", "kl_p99": "number", "kl_max": "number",
                 "top1_agreement": "number"}, "quantize kl models/{model}"),
    "judge.json": ({"mode?": "text", "n?": COUNT_OR_NULL, "judge?": ("text", None), "weak_judge?": ("flag", None),
                    "wins?": COUNT_OR_NULL, "ties?": COUNT_OR_NULL, "losses?": COUNT_OR_NULL,
                    "unjudged?": COUNT_OR_NULL, "win_rate?": NUMBER_OR_NULL, "ci_low?": NUMBER_OR_NULL,
                    "ci_high?": NUMBER_OR_NULL, "consistency?": NUMBER_OR_NULL,
                    "control_win_rate?": NUMBER_OR_NULL, "length_bias?": NUMBER_OR_NULL,
                    "noise_floor?": NUMBER_OR_NULL}, "quantize judge models/{model}"),
    "bench.json": ({"engine": "text", "device": "text", "date?": ("text", None), "input_len": "count",
                    "output_len": "count", "engine_info?": ({"tensor_parallel_size?": COUNT_OR_NULL}, None),
                    "workloads": {"fixed": {"levels": [LEVEL], "rates?": ([LEVEL_AT_RATE], None)}},
                    "roofline?": ({"fraction_of_bound?": NUMBER_OR_NULL, "bound_tokens_per_s?": NUMBER_OR_NULL}, None),
                    "capacity?": ({"kv_cache_tokens?": COUNT_OR_NULL, "max_context_batch1?": COUNT_OR_NULL,
                                   "weight_bytes?": COUNT_OR_NULL, "kv_cache_bytes?": COUNT_OR_NULL,
                                   "goodput_tok_s_per_gpu?": ("non-negative number", None)},
                                  None)},
                   "quantize bench models/{model}"),
    "stats.json": ({"source": "text", "records_in": "count", "records_kept": "count", "dropped": {"*": "count"},
                    "shapes": {"*": "count"}, "calib_conversations": "count", "holdout": "count", "blocks": "count",
                    "seq_len": "count", "tokens": "count", "redaction": "flag", "redactions": {"*": "count"},
                    "non_latin_share": "number"}, "quantize calib"),
}


def result_folders(results_dir: Path, known: list[str]) -> tuple[list[str], dict[str, str]]:
    """The folders under results/ the report reads (those named after base or a params.yaml variant), and
    {name: why} for every other folder there, which the report ignores and names (a copy, a typo, a
    variant dropped from params.yaml: never a variant of its own)."""
    if not results_dir.is_dir():
        return [], {}
    models, ignored = [], {}
    for folder in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        if folder.name in known:
            models.append(folder.name)
        else:
            ignored[folder.name] = (f"{folder.name!r} is neither base nor a variant in params.yaml (variants: "
                                    f"{', '.join(known[1:]) or 'none'}); add it under variants, rename the folder to "
                                    "one, or move it out of the results folder")
    return models, ignored


def read_json(path: Path) -> dict | None:
    """A stage's JSON summary, checked for what the report uses (by file name); None when absent."""
    path = Path(path)
    if path.name == quant_json.NAME:
        return quant_json.read_quant_json(path)
    if path.name not in SCHEMAS:
        return results.read_summary(path)
    spec, command = SCHEMAS[path.name]
    data = read_checked_json(path, spec, command)
    if data is not None:
        _check_consistent(path, data, command)
    return data


def _check_consistent(path: Path, data: dict, command: str) -> None:
    """What a key-by-key check cannot see: a judged pairwise run must carry its win rate and interval."""
    if path.name == "judge.json" and data.get("mode", "pairwise") == "pairwise" and data.get("n"):
        for key in ("win_rate", "ci_low", "ci_high"):
            if not CHECKS["number"](data.get(key)):
                raise problem(path, "", f"{key}: expected a finite number when n is {data['n']}, found "
                                        f"{kind_of(data.get(key)) if key in data else 'nothing'}", command)
    if path.name == "bench.json" and not data["workloads"]["fixed"]["levels"]:
        raise problem(path, "", "workloads.fixed.levels: expected at least one level, found none", command)
