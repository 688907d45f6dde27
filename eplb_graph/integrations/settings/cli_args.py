"""The EPLB options of a serve command line, parsed the way vLLM's parser spells them.

For a launcher or a test that holds an argument list rather than vLLM's config objects:
:func:`parse_cli_args` picks out ``--enable-eplb``, ``--eplb-config`` and ``--additional-config``,
types their values as the keyword arguments of
:func:`~eplb_graph.integrations.settings.resolve.resolve_eplb_config`, and hands every other
argument back untouched::

    eplb_arguments, rest = parse_cli_args(argv)
    settings = resolve_eplb_config(**eplb_arguments, num_experts=N, ep_size=ranks)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eplb_graph import strict_json
from eplb_graph.integrations.settings.fields import ADDITIONAL, V2_PREFIX, ConfigError, coerce
from eplb_graph.integrations.settings.v2 import EplbConfig

#: The longest integer literal read from a command-line JSON object, in digits. No setting (ours,
#: or another feature's in ``--additional-config``) needs more, and converting a longer one costs
#: time that grows with the square of its length.
MAX_JSON_INTEGER_DIGITS = 100


def _load_json_object(name: str, option: str, text: str, example: str) -> dict[str, Any]:
    """Parse one option's JSON object strictly: a key given twice at any depth is an error
    (naming the key), as a field given twice on the command line is, instead of "last wins"."""
    try:
        value = strict_json.loads(
            text, max_integer_digits=MAX_JSON_INTEGER_DIGITS, allow_constants=True
        )
    except strict_json.StrictJsonError as error:
        if error.line is not None:
            raise ConfigError(
                name,
                f"{option} is not valid JSON (line {error.line}, column {error.column}: "
                f"{error.syntax}); pass a JSON object such as {example}",
            ) from None
        field = f"{name}.{error.where}" if error.where else name
        raise ConfigError(field, f"{error.problem} (in {option})") from None
    if not isinstance(value, dict):
        shown = text if len(text) <= 80 else f"{text[:77]}..."
        raise ConfigError(name, f"{option} must be a JSON object such as {example}, got {shown!r}")
    return value


def parse_cli_args(argv: Sequence[str]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Parse the EPLB options of a serve command line.

    Returns ``(eplb_arguments, rest)``: ``eplb_arguments`` are ``enable_eplb``, ``eplb_config``
    (the fields given, typed; ``None`` if none) and ``additional_config`` (``None`` if not
    given), the keyword arguments of ``resolve_eplb_config``; ``rest`` is every other argument,
    in order.

    Understands ``--enable-eplb``, ``--eplb-config.<field> VALUE`` / ``--eplb-config.<field>=VALUE``
    (text coerced by the field's type), ``--eplb-config '<json object>'`` and
    ``--additional-config '<json object>'``. Option names may use ``_`` for ``-`` and field names
    ``-`` for ``_`` (as vLLM's parser allows). A field given twice (in any spelling) is an error
    rather than "last wins", because the two spellings usually come from different layers of a
    launch script and silently dropping one is exactly what invariant 7 forbids. The same holds
    for ``--enable-eplb`` given twice and for a key given twice inside one JSON object, at any
    depth.

    Raises:
        ConfigError: naming the field (``eplb_config.window_size``) on any bad value.
    """
    enable = False
    enable_source: str | None = None
    v2: dict[str, Any] = {}
    v2_source: dict[str, str] = {}
    additional: dict[str, Any] | None = None
    rest: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token == "--":
            rest.extend(argv[index - 1 :])
            break
        if not token.startswith("--"):
            rest.append(token)
            continue
        head, has_inline, inline = token[2:].partition("=")
        option, dotted, key = head.partition(".")
        option = option.replace("_", "-")
        if option not in ("enable-eplb", "eplb-config", "additional-config"):
            rest.append(token)
            continue
        if option == "enable-eplb":
            if dotted:
                raise ConfigError("enable_eplb", f"{token!r} takes no field; use --enable-eplb")
            if enable_source is not None:
                raise ConfigError(
                    "enable_eplb", f"given twice ({enable_source} and {token}); give it once"
                )
            enable = coerce("enable_eplb", inline, bool, from_text=True) if has_inline else True
            enable_source = token
            continue
        if has_inline:
            value = inline
        elif index < len(argv) and not argv[index].startswith("--"):
            value = argv[index]
            index += 1
        else:
            field_name = f"{V2_PREFIX}.{key}" if dotted else option.replace("-", "_")
            raise ConfigError(field_name, f"--{head} needs a value")
        if option == "additional-config":
            if dotted:
                raise ConfigError(
                    f"{ADDITIONAL}.{key}",
                    "pass --additional-config as one JSON object, e.g. "
                    '\'{"eplb_config": {"load_collection_phase": "prefill"}}\'',
                )
            if additional is not None:
                raise ConfigError(ADDITIONAL, "--additional-config given twice; merge them")
            additional = _load_json_object(
                ADDITIONAL, "--additional-config", value, "'{\"eplb_config\": {...}}'"
            )
            continue
        if dotted:
            items = [(key.replace("-", "_"), value, f"--eplb-config.{key}", True)]
        else:
            parsed = _load_json_object(
                V2_PREFIX, "--eplb-config", value, "'{\"window_size\": 100}'"
            )
            items = [(str(k), v, "--eplb-config JSON", False) for k, v in parsed.items()]
        for field_key, raw, source, from_text in items:
            EplbConfig.check_key(field_key)
            if field_key in v2:
                raise ConfigError(
                    f"{V2_PREFIX}.{field_key}",
                    f"given twice ({v2_source[field_key]} and {source}); give it once",
                )
            v2[field_key] = EplbConfig.coerce_field(field_key, raw, from_text=from_text)
            v2_source[field_key] = source
    eplb_arguments = {
        "enable_eplb": enable,
        "eplb_config": v2 or None,
        "additional_config": additional,
    }
    return eplb_arguments, tuple(rest)
