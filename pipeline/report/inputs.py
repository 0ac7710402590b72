"""What `quantize report` reads, checked before anything is computed or written: the result lines
(results/<model>/<suite>.jsonl) and the JSON files other stages write (kl.json, judge.json,
bench.json, <suite>.json, quant.json, calib stats.json).

Each is checked for the keys and types the report uses; any problem is a UserError naming the
file, the line or key, and the command that writes the file again. Text that no UTF-8 file can hold
(an unpaired UTF-16 surrogate, "\\ud800" in JSON) is refused here, so the page can always be written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.errors import UserError

MAX_JSON_BYTES = 64 << 20  # a stage's summary is kilobytes; anything near this is not one

# ---------------------------------------------------------------- a small schema language
#
# A spec is a type name ("number", "count", "text", "flag", "any", "result id"), None (null allowed),
# a tuple of alternatives, a one-element list [spec] (a list of those), {"*": spec} (a mapping of
# those) or {"key": spec, "key?": spec} (an object with those keys; "?" marks an optional one).

CHECKS = {
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "non-negative number": lambda v: CHECKS["number"](v) and v >= 0,
    "count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "positive count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    "text": lambda v: isinstance(v, str),
    "flag": lambda v: isinstance(v, bool),
    "any": lambda v: True,
    "result id": lambda v: (isinstance(v, str) and v != "") or (isinstance(v, int) and not isinstance(v, bool)),
}
DESCRIBED = {"number": "a finite number", "non-negative number": "a number >= 0", "count": "a whole number >= 0", "positive count": "a whole number >= 1",
             "text": "text", "flag": "true or false", "result id": "a non-empty string or an integer", None: "null"}
KINDS = {"dict": "an object", "list": "an array", "str": "text", "int": "a number", "float": "a number",
         "bool": "true/false", "NoneType": "null"}


class Mismatch(Exception):
    """(key path, what was expected, what was found)."""


def _kind(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return KINDS.get(type(value).__name__, type(value).__name__)


def _describe(spec) -> str:
    if isinstance(spec, tuple):
        return " or ".join(_describe(s) for s in spec)
    if isinstance(spec, list):
        return "an array"
    if isinstance(spec, dict):
        return "an object"
    return DESCRIBED.get(spec, str(spec))


def check(value, spec, key: str = "") -> None:
    """Raises Mismatch(key, expected, found) at the first place value does not fit spec."""
    if isinstance(spec, tuple):
        deepest = None
        for alternative in spec:
            try:
                check(value, alternative, key)
                return
            except Mismatch as exc:
                if exc.args[0] != key and (deepest is None or len(exc.args[0]) > len(deepest.args[0])):
                    deepest = exc  # the right kind of container, wrong inside: say where
        raise deepest or Mismatch(key, _describe(spec), _kind(value))
    if spec is None:
        if value is not None:
            raise Mismatch(key, "null", _kind(value))
        return
    if isinstance(spec, list):
        if not isinstance(value, list):
            raise Mismatch(key, "an array", _kind(value))
        for i, element in enumerate(value):
            check(element, spec[0], f"{key}[{i}]")
        return
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise Mismatch(key, "an object", _kind(value))
        if "*" in spec:
            for name, element in value.items():
                check(element, spec["*"], f"{key}.{name}" if key else name)
            return
        for name, sub in spec.items():
            optional, name = name.endswith("?"), name.rstrip("?")
            where = f"{key}.{name}" if key else name
            if name not in value:
                if optional:
                    continue
                raise Mismatch(where, _describe(sub), "nothing (the key is missing)")
            check(value[name], sub, where)
        return
    if not CHECKS[spec](value):
        raise Mismatch(key, _describe(spec), _kind(value))


def unpaired_surrogate(value, key: str = "") -> str | None:
    """The key path of the first string (or key) holding an unpaired UTF-16 surrogate, else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return key or "(the value)"
        return None
    if isinstance(value, dict):
        for name, element in value.items():
            where = f"{key}.{name}" if key else str(name)
            found = unpaired_surrogate(name, where) or unpaired_surrogate(element, where)
            if found:
                return found
    elif isinstance(value, list):
        for i, element in enumerate(value):
            found = unpaired_surrogate(element, f"{key}[{i}]")
            if found:
                return found
    return None


# ---------------------------------------------------------------- what the report uses of each file

RESULT_LINE = {"id": "result id", "score": "number", "correct": "flag"}
# a perplexity suite's line: one document, its summed log-likelihood and its token count (no right/wrong)
DOCUMENT_LINE = {"id": "result id", "score": "number", "correct": ("flag", None), "loglikelihood": "number",
                 "n_tokens": "count"}
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
SERVING = ({"*": ({"serves?": "flag", "how?": ("text", None)}, None)}, None)  # engine -> can it serve, and how
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
                    "roofline?": ({"fraction_of_bound?": NUMBER_OR_NULL, "bound_tokens_per_s?": NUMBER_OR_NULL}, None)},
                   "quantize bench models/{model}"),
    "quant.json": ({"scheme": "text", "size_bytes": "count", "quantized_modules": "count",
                    "calibration": {"blocks": "count", "seq_len": "count", "sha256": "text"},
                    "seconds": {"total": "non-negative number"}, "device": "text", "peak_rss_bytes?": COUNT_OR_NULL,
                    "ignored?": {"*": "any"}, "serving?": SERVING,
                    "verify?": {"reloads?": "flag", "sample?": "any",
                                "vision?": {"vision_tensors": "count", "mismatched": ["any"]}}},
                   "quantize variant {model}"),
    "stats.json": ({"source": "text", "records_in": "count", "records_kept": "count", "dropped": {"*": "count"},
                    "shapes": {"*": "count"}, "calib_conversations": "count", "holdout": "count", "blocks": "count",
                    "seq_len": "count", "tokens": "count", "redaction": "flag", "redactions": {"*": "count"},
                    "non_latin_share": "number"}, "quantize calib"),
}
SUITE_SUMMARY = ({"status?": ("text", None), "reason?": ("text", None),
                  "long_context?": {"by_length_and_depth": {"*": {"*": {"score": "number", "n": "count"}}},
                                    "lengths_skipped?": [{"length": "count", "reason": "text"}]}},
                 "quantize eval models/{model} --suite {suite}")


