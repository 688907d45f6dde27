"""Typed, ranged dataclass fields and the one error every bad setting raises.

Why the schemas are declared rather than hand-checked: a wrong EPLB setting rarely crashes, it
silently balances nothing (or balances with a stale window) and shows up days later as a
tail-latency regression. So each field carries its type, range and choices in its dataclass
metadata, one routine checks all of them at construction, and every :class:`ConfigError` names
the offending field the way the user spelled it and says how to fix it.

This module is internal to :mod:`eplb_graph.integrations.settings`; only :class:`ConfigError` is
part of the public API.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import os
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field
from enum import Enum
from typing import Any

from eplb_graph.errors import EplbError

#: How settings are spelled in messages: ``eplb_config.<field>`` is ``--eplb-config.<field>``,
#: ``additional_config.eplb_config.<key>`` is a key of ``--additional-config``'s EPLB section.
V2_PREFIX = "eplb_config"
ADDITIONAL = "additional_config"
ADDITIONAL_EPLB = "additional_config.eplb_config"

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})

# Upper bounds of the integer settings. Every integer has one, because an unbounded value is
# accepted at initialization and fails later, far from its cause (a window of 10**30 steps is
# accepted, then cannot be allocated when the runtime starts).

#: Steps between events (``step_interval``, ``algorithm_execution_interval``, logging intervals):
#: 2**31 - 1 steps is over 240 days at 10 ms a step, so a larger value means "never" by mistake.
MAX_STEPS = 2**31 - 1
#: Steps of load in one window (``window_size``, ``expert_heat_collection_interval``). The window
#: keeps ``steps x MoE layers x slots`` counters allocated up front, so this bound is 2**20; size
#: the window for the model too (58 layers x 288 slots is 130 KB a step).
MAX_WINDOW_STEPS = 2**20
#: Logical experts (``num_experts``), extra physical slots (``num_redundant_experts``) and EP
#: ranks (``ep_size``): far past any model or cluster.
MAX_EXPERTS = 2**16

#: What command-line text may spell an integer: ASCII digits with an optional minus (so that a
#: negative value gets the range message). ``int()`` also takes ``1_000``, ``+5`` and digits of
#: other scripts (``１０００``), which a typo or a pasted value can produce unseen.
_DECIMAL = re.compile(r"-?[0-9]{1,20}")
_ASCII_SPACE = " \t\r\n\f\v"


class ConfigError(EplbError, ValueError):
    """An EPLB setting is invalid; raised at initialization, before any state is built.

    Attributes:
        field: dotted name of the offending setting as the user spells it
            (``eplb_config.window_size``, ``additional_config.eplb_config.dynamic_eplb``,
            ``ep_size``, ``DYNAMIC_EPLB``).
        reason: the message without the field prefix (what is wrong and how to fix it).
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str]]:
        # ValueError pickles only args[0]; keep (field, reason) so errors cross process pools.
        return type(self), (self.field, self.reason)


def option(
    default: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    choices: tuple[Any, ...] | None = None,
    check: Callable[[str, Any], None] | None = None,
    doc: str = "",
) -> Any:
    """A dataclass field whose metadata drives coercion and validation in one place."""
    metadata = {"minimum": minimum, "maximum": maximum, "choices": choices, "check": check}
    return field(default=default, metadata={**metadata, "doc": doc})


def enum_values(kind: type[Enum]) -> tuple[Any, ...]:
    """The values of an enum, in declaration order: choices owned by the enum, not copied."""
    return tuple(member.value for member in kind)


def show_value(value: Any) -> str:
    """How a bad value is quoted in messages: text as typed, everything else as JSON."""
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"{show_integer(value)} (integer)"
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    kind = {bool: "boolean", int: "integer", float: "number", type(None): "null"}.get(
        type(value), type(value).__name__
    )
    return f"{text} ({kind})"


def show_integer(value: int) -> str:
    """An integer for a message; one too long to print (``str()`` refuses past 4300 digits, and
    quoting a huge one helps nobody) is shown by its size."""
    if value.bit_length() <= 128:
        return str(value)
    return f"{'-' if value < 0 else ''}an integer of {value.bit_length()} bits"


