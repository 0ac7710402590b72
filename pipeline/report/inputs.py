"""What `quantize report` reads, checked before anything is computed or written: the result lines
and <suite>.json summaries (pipeline/formats/results.py; a summary's n, score and tokens against its lines:
`suite_summaries_from_lines`), each variant's quant.json
(pipeline/formats/quant_json.py), and the summaries only the report reads (kl.json, judge.json,
bench.json, calib stats.json), whose schemas are here.

Each is checked for the keys and types the report uses (pipeline/formats/checked_json.py); any
problem is a UserError naming the file, the line or key, and the command that writes the file again.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.formats import quant_json, results
from pipeline.formats.checked_json import CHECKS, Mismatch, check, key_line, kind_of, problem, read_checked_json
from pipeline.formats.judge_lines import read_judge_lines
from pipeline.formats.kl_lines import KL_ROUNDING, lines_path, read_kl_lines

# ---------------------------------------------------------------- what the report uses of each file

COUNT_OR_NULL = ("count", None)
NUMBER_OR_NULL = ("number", None)
SHARE_OR_NULL = ("share", None)  # a rate, an agreement: in [0, 1]
DISTRIBUTION = ({"mean?": "non-negative number", "median": "non-negative number", "p90": "non-negative number",
                 "p99": "non-negative number"}, None)  # milliseconds (pipeline/stages/bench.py: distribution)
LEVEL_AT_RATE = {"output_tokens_per_s?": ("non-negative number", None), "ttft_ms?": DISTRIBUTION,
                 "tpot_ms_stats?": DISTRIBUTION, "requests_per_s?": ("non-negative number", None),
                 "goodput_requests_per_s?": ("non-negative number", None)}
LEVEL = {**LEVEL_AT_RATE, "concurrency": "positive count", "tpot_ms?": ("non-negative number", None),
         "ttft_p50_ms": "non-negative number", "output_tokens_per_s": ("non-negative number", None),
         "memory_bytes?": COUNT_OR_NULL, "itl_ms?": DISTRIBUTION, "e2el_ms?": DISTRIBUTION}
NON_NEGATIVE_OR_NULL = ("non-negative number", None)
# a load of a bench with images (pipeline/scoring/bench_load.py: image_workload): what the report shows of it
LOAD = {"name?": "text", "label?": "text", "images_per_request?": "count", "image_size?": (["positive count"], None),
        "image_tokens_per_image?": NON_NEGATIVE_OR_NULL, "prompt_tokens_mean?": NON_NEGATIVE_OR_NULL,
        "kv_tokens_per_request?": NON_NEGATIVE_OR_NULL, "kv_tokens_source?": ("text", None)}
IMAGE_WORKLOAD = {**LOAD, "name": "text", "label": "text", "images_per_request": "positive count", "levels": [LEVEL]}
SCHEMAS = {  # file name -> (spec, command that writes it again)
    "kl.json": ({"sequences?": "count", "tokens": "count", "kl_mean": "number", "kl_p99": "number", "kl_max": "number",
                 "top1_agreement": "share", "checkpoint?": ("text", None)}, "quantize kl models/{model}"),
    "judge.json": ({"mode?": "text", "n?": COUNT_OR_NULL, "judge?": ("text", None), "scoring?": "text",
                    "weak_judge?": ("flag", None),
                    "wins?": COUNT_OR_NULL, "ties?": COUNT_OR_NULL, "losses?": COUNT_OR_NULL,
                    "unjudged?": COUNT_OR_NULL, "win_rate?": SHARE_OR_NULL, "ci_low?": NUMBER_OR_NULL,
                    "ci_high?": NUMBER_OR_NULL, "consistency?": SHARE_OR_NULL, "confidence?": "share",
                    "control_win_rate?": SHARE_OR_NULL, "length_bias?": ("correlation", None),
                    "noise_floor?": SHARE_OR_NULL, "control_consistency?": SHARE_OR_NULL, "control_n?": COUNT_OR_NULL,
                    "checkpoint?": ("text", None)},
                   "quantize judge models/{model}"),
    "bench.json": ({"engine": "text", "device": "text", "date?": ("text", None), "input_len": "count",
                    "output_len": "count", "engine_info?": ({"tensor_parallel_size?": COUNT_OR_NULL}, None),
                    "workloads": {"fixed": {"levels": [LEVEL], "rates?": ([LEVEL_AT_RATE], None), **LOAD}},
                    "roofline?": ({"fraction_of_bound?": NUMBER_OR_NULL, "bound_tokens_per_s?": NUMBER_OR_NULL}, None),
                    "capacity?": ({"kv_cache_tokens?": COUNT_OR_NULL, "max_context_batch1?": COUNT_OR_NULL,
                                   "weight_bytes?": COUNT_OR_NULL, "kv_cache_bytes?": COUNT_OR_NULL,
                                   "goodput_tok_s_per_gpu?": ("non-negative number", None),
                                   "by_load?": ({"*": {"label": "text", "kv_tokens_per_request?": NON_NEGATIVE_OR_NULL,
                                                       "requests_in_kv_pool?": COUNT_OR_NULL,
                                                       "goodput_tok_s_per_gpu?": NON_NEGATIVE_OR_NULL}}, None)},
                                  None)},
                   "quantize bench models/{model}"),
    "stats.json": ({"source": "text", "records_in": "count", "records_kept": "count", "dropped": {"*": "count"},
                    "shapes": {"*": "count"}, "calib_conversations": "count", "holdout": "count", "blocks": "count",
                    "seq_len": "count", "tokens": "count", "redaction": "flag", "redactions": {"*": "count"},
                    "non_latin_share": "number", **{f"{key}?": ("count", None) for key in (
                        "images", "image_conversations", "images_dropped", "image_samples", "image_sample_images",
                        "image_sample_tokens")}}, "quantize calib"),
}


def result_folders(results_dir: Path, known: list[str]) -> tuple[list[str], dict[str, str]]:
    """The folders under results/ the report reads (those named after base, a params.yaml variant or the fix of a
    variant params.yaml fix.variants names: pipeline/settings/fixes.py), and
    {name: why} for every other folder there, which the report ignores and names (a copy, a typo, a
    variant dropped from params.yaml: never a variant of its own)."""
    if not results_dir.is_dir():
        return [], {}
    models, ignored = [], {}
    for folder in sorted(p for p in results_dir.iterdir() if p.is_dir()):
        if folder.name in known:
            models.append(folder.name)
        else:
            ignored[folder.name] = (f"{folder.name!r} is neither base nor a variant in params.yaml nor the fix of a "
                                    f"variant params.yaml fix.variants names (<variant>-mixed; models: "
                                    f"{', '.join(known[1:]) or 'none'}); add it under variants (a fix: `quantize "
                                    "profile --fix <variant>`), rename the folder to one, or move it out of the results "
                                    "folder")
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
    """What a key-by-key check cannot see: a judged pairwise run must carry its win rate and interval, the
    interval a win rate's (in [0, 1])."""
    if path.name == "judge.json" and data.get("mode", "pairwise") == "pairwise" and data.get("n"):
        for key in ("win_rate", "ci_low", "ci_high"):
            if not CHECKS["number"](data.get(key)):
                raise problem(path, "", f"{key}: expected a finite number when n is {data['n']}, found "
                                        f"{kind_of(data.get(key)) if key in data else 'nothing'}", command)
            if not CHECKS["share"](data[key]):
                raise problem(path, key_line(path, key), f"{key}: {data[key]:g} is not a win rate (in [0, 1])", command)
    if path.name == "bench.json" and not data["workloads"]["fixed"]["levels"]:
        raise problem(path, "", "workloads.fixed.levels: expected at least one level, found none", command)
    if path.name == "bench.json":  # the loads with images the report shows beside the text-only one
        for name, workload in data["workloads"].items():
            if not (isinstance(workload, dict) and "images_per_request" in workload):
                continue
            try:
                check(workload, IMAGE_WORKLOAD, f"workloads.{name}")
            except Mismatch as exc:
                key, expected, found = exc.args
                raise problem(path, "", f"{key}: expected {expected}, found {found}", command) from None
            if not workload["levels"]:
                raise problem(path, "", f"workloads.{name}.levels: expected at least one level, found none", command)