def _fix(path: Path, command: str) -> str:
    return command.format(model=path.parent.name, suite=path.stem)


def _problem(path: Path, where: str, problem: str, command: str) -> UserError:
    return UserError(f"{path}{where}: {problem}; run `{_fix(path, command)}` again to rewrite it"
                     + (" (or delete the file)" if path.suffix == ".json" else ""))


def _read_bytes(path: Path, command: str, limit: int | None = None) -> bytes:
    if path.is_dir():
        raise UserError(f"{path}: is a directory where a file belongs; move it away and run "
                        f"`{_fix(path, command)}`")
    try:
        with open(path, "rb") as handle:
            data = handle.read() if limit is None else handle.read(limit + 1)
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from None
    if limit is not None and len(data) > limit:
        raise _problem(path, "", f"over {limit >> 20} MB, not a summary this pipeline writes", command)
    return data


def _decode(path: Path, data: bytes, command: str) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise _problem(path, ":1", "the file is UTF-16 encoded, not UTF-8", command)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise _problem(path, f":{line}", f"bytes that are not UTF-8 (0x{data[exc.start]:02x})", command) from None


def _parse(path: Path, text: str, where: str, command: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:  # where: the line of a .jsonl; else the line in the file
        raise _problem(path, where or f":{exc.lineno}", f"not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})",
                       command) from None
    except (ValueError, RecursionError) as exc:  # a 5,000-digit number, arrays nested 100,000 deep
        raise _problem(path, where, f"JSON that cannot be loaded ({str(exc).split(':')[0][:80]})", command) from None


def read_json(path: Path) -> dict | None:
    """A stage's JSON summary, checked for what the report uses (by file name); None when absent."""
    path = Path(path)
    if not path.exists():
        return None
    spec, command = SCHEMAS.get(path.name, SUITE_SUMMARY)
    data = _parse(path, _decode(path, _read_bytes(path, command, MAX_JSON_BYTES), command), "", command)
    try:
        check(data, spec)
    except Mismatch as exc:
        key, expected, found = exc.args
        raise _problem(path, "", f"{key or 'the top level'}: expected {expected}, found {found}", command) from None
    if (key := unpaired_surrogate(data)) is not None:
        raise _problem(path, "", f"{key}: holds an unpaired UTF-16 surrogate (a broken character) that no UTF-8 "
                                 "page can hold", command)
    _check_consistent(path, data, command)
    return data


def _check_consistent(path: Path, data: dict, command: str) -> None:
    """What a key-by-key check cannot see: a judged pairwise run must carry its win rate and interval."""
    if path.name == "judge.json" and data.get("mode", "pairwise") == "pairwise" and data.get("n"):
        for key in ("win_rate", "ci_low", "ci_high"):
            if not CHECKS["number"](data.get(key)):
                raise _problem(path, "", f"{key}: expected a finite number when n is {data['n']}, found "
                                         f"{_kind(data.get(key)) if key in data else 'nothing'}", command)
    if path.name == "bench.json" and not data["workloads"]["fixed"]["levels"]:
        raise _problem(path, "", "workloads.fixed.levels: expected at least one level, found none", command)


def read_lines(path: Path) -> dict[str, dict]:
    """{item id: result line} of one results/<model>/<suite>.jsonl, every line checked; a duplicate id,
    or a line that is not a result is a UserError naming the file and the line."""
    path = Path(path)
    command = SUITE_SUMMARY[1]
    text = _decode(path, _read_bytes(path, command), command)
    items: dict[str, dict] = {}
    first_line: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f":{number}"
        item = _parse(path, line, where, command)
        if not isinstance(item, dict):
            raise _problem(path, where, f"a result line must be a JSON object, not {_kind(item)}", command)
        try:
            check(item, DOCUMENT_LINE if "loglikelihood" in item else RESULT_LINE)
        except Mismatch as exc:
            key, expected, found = exc.args
            raise _problem(path, where, f"{key}: expected {expected}, found {found}", command) from None
        if "\\ud" in line.lower() and (key := unpaired_surrogate(item)) is not None:
            raise _problem(path, where, f"{key}: holds an unpaired UTF-16 surrogate (a broken character) that no "
                                        "UTF-8 page can hold", command)
        item_id = str(item["id"])
        if item_id in first_line:
            raise UserError(f"{path}:{number}: id {item_id[:80]!r} is already on line {first_line[item_id]}; "
                            "each item must appear once: delete the duplicate line, or run "
                            f"`{_fix(path, command)}` again into an empty results folder")
        first_line[item_id] = number
        items[item_id] = item
    return items  # empty for a suite that does not apply (its <suite>.json says why)
