"""Load an audit target from a ``module:callable`` string.

The callable takes no arguments and returns ``(fn, example_args, eplb_state)``; building the model
inside a function (rather than at import) lets one module expose several targets and keeps the
CLI's import cheap. Every way this can go wrong raises :class:`TargetError` with a message naming
the string, so the CLI can exit 2 with it verbatim. That includes target code that calls
``sys.exit`` (any code) or raises another ``BaseException`` other than ``KeyboardInterrupt``:
left alone, ``sys.exit(0)`` at import would end the CLI with status 0 and no report, which reads
as a clean audit.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from eplb_graph.audit import DEFAULT_TARGET  # defined there, so the CLI needs no torch
from eplb_graph.audit.runner import check_state, describe_escape
from eplb_graph.errors import EplbError


class TargetError(EplbError):
    """The TARGET string is malformed, does not import, or its callable misbehaves."""


@dataclass(frozen=True)
class AuditTarget:
    spec: str
    fn: Callable
    example_args: tuple
    eplb_state: object | None


@contextlib.contextmanager
def _no_exit(spec: str, doing: str) -> Iterator[None]:
    """Turn an escape of the target's code that is not an ``Exception`` into a TargetError."""
    try:
        yield
    except (Exception, KeyboardInterrupt):
        raise
    except BaseException as error:
        raise TargetError(
            f"TARGET {spec!r} {describe_escape(error)} {doing}; a target must not exit the process"
        ) from error


def _resolve(spec: str) -> Callable:
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise TargetError(f"TARGET must look like 'package.module:callable', got {spec!r}")
    # Like ``python -m``: targets in the working directory (tests/, a runner's repo) import.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        with _no_exit(spec, f"while importing module {module_name!r}"):
            module = importlib.import_module(module_name)
    except TargetError:
        raise
    except Exception as error:
        raise TargetError(
            f"cannot import module {module_name!r} of TARGET {spec!r}: "
            f"{type(error).__name__}: {error}"
        ) from error
    value = module
    with _no_exit(spec, f"while reading attribute {attribute!r}"):
        for part in attribute.split("."):
            if not hasattr(value, part):
                raise TargetError(f"module {module_name!r} has no attribute {attribute!r}")
            value = getattr(value, part)
    if not callable(value):
        raise TargetError(f"TARGET {spec!r} is not callable ({type(value).__name__})")
    return value


def load_target(spec: str = DEFAULT_TARGET) -> AuditTarget:
    """Import ``spec``, call it, and validate the ``(fn, example_args, eplb_state)`` it returns."""
    factory = _resolve(spec)
    with _no_exit(spec, "when called"):
        return _call_factory(spec, factory)


def _call_factory(spec: str, factory: Callable) -> AuditTarget:
    try:
        result = factory()
    except Exception as error:
        raise TargetError(f"TARGET {spec!r} raised: {type(error).__name__}: {error}") from error
    if not isinstance(result, tuple) or len(result) != 3:
        raise TargetError(
            f"TARGET {spec!r} must return (fn, example_args, eplb_state), got "
            f"{type(result).__name__}"
            + (f" of length {len(result)}" if isinstance(result, tuple) else "")
        )
    fn, example_args, state = result
    if not callable(fn):
        raise TargetError(f"TARGET {spec!r}: fn is not callable ({type(fn).__name__})")
    if isinstance(example_args, torch.Tensor) or not isinstance(example_args, Sequence):
        raise TargetError(
            f"TARGET {spec!r}: example_args must be a tuple or list, got "
            f"{type(example_args).__name__}"
        )
    try:
        check_state(state)
    except TypeError as error:
        raise TargetError(f"TARGET {spec!r}: {error}") from None
    return AuditTarget(spec, fn, tuple(example_args), state)
