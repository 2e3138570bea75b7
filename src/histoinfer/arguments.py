"""Checks of the clients' constructor arguments: a mistake is a ValueError naming the argument
at once, not a wait for the whole timeout or a TypeError from deep inside a later call.

No torch here: ``HttpClient`` uses them too, and must not import it.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_count", "check_flag", "check_seconds"]


def check_count(name: str, value: object, none_ok: bool = False, minimum: int = 1) -> None:
    """An int >= ``minimum`` (not a bool), or None where ``none_ok``."""
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        allowed = f"an int >= {minimum}" + (" or None" if none_ok else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_seconds(name: str, value: object, zero_ok: bool = False, none_ok: bool = False) -> None:
    """A finite number > 0 (>= 0 where ``zero_ok``), or None where ``none_ok``."""
    if value is None and none_ok:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero_ok)
    ):
        allowed = f"a finite number {'>=' if zero_ok else '>'} 0" + (" or None" if none_ok else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def check_flag(name: str, value: object) -> None:
    """True or False (or 0, 1, numpy's booleans): ``dynamic_batching="no"`` would otherwise be
    taken as true."""
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if not (numpy_bool or (isinstance(value, numbers.Integral) and value in (0, 1))):
        raise ValueError(f"{name} must be True or False, got {value!r}")
