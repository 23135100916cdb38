"""What every section of the run config shares: strict pydantic models and the value types.

Unknown keys are rejected at every depth (`extra="forbid"`), every model is frozen, a
boolean is never taken for a number, and inf/nan are refused for every float.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

Auto = Literal["auto"]
PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
OffloadDevice = Literal["none", "cpu", "nvme"]


def admits_bool(annotation: Any) -> bool:
    """Whether a field of this type may hold true/false (pydantic would otherwise read
    `true` as 1 for an int, and `Literal[0, 1, 2, 3]` would take it as 1)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return any(isinstance(arg, bool) for arg in args)
    if origin in (Annotated, Union):
        return any(admits_bool(arg) for arg in (args[:1] if origin is Annotated else args))
    return annotation is bool or annotation is Any


def admits_text(annotation: Any) -> bool:
    """Whether a field of this type holds free text (a str, possibly optional)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin in (Annotated, Union):
        return any(admits_text(arg) for arg in (args[:1] if origin is Annotated else args))
    return annotation is str


class Section(BaseModel):
    """Base for every section: unknown keys are errors, values are immutable, a boolean is
    never taken for a number, and inf/nan are refused for every float."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")  # "*": every field, so always named
        annotation = field.annotation if field is not None else None
        if isinstance(value, bool) and not admits_bool(annotation):
            if admits_text(annotation):  # `pattern: yes`: YAML 1.1 read the word as a boolean
                raise ValueError(f"expected text, got the boolean {str(value).lower()}: YAML reads an unquoted yes, "
                                 "no, on, off, true or false as a boolean; quote the value (\"yes\")")
            raise ValueError(f"expected a number or one of the allowed values, got the boolean {str(value).lower()}")
        return value
