"""Field types and the located-problem helper every recipe schema module shares."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, Strict
from pydantic_core import PydanticCustomError

KeyPath = tuple[str | int, ...]


def format_key_path(path: KeyPath) -> str:
    """``("model", "compress_ratios", 3)`` -> ``model.compress_ratios[3]``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _problem(detail: str, path: KeyPath = ()) -> PydanticCustomError:
    """A validation error whose ``path`` (relative to where pydantic raises it) points
    at the offending key, so a check spanning several fields still names one line."""
    where = format_key_path(path)
    template = "{where}: {detail}" if where else "{detail}"
    return PydanticCustomError("recipe_check", template, {"where": where, "detail": detail, "path": path})


# --- field types --------------------------------------------------------------------

def _no_bool(value: Any) -> Any:
    # True == 1 in Python, so Literal[1] and Literal[0, 1, 2] would accept booleans.
    if isinstance(value, bool):
        raise _problem(f"expected a number, got the boolean {value}")
    return value


def _check(predicate, expected: str):
    def validate(value):
        if not predicate(value):
            raise _problem(f"{value!r} is not {expected}")
        return value
    return AfterValidator(validate)


def _strictly_increasing(values: tuple[int, ...]) -> tuple[int, ...]:
    for i in range(1, len(values)):
        if values[i] <= values[i - 1]:
            raise _problem(f"{values[i]} follows {values[i - 1]}; buckets must be strictly increasing", (i,))
    return values


def _unique(values: tuple[int, ...]) -> tuple[int, ...]:
    for i, value in enumerate(values):
        if value in values[:i]:
            raise _problem(f"{value} is listed twice; entries must be unique", (i,))
    return values


PosInt = Annotated[int, Strict(), Field(gt=0)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
PosFloat = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
Ratio = Annotated[Literal[0, 1, 2], BeforeValidator(_no_bool)]
Buckets = Annotated[tuple[PosInt, ...], Field(min_length=1), AfterValidator(_strictly_increasing)]


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- schema -------------------------------------------------------------------------
