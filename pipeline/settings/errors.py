"""How a params problem is told: each at its key and line in params.yaml (format_error), or as the
CLI flag that set it (with_overrides, which validates a section again with a stage's flags applied).

pipeline/settings/params.py holds the schema (a variant's section: its method's module, pipeline/methods/); this module
knows pydantic's error shapes and says them in the file's terms: FILE:LINE: dotted.key: what is wrong and what to write.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ValidationError

from pipeline import methods
from pipeline.errors import UserError, cut
from pipeline.section import BoolGiven


JSON_KINDS = {"dict": "a mapping", "list": "a list", "str": "text", "int": "a number", "float": "a number",
              "bool": "true/false", "NoneType": "empty (null)"}
MAX_ERRORS_SHOWN = 10


def kind_of(value) -> str:
    return JSON_KINDS.get(type(value).__name__, type(value).__name__)


def clean_loc(loc: tuple) -> tuple[str, ...]:
    """The key path, without pydantic's union-member tags ("awq", "int", "literal['auto']", "function-...")."""
    tags = ("function-", "literal[", "list[", "dict[", "json-or-python[")
    parts = [str(part) for part in loc]
    kept = []
    for i, part in enumerate(parts):
        if part.startswith(tags) or part in ("int", "float", "str", "bool", "none", "is-instance[Path]", "lax-or-strict"):
            continue
        if i == 2 and parts[0] == "variants" and methods.is_method(part):  # the discriminated union's member
            continue
        kept.append(part)
    return tuple(kept)


def message_for(err: dict) -> str:
    kind, given = err["type"], err.get("input")
    message = err["msg"].removeprefix("Value error, ")
    if isinstance(given, BoolGiven):
        return "true/false is not allowed here; give a number or a name (see params.yaml)"
    if kind in ("greater_than_equal", "less_than_equal") and tuple(err["loc"][:3]) == ("verdict", "margins", "suites"):
        return (f"{given} is not between 0 and 1; a margin is the largest acceptable loss in the suite's unit, "
                "e.g. 0.03 for 3 points of accuracy or +3 % perplexity")
    if kind == "extra_forbidden":
        return "unknown key; remove it or check its spelling"
    if kind == "engine_key":  # a key the chosen engine's section lacks, with who takes it (pipeline/engines)
        return message
    if kind == "literal_error":
        return f"{cut(repr(given), 80)} is not allowed; {message.lower()}"
    if kind == "union_tag_invalid":
        return f"method {given.get('method')!r} is not one of {methods.names(quote=True)}" if isinstance(given, dict) \
            else message
    if kind == "union_tag_not_found":
        return f"needs a method: {methods.names()} (e.g. method: {methods.METHODS[0].NAME})"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        if given is None:
            return "is empty (null); give it settings, or delete the line to take the defaults"
        return f"must be a mapping of settings (key: value), not {kind_of(given)}"
    if kind == "missing":
        return "required key missing; add it"
    if isinstance(given, (int, float)) and not isinstance(given, bool) and not message.startswith(str(given)):
        # bounds: say what was given
        shown = repr(given) if len(repr(given)) <= 40 else f"a {len(str(abs(int(given))))}-digit number"
        return f"{message} (got {shown})"
    return message


def key_as_written(err: dict, lines: dict[tuple, int] | None) -> tuple[tuple[str, ...], str] | None:
    """A mapping key YAML read as true/false, a number or null (`true:`, `1:`, `~:`) where a name belongs: its path
    with the key as written in the file, and what to do; None for any other error."""
    if err["type"] != "string_type" or err["loc"][-1:] != ("[key]",):
        return None
    import yaml

    parent, value = clean_loc(err["loc"][:-2]), err["input"]
    for where in lines or {}:
        if where[:-1] == parent and len(where) == len(parent) + 1:
            try:
                read = yaml.safe_load(where[-1])
            except yaml.YAMLError:
                continue
            if read == value and type(read) is type(value):
                text = where[-1]
                return where, (f"YAML reads this key as {kind_of(value)}, not as a name; quote it ('{text}':) or "
                               "rename it")
    return parent + (str(value),), f"YAML reads this key as {kind_of(value)}, not as a name; quote it or rename it"


def format_error(path: Path, exc: ValidationError, lines: dict[tuple, int] | None = None) -> str:
    """One line per problem: FILE:LINE: dotted.key: what is wrong and what to write."""
    by_loc: dict[tuple, list[str]] = {}
    for err in exc.errors():
        message = message_for(err)
        loc = clean_loc(err["loc"])
        if (written := key_as_written(err, lines)) is not None:
            loc, message = written
        if message not in by_loc.setdefault(loc, []):
            by_loc[loc].append(message)
    out = []
    for loc, messages in by_loc.items():
        line = None
        for depth in range(len(loc), 0, -1):  # a missing key: the line of the mapping that lacks it
            line = (lines or {}).get(loc[:depth])
            if line:
                break
        where = f"{path}:{line}" if line else str(path)
        out.append(f"{where}: {'.'.join(loc) or '(top level)'}: {' / '.join(messages)}")
    if len(out) > MAX_ERRORS_SHOWN:
        out = out[:MAX_ERRORS_SHOWN] + [f"... and {len(out) - MAX_ERRORS_SHOWN} more"]
    return "\n".join(out)


def with_overrides(section: BaseModel | type[BaseModel], **changes) -> BaseModel:
    """A copy of a params section with `changes` applied (a CLI flag or a caller's argument; None means
    not given) and validated again, like the file: the fields' defaults and bounds live only here.
    A section's class stands for its defaults (a field without one, such as a suite's task, must be
    among the changes)."""
    changes = {key: value for key, value in changes.items() if value is not None}
    kind = section if isinstance(section, type) else type(section)
    if not changes and not isinstance(section, type):
        return section
    unknown = sorted(set(changes) - set(kind.model_fields))
    if unknown:
        raise TypeError(f"{kind.__name__} has no setting {', '.join(unknown)}")
    given = {} if isinstance(section, type) else section.model_dump()
    try:
        return kind.model_validate({**given, **changes})
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            loc = clean_loc(err["loc"])
            flag = "--" + "-".join(str(p) for p in loc).replace("_", "-")
            given = f" {changes[loc[0]]}" if loc and loc[0] in changes else ""
            problems.append(f"{flag}{given}: {message_for(err)}")
        raise UserError("; ".join(problems)) from None


def sections_with_overrides(*sections: BaseModel | type[BaseModel], **changes) -> tuple[BaseModel, ...]:
    """Several sections a stage takes, each change applied to the first of them with a field of its
    name (so list the stage's own section first) and validated again (with_overrides)."""
    routed: list[dict] = [{} for _ in sections]
    kinds = [s if isinstance(s, type) else type(s) for s in sections]
    for key, value in changes.items():
        owner = next((i for i, kind in enumerate(kinds) if key in kind.model_fields), None)
        if owner is None:
            raise TypeError(f"no setting {key} in {', '.join(kind.__name__ for kind in kinds)}")
        routed[owner][key] = value
    return tuple(with_overrides(section, **own) for section, own in zip(sections, routed))