def suggest(key: str, known: Sequence[str]) -> str:
    """`` (did you mean 'x'?)`` for a close known key, else the empty string."""
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _split_optional(hint: Any) -> tuple[type, bool]:
    """``int`` -> (int, False); ``str | None`` -> (str, True)."""
    args = typing.get_args(hint)
    if args:
        base = [arg for arg in args if arg is not type(None)]
        return base[0], type(None) in args
    return hint, False


def _describe(base: type) -> str:
    return {bool: "true or false", int: "an integer", str: "a string"}.get(base, base.__name__)


def coerce(name: str, value: Any, hint: Any, *, from_text: bool) -> Any:
    """Return ``value`` as the field type ``hint``, or raise :class:`ConfigError` naming ``name``.

    ``from_text`` is for command-line values (always strings): ``"100"`` becomes 100 and
    ``"true"`` becomes True. Otherwise (JSON, Python) the type must already be right: a JSON
    string ``"100"`` is not an integer and ``true`` is not the integer 1, because guessing what a
    mistyped document meant is how silent misconfiguration happens.
    """
    base, optional = _split_optional(hint)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if from_text and isinstance(value, str):
        text = value.strip(_ASCII_SPACE)
        if optional and text.lower() in ("none", "null"):
            return None
        if base is bool:
            if text.lower() in _TRUE_WORDS:
                return True
            if text.lower() in _FALSE_WORDS:
                return False
            raise ConfigError(name, f"expected true or false, got {_quote(value)}")
        if base is int:
            return _decimal(name, value, text)
        return value
    if value is None:
        if optional:
            return None
        raise ConfigError(name, f"expected {_describe(base)}, got null; omit it to use the default")
    if base is bool and not isinstance(value, bool):
        raise ConfigError(name, f"expected true or false, got {show_value(value)}")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(name, f"expected an integer, got {show_value(value)}")
    if base is str and not isinstance(value, str):
        raise ConfigError(name, f"expected a string, got {show_value(value)}")
    return value


def _decimal(name: str, value: str, text: str) -> int:
    """Command-line text as an integer: plain ASCII decimal only (see ``_DECIMAL``)."""
    if _DECIMAL.fullmatch(text):
        return int(text, 10)
    hint = ""
    if text.lstrip("+-").replace("_", "").isdigit():
        hint = "; write it in plain digits 0-9 (no '_', '+' or digits of other scripts)"
    if text.lstrip("-").isdigit() and text.isascii():
        hint = f"; {len(text.lstrip('-'))} digits is far past any setting's maximum"
    raise ConfigError(name, f"expected an integer, got {_quote(value)}{hint}")


def _quote(text: str) -> str:
    return repr(text) if len(text) <= 40 else f"{text[:37]!r}... ({len(text)} characters)"


def _check_value(name: str, value: Any, metadata: Mapping[str, Any]) -> None:
    """Range, choice and custom checks of an already-typed value."""
    minimum, maximum = metadata.get("minimum"), metadata.get("maximum")
    if value is None:
        return
    if minimum is not None and value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {show_integer(value)}")
    if maximum is not None and value > maximum:
        raise ConfigError(name, f"must be <= {maximum}, got {show_integer(value)}")
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        shown = ", ".join("null" if c is None else repr(c) for c in choices)
        raise ConfigError(name, f"must be one of {shown}, got {show_value(value)}")
    check = metadata.get("check")
    if check is not None:
        check(name, value)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class Validated:
    """Mixin: a frozen dataclass whose fields are typed and range-checked on construction."""

    #: prefix of field names in messages, e.g. ``eplb_config``
    _PREFIX: typing.ClassVar[str] = ""

    @classmethod
    def _fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def field_names(cls) -> list[str]:
        return list(cls._fields())

    @classmethod
    def coerce_field(
        cls, key: str, value: Any, *, from_text: bool = False, prefix: str | None = None
    ) -> Any:
        """Type-coerce and validate one field; the error names ``<prefix>.<key>``.

        The caller has checked that ``key`` is a field of this class.
        """
        name = f"{cls._PREFIX if prefix is None else prefix}.{key}"
        hint = _type_hints(cls)[key]
        value = coerce(name, value, hint, from_text=from_text)
        _check_value(name, value, cls._fields()[key].metadata)
        return value

    def _validate_all(self) -> None:
        for key in self._fields():
            self.coerce_field(key, getattr(self, key))
