"""The base of every params.yaml section (pipeline/settings/params.py, and each quantization method's own section in
pipeline/methods/): unknown keys refused, no NaN or infinity, and true/false never taken for a number.

Kept apart from params.py so that a method module can declare its section without importing the whole
schema (params.py imports the method registry to validate `variants`)."""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator


class BoolGiven:
    """Stands in for a true/false written where a number belongs, so the error is reported at its key
    (pipeline/settings/errors.py says it)."""

    def __init__(self, value) -> None:
        self.value = value


def _accepts_bool(annotation) -> bool:
    if annotation is bool or annotation in (dict, list, typing.Any):
        return True
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True  # a section: its own fields are checked
    return any(_accepts_bool(arg) for arg in typing.get_args(annotation))


def _holds_bool(value) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, dict):
        return any(isinstance(v, bool) for v in value.values())
    return isinstance(value, list) and any(isinstance(v, bool) for v in value)


def _no_nul(path: Path) -> Path:
    if "\0" in str(path):
        raise ValueError("holds a NUL character; give a plain path")
    return path


def _writable_name(path: Path) -> Path:
    from pipeline.outputs import path_problem

    if (problem := path_problem(path)) is not None:
        raise ValueError(problem)
    return path


SafePath = Annotated[Path, AfterValidator(_no_nul)]
# a folder a stage writes (atomically: pipeline/outputs.py): every part a name this file system takes, the last one
# with the writers' temporary names
OutPath = Annotated[Path, AfterValidator(_no_nul), AfterValidator(_writable_name)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_as_number(cls, data):
        """pydantic reads true as 1: `batch_size: true` is a mistake, not a batch of one."""
        if isinstance(data, dict) and any(isinstance(v, bool) or isinstance(v, (list, dict)) for v in data.values()):
            data = dict(data)
            for key, value in data.items():
                field = cls.model_fields.get(key) if isinstance(key, str) else None
                if field is not None and not _accepts_bool(field.annotation) and _holds_bool(value):
                    data[key] = BoolGiven(value)  # fails its field's validation: reported there
        return data
