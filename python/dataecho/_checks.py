"""Argument checks shared by the public constructors: each names the argument."""

from __future__ import annotations

import inspect
import math
import numbers
import operator
import secrets
from typing import Any, Callable

from . import _core

_UINT64 = 1 << 64


def integer(name: str, value: Any, expected: str) -> int:
    """Returns ``value`` as an int; rejects bool and non-integers, saying what was `expected`."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected {expected}, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected {expected}, got {value!r}") from None


def positive_int(name: str, value: Any, maximum: int | None = None) -> int:
    """Returns ``value`` as an int in [1, maximum]; rejects bool and non-integers."""
    number = integer(name, value, "a positive int")
    if number < 1:
        raise ValueError(f"{name}: expected a positive int, got {number}")
    if maximum is not None and number > maximum:
        raise ValueError(f"{name}: expected at most {maximum}, got {number}")
    return number


def real(name: str, value: Any, minimum: float, maximum: float) -> float:
    """Returns ``value`` as a finite float in [minimum, maximum)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # an int (or Fraction) beyond float range
        number = math.inf
    if not math.isfinite(number) or not minimum <= number < maximum:
        raise ValueError(f"{name}: expected a finite number in [{minimum:g}, {maximum:g}), got {value!r}")
    return number


def echo_factor(value: Any, name: str = "echo_factor") -> float | str:
    """A number in [1, _core.MAX_ECHO), or the string "auto"."""
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"{name}: expected a number >= 1 or 'auto', got {value!r}")
        return "auto"
    return real(name, value, 1.0, _core.MAX_ECHO)


def choice(name: str, value: Any, options: tuple[str, ...]) -> str:
    """Returns ``value``, a str that is one of ``options``."""
    if not isinstance(value, str) or value not in options:
        expected = " or ".join(repr(option) for option in options)
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return str(value)


def flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return value


def seed(value: Any, name: str = "seed") -> int:
    """A 64-bit seed: ``value`` itself, or a fresh random one for None."""
    if value is None:
        return secrets.randbits(64)
    number = integer(name, value, "None or a non-negative int")
    if not 0 <= number < _UINT64:
        raise ValueError(f"{name}: expected an int in [0, 2**64), got {number}")
    return number


def timeout(value: Any) -> float | None:
    """None (wait forever) or a non-negative number of seconds."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"timeout: expected None or seconds as a number, got {value!r}")
    try:
        seconds = float(value)
    except OverflowError:  # an int (or Fraction) beyond float range
        raise ValueError(f"timeout: expected None or seconds within float range, got {value!r}") from None
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"timeout: expected None or a non-negative number of seconds, got {value!r}")
    return None if math.isinf(seconds) else seconds


def hold(value: Any) -> bool | str:
    """Returns ``value`` if it is True, False or ``"auto"`` (a buffer's ``hold``)."""
    if value is True or value is False or (isinstance(value, str) and value == "auto"):
        return value
    raise ValueError(f"hold: expected True, False or 'auto', got {value!r}")


def accepts_keyword(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` can be called with the keyword ``name`` (named, or **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == name and p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))
        for p in parameters
    )
