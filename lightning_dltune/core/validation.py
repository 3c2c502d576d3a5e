"""Argument checks shared by every public constructor: one rule per kind of argument, one wording.

Each check returns the value (normalised where that is safe, e.g. a band as a float pair) or raises
at once with the argument's name, what was given and what is allowed. A value of the wrong type raises
:class:`ArgumentTypeError`, which is both a ``TypeError`` and a ``ValueError`` so that callers catching
either keep working.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Iterable, Optional


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type (a ``TypeError`` that ``except ValueError`` also catches)."""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def type_error(name: str, value: Any, allowed: str) -> ArgumentTypeError:
    return ArgumentTypeError(f"`{name}` must be {allowed}, got {value!r} ({type(value).__name__}).")


def count(name: str, value: Any, minimum: int = 0, *, optional: bool = False) -> Optional[int]:
    """An integer ``>= minimum`` (``None`` too where ``optional``)."""
    if value is None and optional:
        return None
    allowed = f"an integer >= {minimum}" + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, int):
        raise type_error(name, value, allowed)
    if value < minimum:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")
    return value


def number(
    name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    *,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    """A finite-or-bounded real number in the interval ``low..high`` (open ends where asked)."""
    left, right = "(" if low_open else "[", ")" if high_open else "]"
    allowed = f"a number in {left}{low:g}, {high:g}{right}"
    if not _is_number(value):
        raise type_error(name, value, allowed)
    too_low = value <= low if low_open else value < low
    too_high = value >= high if high_open else value > high
    if math.isnan(value) or too_low or too_high:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")
    return float(value)


def fraction(name: str, value: Any, *, zero: bool = True) -> float:
    """A share in ``[0, 1]``, or ``(0, 1]`` where ``zero`` is not allowed."""
    return number(name, value, 0.0, 1.0, low_open=not zero)


def band(name: str, value: Any) -> tuple[float, float]:
    """A utilization band: two numbers with ``0 < low < high <= 1`` (the one rule for bands)."""
    allowed = "two numbers (low, high) with 0 < low < high <= 1"
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
        raise type_error(name, value, allowed)
    pair = tuple(value)
    if len(pair) != 2 or not all(_is_number(x) for x in pair):
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")
    low, high = float(pair[0]), float(pair[1])
    if not 0 < low < high <= 1:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")
    return low, high


def flag(name: str, value: Any, *, optional: bool = False) -> Optional[bool]:
    """A real ``bool`` (a string such as ``"no"`` is truthy and would silently mean ``True``)."""
    if value is None and optional:
        return None
    if not isinstance(value, bool):
        raise type_error(name, value, "True or False" + (" or None" if optional else ""))
    return value


def level(name: str, value: Any, highest: int) -> int:
    """A verbosity level: ``False``/``True`` (0/1) or an integer in ``0..highest``."""
    allowed = f"True, False or an integer in 0..{highest}"
    if isinstance(value, bool):
        return int(value)
    if not isinstance(value, int):
        raise type_error(name, value, allowed)
    if not 0 <= value <= highest:
        raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")
    return value


def choice(name: str, value: Any, choices: Iterable[Any]) -> Any:
    """One of ``choices``."""
    options = tuple(choices)
    if value not in options:
        raise ValueError(f"`{name}` must be one of {options}, got {value!r}.")
    return value


def instance(name: str, value: Any, kind: type, what: str) -> Any:
    """An instance of ``kind`` (``what`` names it for the message)."""
    if not isinstance(value, kind):
        raise type_error(name, value, what)
    return value
