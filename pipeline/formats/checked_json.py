"""Reading the JSON and JSON Lines files stages hand each other, checked against a small schema.

A spec is a type name ("number", "count", "text", "flag", "any", "result id"), None (null allowed),
a tuple of alternatives, a one-element list [spec] (a list of those), {"*": spec} (a mapping of
those) or {"key": spec, "key?": spec} (an object with those keys; "?" marks an optional one).
Every problem is a UserError naming the file, the line or key, and the command that writes the file
again. Text that no UTF-8 file can hold (an unpaired UTF-16 surrogate, "\\ud800" in JSON) is refused,
so a page built from it can always be written. The readers of each format (pipeline/formats/results.py,
quant_json.py; pipeline/report/inputs.py for the other stages' summaries) use these.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Callable

from pipeline.errors import UserError, cut

MAX_JSON_BYTES = 64 << 20  # a stage's summary is kilobytes; anything near this is not one

CHECKS = {
    # a float that is not inf or nan, or an int a float can hold (10**400 is valid JSON and would overflow)
    "number": lambda v: ((isinstance(v, float) and math.isfinite(v))
                         or (isinstance(v, int) and not isinstance(v, bool) and abs(v) <= sys.float_info.max)),
    "non-negative number": lambda v: CHECKS["number"](v) and v >= 0,
    "share": lambda v: CHECKS["number"](v) and 0 <= v <= 1,  # a score, a rate, an agreement
    "correlation": lambda v: CHECKS["number"](v) and -1 <= v <= 1,
    "count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
    "positive count": lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
    "text": lambda v: isinstance(v, str),
    "flag": lambda v: isinstance(v, bool),
    "any": lambda v: True,
    "result id": lambda v: (isinstance(v, str) and v != "") or (isinstance(v, int) and not isinstance(v, bool)),
}
DESCRIBED = {"number": "a finite number", "non-negative number": "a number >= 0", "share": "a number in [0, 1]",
             "correlation": "a number in [-1, 1]", "count": "a whole number >= 0", "positive count": "a whole number >= 1",
             "text": "text", "flag": "true or false", "result id": "a non-empty string or an integer", None: "null"}
NUMERIC = ("number", "non-negative number", "share", "correlation", "count", "positive count")
KINDS = {"dict": "an object", "list": "an array", "str": "text", "int": "a number", "float": "a number",
         "bool": "true/false", "NoneType": "null"}


class Mismatch(Exception):
    """(key path, what was expected, what was found)."""


def kind_of(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return KINDS.get(type(value).__name__, type(value).__name__)


def _found(value, spec) -> str:
    """What a value that does not fit spec is: a number of the right kind but out of its range is shown as itself
    ("found 7", "found -0.5"), anything else by its kind ("found text")."""
    numeric = spec in NUMERIC or (isinstance(spec, tuple) and any(s in NUMERIC for s in spec))
    return f"{value:g}" if numeric and CHECKS["number"](value) else kind_of(value)


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
        raise deepest or Mismatch(key, _describe(spec), _found(value, spec))
    if spec is None:
        if value is not None:
            raise Mismatch(key, "null", kind_of(value))
        return
    if isinstance(spec, list):
        if not isinstance(value, list):
            raise Mismatch(key, "an array", kind_of(value))
        for i, element in enumerate(value):
            check(element, spec[0], f"{key}[{i}]")
        return
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            raise Mismatch(key, "an object", kind_of(value))
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
        raise Mismatch(key, _describe(spec), _found(value, spec))


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


def fix_command(path: Path, command: str) -> str:
    """command with {model} (the file's folder) and {suite} (its stem) filled in."""
    return command.format(model=path.parent.name, suite=path.stem)


def problem(path: Path, where: str, what: str, command: str) -> UserError:
    """what is wrong at path (where: ":LINE" or ""), and the command that writes the file again."""
    return UserError(f"{path}{where}: {what}; run `{fix_command(path, command)}` again to rewrite it"
                     + (" (or delete the file)" if path.suffix == ".json" else ""))


def read_bytes(path: Path, command: str, limit: int | None = None) -> bytes:
    if path.is_dir():
        raise UserError(f"{path}: is a directory where a file belongs; move it away and run "
                        f"`{fix_command(path, command)}`")
    try:
        with open(path, "rb") as handle:
            data = handle.read() if limit is None else handle.read(limit + 1)
    except OSError as exc:
        raise UserError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from None
    if limit is not None and len(data) > limit:
        raise problem(path, "", f"over {limit >> 20} MB, not a summary this pipeline writes", command)
    return data


def decode(path: Path, data: bytes, command: str) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise problem(path, ":1", "the file is UTF-16 encoded, not UTF-8", command)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise problem(path, f":{line}", f"bytes that are not UTF-8 (0x{data[exc.start]:02x})", command) from None


def parse(path: Path, text: str, where: str, command: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:  # where: the line of a .jsonl; else the line in the file
        raise problem(path, where or f":{exc.lineno}", f"not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})",
                       command) from None
    except (ValueError, RecursionError) as exc:  # a 5,000-digit number, arrays nested 100,000 deep
        raise problem(path, where, f"JSON that cannot be loaded ({cut(str(exc).split(':')[0], 80)})", command) from None


def read_checked_json(path: Path, spec, command: str) -> dict | None:
    """A JSON file checked against spec (command: what writes it again, {model} and {suite} filled in
    from the path); None when absent."""
    path = Path(path)
    if not path.exists():
        return None
    data = parse(path, decode(path, read_bytes(path, command, MAX_JSON_BYTES), command), "", command)
    try:
        check(data, spec)
    except Mismatch as exc:
        key, expected, found = exc.args
        raise problem(path, "", f"{key or 'the top level'}: expected {expected}, found {found}", command) from None
    if (key := unpaired_surrogate(data)) is not None:
        raise problem(path, "", f"{key}: holds an unpaired UTF-16 surrogate (a broken character) that no UTF-8 "
                                 "page can hold", command)
    return data


def read_checked_lines(path: Path, spec_of: Callable[[dict], object], command: str, what: str = "line"):
    """(":LINE", object) for each non-blank line of a JSON Lines file, each an object checked against
    spec_of(object); the first line that is not is a UserError naming the file, the line and the key."""
    path = Path(path)
    text = decode(path, read_bytes(path, command), command)
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f":{number}"
        item = parse(path, line, where, command)
        if not isinstance(item, dict):
            raise problem(path, where, f"a {what} must be a JSON object, not {kind_of(item)}", command)
        try:
            check(item, spec_of(item))
        except Mismatch as exc:
            key, expected, found = exc.args
            raise problem(path, where, f"{key}: expected {expected}, found {found}", command) from None
        if "\\ud" in line.lower() and (key := unpaired_surrogate(item)) is not None:
            raise problem(path, where, f"{key}: holds an unpaired UTF-16 surrogate (a broken character) that no "
                                       "UTF-8 page can hold", command)
        yield where, item


def key_line(path: Path, key: str) -> str:
    """":LINE" of the first line of a JSON file that holds `"key":` (a summary written with one key a line),
    "" when none does: where a reader points at a value it refuses."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    needle = json.dumps(key) + ":"
    for number, line in enumerate(text.splitlines(), start=1):
        if needle in line:
            return f":{number}"
    return ""