# ---------------------------------------------------------------- summaries recomputed from their lines

def read_judge(path: Path, params) -> dict | None:
    """A variant's judge.json with every figure recomputed from judge.jsonl beside it, the summary's own figures
    checked against them (`agree`); None when there is no judge.json."""
    return _recomputed(path, params, lambda lines_file, summary: read_judge_lines(lines_file, summary.get("mode", "pairwise")))


def read_kl(path: Path, params) -> dict | None:
    """A variant's kl.json, its figures checked against those recomputed from kl.jsonl beside it (float32 sums in
    the stage, float64 here: agreeing to 1e-4 relative); None when there is no kl.json."""
    return _recomputed(path, params, lambda lines_file, _: read_kl_lines(lines_file), rel_tol=1e-4, abs_tol=1e-7)


def _recomputed(path: Path, params, read_lines, **tolerance) -> dict | None:
    """The summary at `path` with the figures its lines give (pipeline/verdict/decision.py: summary_figures), after
    checking each figure the summary states against them; None when the summary is absent. kl.json keeps its own
    figures once they agree (to float32 rounding), so the page shows the digits `quantize kl` printed."""
    from pipeline.verdict.decision import summary_figures

    summary = read_json(path)
    if summary is None:
        return None
    command = SCHEMAS[path.name][1]
    for key in ("kl_mean", "kl_p99", "kl_max") if path.name == "kl.json" else ():
        if summary[key] < -KL_ROUNDING:
            raise problem(path, key_line(path, key), f"{key}: {summary[key]:g} is negative: a KL divergence is >= 0",
                          command)
    lines = read_lines(_lines_beside(path, command), summary)
    figures, unchecked = summary_figures(path.name, summary, lines, params)
    agree(path, summary, {k: v for k, v in figures.items() if k not in unchecked}, len(lines), command, **tolerance)
    keep_own = summary.keys() if path.name == "kl.json" else ()
    return {**summary, **{key: value for key, value in figures.items() if key not in keep_own}}


