"""The base of every component's typed config (a leaf module: imports nothing of overlapkit)."""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError


class Config(BaseModel):
    """A component's config: unknown keys are errors, values are validated on assignment;
    a number is finite (YAML's .inf and .nan are no setting a run can use)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, frozen=False, allow_inf_nan=False
    )

    @model_validator(mode="before")
    @classmethod
    def _no_true_or_false_for_a_number(cls, data: Any) -> Any:
        # pydantic takes true as 1; YAML reads yes, no, on and off as true and false.
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                if isinstance(data.get(name), bool) and _is_number(field.annotation):
                    raise PydanticCustomError(
                        "number_not_bool",
                        "{name} needs a number, not {value} (YAML reads yes, no, on and off "
                        "as true and false)",
                        {"name": name, "value": str(data[name]).lower()},
                    )
        return data


def _is_number(annotation: Any) -> bool:
    """int or float, alone or with None; never a type that also takes a bool."""
    if annotation in (int, float):
        return True
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        return bool(members) and all(m in (int, float) for m in members)
    return False
