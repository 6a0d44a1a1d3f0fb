"""Argument checks shared by every public config and entry point (private).

Each check raises :class:`~rayslice.errors.InvalidArgument` (a ``TypeError``
and a ``ValueError`` at once, so callers catching either keep working) with a
message that names the parameter, shows the bad value and says what is valid.
They return the value, normalized where that is unambiguous (an ``int`` given
for a float parameter becomes a ``float``), so a constructor can write
``self.x = check_int("x", x, minimum=1)``.

Booleans are never accepted as numbers, and numbers are never accepted as
strings: ``num_slices=True`` or ``timeout_s="5"`` are mistakes, not values.

Example:
    >>> check_int("num_slices", 2, minimum=1)
    2
    >>> check_int("num_slices", "2", minimum=1)
    Traceback (most recent call last):
    ...
    rayslice.errors.InvalidArgument: num_slices='2' is not valid: expected an integer >= 1, got str
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, TypeVar

from rayslice.errors import InvalidArgument

T = TypeVar("T")

__all__ = [
    "check_bool",
    "check_callable",
    "check_choice",
    "check_float",
    "check_instance",
    "check_int",
    "check_optional",
    "check_resources",
    "check_str",
    "check_str_list",
    "fail",
]


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fail(name: str, value: object, valid: str, got_type: bool = False) -> InvalidArgument:
    """The error for ``name=value``; ``valid`` says what would have been accepted.

    Example:
        >>> str(fail("ragged", "skip", "one of 'raise', 'drop', 'pad'"))
        "ragged='skip' is not valid: expected one of 'raise', 'drop', 'pad'"
    """
    suffix = f", got {type(value).__name__}" if got_type else ""
    return InvalidArgument(f"{name}={_short(value)} is not valid: expected {valid}{suffix}")


def _range_text(minimum: float | None, maximum: float | None, exclusive_min: bool) -> str:
    parts = []
    if minimum is not None:
        parts.append(f"{'>' if exclusive_min else '>='} {minimum:g}")
    if maximum is not None:
        parts.append(f"<= {maximum:g}")
    return " ".join(parts) if len(parts) < 2 else f"{parts[0]} and {parts[1]}"


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An ``int`` (not a bool, float or string) within ``[minimum, maximum]``.

    Example:
        >>> check_int("batch_size", 4.0, minimum=1)
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: batch_size=4.0 is not valid: expected an integer >= 1, got float
    """
    bounds = _range_text(minimum, maximum, False)
    valid = "an integer" + (f" {bounds}" if bounds else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise fail(name, value, valid, got_type=True)
    value = int(value)  # numpy integers too
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise fail(name, value, valid)
    return value


def check_float(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_min: bool = False,
    allow_inf: bool = False,
) -> float:
    """A real number (int or float, not bool or string), finite unless ``allow_inf``.

    Example:
        >>> check_float("timeout_s", 0, minimum=0, exclusive_min=True)
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: timeout_s=0 is not valid: expected a number > 0
    """
    bounds = _range_text(minimum, maximum, exclusive_min)
    valid = "a number" + (f" {bounds}" if bounds else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise fail(name, value, valid, got_type=True)
    number = float(value)
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise fail(name, value, valid + " (finite)")
    too_low = minimum is not None and (number <= minimum if exclusive_min else number < minimum)
    if too_low or (maximum is not None and number > maximum):
        raise fail(name, value, valid)
    return number


def check_bool(name: str, value: object) -> bool:
    """``True`` or ``False`` (not 0/1, not "yes")."""
    if not isinstance(value, bool):
        raise fail(name, value, "True or False", got_type=True)
    return value


def check_str(name: str, value: object, *, non_empty: bool = True) -> str:
    """A string, stripped; non-empty unless ``non_empty=False``."""
    if not isinstance(value, str):
        raise fail(name, value, "a string", got_type=True)
    if non_empty and not value.strip():
        raise fail(name, value, "a non-empty string")
    return value


def check_str_list(name: str, value: object) -> tuple[str, ...]:
    """A list/tuple of strings (a lone string is refused: ``"id"`` is not ``["i", "d"]``)."""
    if isinstance(value, str):
        raise fail(name, value, f"a list of strings, e.g. [{value!r}]")
    if not isinstance(value, Iterable) or isinstance(value, Mapping | bytes):
        raise fail(name, value, "a list of strings", got_type=True)
    items = tuple(value)
    for item in items:
        if not isinstance(item, str) or not item:
            raise fail(name, value, "a list of non-empty strings")
    if len(set(items)) != len(items):
        raise fail(name, value, "a list of distinct strings")
    return items


def check_choice(name: str, value: object, choices: Collection[T]) -> T:
    """One of ``choices`` (compared with ``==``)."""
    if value not in choices:
        raise fail(name, value, "one of " + ", ".join(repr(c) for c in choices))
    return value  # type: ignore[return-value]


def check_instance(name: str, value: object, cls: type[T] | tuple[type, ...], what: str | None = None) -> T:
    """An instance of ``cls``; ``what`` describes it in the message (default: the class name)."""
    if not isinstance(value, cls):
        names = cls.__name__ if isinstance(cls, type) else " or ".join(c.__name__ for c in cls)
        raise fail(name, value, what or f"a {names}", got_type=True)
    return value  # type: ignore[return-value]


def check_callable(name: str, value: object) -> Callable[..., Any]:
    """Something callable."""
    if not callable(value):
        raise fail(name, value, "a callable", got_type=True)
    return value


def check_optional(check: Callable[..., T], name: str, value: object, **kwargs: Any) -> T | None:
    """``None``, or whatever ``check(name, value, **kwargs)`` accepts.

    Example:
        >>> check_optional(check_int, "num_to_keep", None, minimum=1) is None
        True
    """
    return None if value is None else check(name, value, **kwargs)


def check_resources(name: str, value: object, *, forbidden: Collection[str] = ()) -> dict[str, float]:
    """A mapping of Ray resource name to a finite amount >= 0 (None: empty).

    Example:
        >>> check_resources("resources_per_host", {"CPU": 1})
        {'CPU': 1.0}
        >>> check_resources("resources_per_host", {"CPU": -1})
        Traceback (most recent call last):
        ...
        rayslice.errors.InvalidArgument: resources_per_host['CPU']=-1 is not valid: expected a number >= 0
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise fail(name, value, "a mapping of resource name to amount, e.g. {'CPU': 1}", got_type=True)
    out: dict[str, float] = {}
    for key, amount in value.items():
        if not isinstance(key, str) or not key:
            raise fail(name, value, "resource names as non-empty strings")
        if key in forbidden:
            raise fail(name, value, f"no {key!r} entry ({key} per host comes from the topology)")
        out[key] = check_float(f"{name}[{key!r}]", amount, minimum=0)
    return out
