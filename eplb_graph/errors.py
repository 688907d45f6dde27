"""The root of every error eplb-graph raises on purpose.

Why one base: an integrator (a model runner, a serving engine's plugin loader) needs one
``except EplbError`` to tell "eplb-graph refused this input or this run" apart from a bug or a
framework failure, without listing a dozen classes that move between releases. Each concrete
error also keeps the builtin base that says what kind of failure it is (``ValueError`` for bad
input, ``RuntimeError`` for a run that could not finish, ``AssertionError`` for a failed
regression check), so ``except ValueError`` written against earlier releases keeps working.

This module imports nothing from the package: any module may derive its errors from it.
"""

from __future__ import annotations

__all__ = ["EplbError"]


class EplbError(Exception):
    """Base class of every exception eplb-graph raises deliberately."""
