"""Checks of the plain arguments the core takes: counts, indices, flags, durations.

Why strict: Python would happily turn ``True`` into 1, ``2.7`` into 2 (``int()``), ``"no"`` into
a true flag (``bool()``) and ``-1`` into "the last one". Each of those silently does something the
caller did not ask for (record when told "no", commit layer 1 when handed a flag). So integers
must be integers (Python, numpy or a 0-d integer tensor; never a bool), flags must be booleans,
and each value is range-checked, before anything is built or written. The error type is the
caller's (a placement error, a state error, a settings error), so a caller catches one family.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch

from eplb_graph.errors import EplbError

MAX_COUNT = 1 << 31
"""Largest count or step number any setting may have: far beyond real use, small enough that a
typo like ``10**30`` is caught at the boundary instead of overflowing a tensor later."""


def as_int(
    name: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = MAX_COUNT,
    error: type[Exception] = ValueError,
) -> int:
    """``value`` as a plain int in ``[minimum, maximum]``, else ``error`` naming ``name``."""
    if isinstance(value, torch.Tensor) and value.dim() != 0:
        raise error(f"{name} must be an integer, got a tensor of shape {tuple(value.shape)}")
    is_bool_tensor = isinstance(value, torch.Tensor) and value.dtype == torch.bool
    if isinstance(value, bool) or is_bool_tensor:
        raise error(f"{name} must be an integer, got the boolean {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise error(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise error(f"{name} must be >= {minimum}, got {number}")
    if maximum is not None and number > maximum:
        raise error(f"{name} must be <= {maximum}, got {number}")
    return number


def as_index(name: str, value: Any, size: int, *, error: type[Exception] = ValueError) -> int:
    """``value`` as a plain int index in ``[0, size)`` (negatives are refused, not wrapped)."""
    number = as_int(name, value, minimum=None, maximum=None, error=error)
    if not 0 <= number < size:
        raise error(f"{name} must be in [0, {size}), got {number}")
    return number


def as_flag(name: str, value: Any, *, error: type[Exception] = ValueError) -> bool:
    """``value`` as a bool: a Python or numpy boolean only (a string or number is refused)."""
    if isinstance(value, bool):
        return value
    if type(value).__name__ == "bool_":  # numpy.bool_, without importing numpy here
        return bool(value)
    raise error(f"{name} must be True or False, got {value!r}")


def as_seconds(name: str, value: Any, *, error: type[Exception] = ValueError) -> float:
    """A finite, positive duration in seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise error(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise error(f"{name} must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class SettingsError(EplbError, ValueError):
    """A core settings object (``RuntimeSettings``) got a bad value."""