def _lines_beside(path: Path, command: str) -> Path:
    lines = lines_path(path)
    if not lines.is_file():
        raise problem(lines, "", f"missing beside {path.name}: the report recomputes {path.name}'s figures from "
                                 f"these lines; {path.name} without them (copied alone, or written by an older "
                                 "version) cannot be checked", command)
    return lines


def agree(path: Path, stored: dict, recomputed: dict, n_lines: int, command: str, *, rel_tol: float = 1e-9,
          abs_tol: float = 1e-12) -> None:
    """Each figure the summary at `path` states (those of `recomputed` it holds) must be what its lines give; the
    first that is not is a UserError naming the summary's file, line and key, both values and the fix."""
    for key, value in recomputed.items():
        if key not in stored or _same(stored[key], value, rel_tol, abs_tol):
            continue
        raise problem(path, key_line(path, key), f"{key}: {_shown(stored[key])} is not what the {n_lines} lines of "
                                                 f"{lines_path(path)} give ({_shown(value)}): the summary and its lines "
                                                 "disagree, so neither is shown", command)


def _same(a, b, rel_tol: float, abs_tol: float) -> bool:
    if CHECKS["number"](a) and CHECKS["number"](b) and not (isinstance(a, int) and isinstance(b, int)):  # counts: exact
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=abs_tol)
    return a == b


def _shown(value) -> str:
    return f"{value:.6g}" if CHECKS["number"](value) else "null" if value is None else json.dumps(value)[:80]


def tables_from_lines(results_dir: Path, lines: dict, summaries: dict, declared: dict) -> None:
    """Each suite's own table (a retrieval-table suite's score per length and needle depth, in <suite>.json's
    `table`) recomputed from its lines by the suite's hook (`declared`: {suite: Suite}, pipeline/settings/suites.py;
    `lines`: {model: {suite: {id: line}}}); a line the hook cannot place is a UserError naming the file and why."""
    for model, by_suite in summaries.items():
        for suite, summary in by_suite.items():
            table, items = summary.get("table"), lines.get(model, {}).get(suite)
            recompute = declared[suite].hook("table_from_lines") if suite in declared else None
            if not table or items is None or recompute is None:
                continue
            try:
                table.update(recompute(list(items.values())))
            except ValueError as exc:
                raise problem(results.lines_path(results_dir / model, suite), "", str(exc), results.COMMAND) from None


def lines_of_their_kind(results_dir: Path, lines: dict, perplexity) -> None:
    """A perplexity suite's lines (its YAML's kind: `perplexity(suite)`) are documents, each with its log-likelihood
    and token count; a line that is not (results of another task, or of the suite before its kind changed) is a
    UserError naming the file, the line and the command that writes them again. `lines`: {model: {suite: {id: line}}}."""
    for model, by_suite in lines.items():
        for suite, items in by_suite.items():
            if perplexity(suite) and (item := next((i for i in items.values() if "loglikelihood" not in i), None)):
                raise problem(results.lines_path(results_dir / model, suite), f"id {item.get('id')}",
                              f"{suite} is a perplexity suite (its task YAML's metadata.suite.kind) and this line is "
                              "no document: it has no loglikelihood", results.COMMAND)


def suite_summaries_from_lines(results_dir: Path, lines: dict, summaries: dict, perplexity) -> None:
    """Each <suite>.json's count, score and (a perplexity suite: `perplexity(suite)`) tokens checked against its
    <suite>.jsonl, as kl.json and judge.json are (`agree`): n the number of lines, score their mean score (a perplexity
    suite: exp of minus the summed log-likelihood per token), tokens their token count; a summary that disagrees is a
    UserError naming the file, the key and both values. `lines`: {model: {suite: {id: line}}}."""
    for model, by_suite in summaries.items():
        for suite, summary in by_suite.items():
            items = lines.get(model, {}).get(suite)
            if items is None or summary.get("status") in ("not run", "not applicable"):
                continue
            rows = list(items.values())
            recomputed: dict = {"n": len(rows)}
            if rows and perplexity(suite):
                tokens = sum(row["n_tokens"] for row in rows)
                recomputed.update(tokens=tokens, score=math.exp(-sum(row["loglikelihood"] for row in rows) / max(tokens, 1)))
            elif rows and all(CHECKS["number"](row.get("score")) for row in rows):
                recomputed["score"] = sum(row["score"] for row in rows) / len(rows)
            agree(results.lines_path(results_dir / model, suite).with_suffix(".json"), summary, recomputed, len(rows),
                  results.COMMAND, rel_tol=1e-9, abs_tol=1e-12)
