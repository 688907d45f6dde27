"""JSON from a user, parsed strictly and in bounded work.

Python's ``json.loads`` keeps the last of two equal keys (``{"window_size": 5, "window_size":
600}`` is 600), accepts ``NaN``, converts an integer literal of any length (quadratic time, or a
``ValueError`` past the interpreter's digit limit) and raises ``RecursionError`` on deep nesting.
For a settings document or an expert map each of those is a silently wrong value or a crash with
no position, so :func:`loads` turns every one into a :class:`StrictJsonError` that names where
in the document it is (``eplb_config.window_size``, ``layer_list[2].device_list[0]``).

How: the parser's hooks never raise; they leave a marker in place of the bad value and note that
one exists. Only then is the document walked (iteratively, so its depth cannot exhaust the stack)
to find the first marker and its path, so a clean document costs no walk at all.
"""

from __future__ import annotations

import json
from typing import Any

from eplb_graph.errors import EplbError


class StrictJsonError(EplbError, ValueError):
    """A JSON text is malformed, or holds a value strict parsing refuses.

    Attributes:
        problem: what is wrong and how to fix it.
        where: the dotted path of the offending key or value (``a.b[2].c``); ``None`` when it is
            the document itself or unknown.
        line / column / syntax: position and the parser's message of a syntax error (``None``
            otherwise).
    """

    def __init__(
        self,
        problem: str,
        *,
        where: str | None = None,
        line: int | None = None,
        column: int | None = None,
        syntax: str | None = None,
    ) -> None:
        super().__init__(f"{where}: {problem}" if where else problem)
        self.problem, self.where = problem, where
        self.line, self.column, self.syntax = line, column, syntax

    def __reduce__(self) -> tuple[Any, ...]:
        position = {"where": self.where, "line": self.line, "column": self.column}
        return _rebuild, (self.problem, {**position, "syntax": self.syntax})


def _rebuild(problem: str, kwargs: dict[str, Any]) -> StrictJsonError:
    return StrictJsonError(problem, **kwargs)


class _Defect:
    """Stands in for a refused value until the walk finds its path; ``key`` is set when the
    defect is a key of the object that holds the marker."""

    __slots__ = ("key", "problem")

    def __init__(self, problem: str, key: str | None = None) -> None:
        self.problem, self.key = problem, key


def loads(text: str, *, max_integer_digits: int, allow_constants: bool = False) -> Any:
    """Parse ``text`` as JSON, refusing what a lenient parser would silently accept.

    Refused: a key given twice in one object (at any depth), an integer literal longer than
    ``max_integer_digits`` digits, ``NaN`` / ``Infinity`` / ``-Infinity`` unless
    ``allow_constants``, nesting deeper than the interpreter's recursion limit, and malformed
    text (with its line and column).

    Raises:
        StrictJsonError: the first refused value, with its path.
    """
    found: list[_Defect] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> Any:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                found.append(
                    _Defect(f"duplicate key {key!r} in one JSON object; give it once", key)
                )
                return found[-1]
            result[key] = value
        return result

    def integer(literal: str) -> Any:
        digits = len(literal.lstrip("-"))
        if digits <= max_integer_digits:
            return int(literal)
        shown = literal if len(literal) <= 24 else f"{literal[:20]}..."
        found.append(
            _Defect(
                f"integer {shown} has {digits} digits, more than the {max_integer_digits} "
                "any accepted value needs"
            )
        )
        return found[-1]

    def constant(name: str) -> Any:
        if allow_constants:
            return float(name)
        found.append(_Defect(f"{name} is not valid JSON; write a number"))
        return found[-1]

    try:
        document = json.loads(
            text, object_pairs_hook=pairs_hook, parse_int=integer, parse_constant=constant
        )
    except json.JSONDecodeError as error:
        raise StrictJsonError(
            f"malformed JSON at line {error.lineno}, column {error.colno}: {error.msg}",
            line=error.lineno,
            column=error.colno,
            syntax=error.msg,
        ) from None
    except RecursionError:
        raise StrictJsonError("nested too deeply to be parsed") from None
    except ValueError as error:  # a literal within max_integer_digits but over the int limit
        raise StrictJsonError(f"a number cannot be converted: {error}") from None
    if found:
        _raise_first_defect(document)
    return document


def _raise_first_defect(document: Any) -> None:
    """Walk ``document`` depth-first in text order; raise for the first :class:`_Defect`."""
    pending: list[tuple[Any, tuple[str | int, ...]]] = [(document, ())]
    while pending:
        value, path = pending.pop()
        if isinstance(value, _Defect):
            where = path if value.key is None else (*path, value.key)
            raise StrictJsonError(value.problem, where=format_path(where) or None)
        if isinstance(value, dict):
            pending.extend((item, (*path, key)) for key, item in reversed(value.items()))
        elif isinstance(value, list):
            pending.extend((item, (*path, i)) for i, item in reversed(list(enumerate(value))))


def format_path(path: tuple[str | int, ...]) -> str:
    """``("a", 2, "b")`` -> ``"a[2].b"``."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text
