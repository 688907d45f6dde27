"""EPLB configuration: the V2 ``EplbConfig``, the legacy (V1-style) keys, and their resolution.

Why this module is strict: a wrong EPLB setting rarely crashes, it silently balances nothing (or
balances with a stale window) and shows up days later as a tail-latency regression. So every
setting is checked once, at initialization, before any device state exists (invariant 7), and
every :class:`ConfigError` names the offending field and says how to fix it.

Two configuration worlds exist, and they must not leak into each other (invariant 8):

- **V2** (upstream vLLM ``EPLBConfig``): ``--enable-eplb`` plus ``--eplb-config.<field>`` (or
  ``--eplb-config '<json>'``); the only V2 key under ``additional_config["eplb_config"]`` is
  ``load_collection_phase``.
- **Legacy** (vllm-ascend Model Runner V1 keys): ``dynamic_eplb``, ``expert_map_path``, ... under
  ``additional_config["eplb_config"]`` (current spelling) or at the top level of
  ``additional_config`` (older spelling).

:func:`resolve_eplb_config` decides which world (or neither) a request belongs to and returns a
:class:`ResolvedEplbConfig` that carries exactly one validated config, never both.
:func:`parse_cli_args` turns the command-line spellings users type into its inputs.
See ``docs/configuration.md`` for the reference.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import logging
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eplb_graph.errors import EplbError

if TYPE_CHECKING:
    from eplb_graph.placement import Placement

logger = logging.getLogger(__name__)

#: Used only when ``eplb_graph.policy`` cannot be imported (or registers nothing).
FALLBACK_POLICY_NAMES: tuple[str, ...] = (
    "default",
    "swift_balance",
    "flash_lb",
    "churn_aware",
    "random",
)
#: vllm-ascend ``eplb_policy_type`` -> registered policy name (vllm-ascend's PolicyFactory order:
#: 0 RandomLoadBalance, 1 DefaultEplb, 2 SwiftBalanceEplb, 3 FlashLB).
LEGACY_POLICY_TYPES: dict[int, str] = {0: "random", 1: "default", 2: "swift_balance", 3: "flash_lb"}
BATCH_PHASES: tuple[str, ...] = ("all", "prefill", "decode")
#: eplb-graph moves weights through gloo CPU staging; ``None`` means "pick it automatically".
SUPPORTED_COMMUNICATORS: tuple[str | None, ...] = (None, "torch_gloo")
#: vllm-ascend's Model Runner V1 environment switches; they must not be set with V2.
LEGACY_ENV_FLAGS: tuple[str, ...] = ("DYNAMIC_EPLB", "EXPERT_MAP_RECORD")

_V2_PREFIX = "eplb_config"
_ADDITIONAL = "additional_config"
_ADDITIONAL_EPLB = "additional_config.eplb_config"
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


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


# -- field machinery ----------------------------------------------------------------------------
def _option(
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


def _show(value: Any) -> str:
    """How a bad value is quoted in messages: text as typed, everything else as JSON."""
    if isinstance(value, str):
        return repr(value)
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    kind = {bool: "boolean", int: "integer", float: "number", type(None): "null"}.get(
        type(value), type(value).__name__
    )
    return f"{text} ({kind})"


def _split_optional(hint: Any) -> tuple[type, bool]:
    """``int`` -> (int, False); ``str | None`` -> (str, True)."""
    args = typing.get_args(hint)
    if args:
        base = [arg for arg in args if arg is not type(None)]
        return base[0], type(None) in args
    return hint, False


def _coerce(name: str, value: Any, hint: Any, *, from_text: bool) -> Any:
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
        text = value.strip()
        if optional and text.lower() in ("none", "null"):
            return None
        if base is bool:
            if text.lower() in _TRUE_WORDS:
                return True
            if text.lower() in _FALSE_WORDS:
                return False
            raise ConfigError(name, f"expected true or false, got {value!r}")
        if base is int:
            try:
                return int(text, 10)
            except ValueError:
                raise ConfigError(name, f"expected an integer, got {value!r}") from None
        return value
    if value is None:
        if optional:
            return None
        raise ConfigError(name, f"expected {_describe(base)}, got null; omit it to use the default")
    if base is bool and not isinstance(value, bool):
        raise ConfigError(name, f"expected true or false, got {_show(value)}")
    if base is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(name, f"expected an integer, got {_show(value)}")
    if base is str and not isinstance(value, str):
        raise ConfigError(name, f"expected a string, got {_show(value)}")
    return value


def _describe(base: type) -> str:
    return {bool: "true or false", int: "an integer", str: "a string"}.get(base, base.__name__)


def _check_value(name: str, value: Any, metadata: Mapping[str, Any]) -> None:
    """Range, choice and custom checks of an already-typed value."""
    minimum, maximum = metadata.get("minimum"), metadata.get("maximum")
    if value is None:
        return
    if minimum is not None and value < minimum:
        raise ConfigError(name, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ConfigError(name, f"must be <= {maximum}, got {value}")
    choices = metadata.get("choices")
    if choices is not None and value not in choices:
        shown = ", ".join("null" if c is None else repr(c) for c in choices)
        raise ConfigError(name, f"must be one of {shown}, got {_show(value)}")
    check = metadata.get("check")
    if check is not None:
        check(name, value)


def _suggest(key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


class _Validated:
    """Mixin: a frozen dataclass whose fields are typed and range-checked on construction."""

    #: prefix of field names in messages, e.g. ``eplb_config``
    _PREFIX: typing.ClassVar[str] = ""

    @classmethod
    def _fields(cls) -> dict[str, dataclasses.Field]:
        return {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

    @classmethod
    def coerce_field(
        cls, key: str, value: Any, *, from_text: bool = False, prefix: str | None = None
    ) -> Any:
        """Type-coerce and validate one field; the error names ``<prefix>.<key>``.

        The caller has checked that ``key`` is a field of this class.
        """
        name = f"{cls._PREFIX if prefix is None else prefix}.{key}"
        hint = _type_hints(cls)[key]
        value = _coerce(name, value, hint, from_text=from_text)
        _check_value(name, value, cls._fields()[key].metadata)
        return value

    def _validate_all(self) -> None:
        for key in self._fields():
            self.coerce_field(key, getattr(self, key))


# -- V2 -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class EplbConfig(_Validated):
    """V2 EPLB settings: upstream vLLM's ``EPLBConfig`` fields plus ``load_collection_phase``.

    Construction checks types and ranges; :func:`resolve_eplb_config` adds the checks that need
    context (policy registry, ``num_experts``, ``ep_size``).
    """

    _PREFIX: typing.ClassVar[str] = _V2_PREFIX

    window_size: int = _option(1000, minimum=1, doc="steps of load the policy sees")
    step_interval: int = _option(3000, minimum=1, doc="steps between rearrangements")
    num_redundant_experts: int = _option(0, minimum=0, doc="extra physical slots")
    log_balancedness: bool = _option(False, doc="log the balancedness metric")
    log_balancedness_interval: int = _option(1, minimum=1, doc="log every n steps")
    use_async: bool = _option(True, doc="plan and move weights on a worker thread")
    policy: str = _option("default", doc="registered rebalance policy name")
    communicator: str | None = _option(
        None, choices=SUPPORTED_COMMUNICATORS, doc="weight-transfer backend"
    )
    load_collection_phase: str = _option(
        "all", choices=BATCH_PHASES, doc="batches whose load feeds the window"
    )

    #: Keys that are V2 but spelled under ``additional_config["eplb_config"]``, not --eplb-config.
    ADDITIONAL_ONLY: typing.ClassVar[frozenset[str]] = frozenset({"load_collection_phase"})

    def __post_init__(self) -> None:
        self._validate_all()
        if not self.policy:
            raise ConfigError(f"{_V2_PREFIX}.policy", "must be a non-empty policy name")

    @classmethod
    def eplb_config_keys(cls) -> list[str]:
        """Keys accepted by ``--eplb-config`` (upstream ``EPLBConfig`` field names)."""
        return [key for key in cls._fields() if key not in cls.ADDITIONAL_ONLY]

    @classmethod
    def check_key(cls, key: str, *, prefix: str = _V2_PREFIX) -> None:
        """Reject a key that ``--eplb-config`` does not accept, pointing to the right spelling."""
        name = f"{prefix}.{key}"
        if key in cls.eplb_config_keys():
            return
        if key in cls.ADDITIONAL_ONLY:
            raise ConfigError(
                name,
                f"{key} is not an EPLBConfig field; pass it as "
                f'--additional-config \'{{"eplb_config": {{"{key}": ...}}}}\'',
            )
        if key in LegacyEplbConfig.field_names():
            raise ConfigError(
                name, f"{key} is a legacy additional_config key; {_v2_equivalent(key)}"
            )
        raise ConfigError(
            name,
            f"unknown EPLBConfig field{_suggest(key, cls.eplb_config_keys())}; "
            f"accepted fields: {', '.join(cls.eplb_config_keys())}",
        )

    @classmethod
    def from_mapping(
        cls,
        mapping: Mapping[str, Any],
        *,
        from_text: bool = False,
        load_collection_phase: str = "all",
    ) -> EplbConfig:
        """Build from an ``--eplb-config`` mapping (keys are upstream EPLBConfig field names)."""
        values: dict[str, Any] = {}
        for key, value in mapping.items():
            cls.check_key(str(key))
            values[key] = cls.coerce_field(key, value, from_text=from_text)
        return cls(**values, load_collection_phase=load_collection_phase)

    @property
    def effective_window_size(self) -> int:
        """Steps of load a rearrangement can use: at most the steps since the previous one.

        Load is recorded in physical-slot space, so samples older than the last rearrangement
        describe a placement that no longer exists; the window is therefore capped at
        ``step_interval`` (upstream: "if step_interval is larger than the window, only the last
        window steps are used"; the converse cap is ours, see docs/configuration.md).
        """
        return min(self.window_size, self.step_interval)


# -- legacy -------------------------------------------------------------------------------------
def _check_json_path(name: str, value: str) -> None:
    if not value.strip():
        raise ConfigError(name, "must be a non-empty path to a .json file")
    if not value.endswith(".json"):
        raise ConfigError(name, f"must end in .json (expert maps are JSON), got {value!r}")


def _check_map_path(name: str, value: str) -> None:
    """The static map must exist and be readable now, not at the first MoE layer's init."""
    _check_json_path(name, value)
    path = Path(value)
    if not path.exists():
        raise ConfigError(name, f"{value!r} does not exist; record a map first or fix the path")
    if not path.is_file():
        raise ConfigError(name, f"{value!r} is not a regular file")
    if not os.access(path, os.R_OK):
        raise ConfigError(name, f"{value!r} is not readable; fix its permissions")


def _check_record_path(name: str, value: str) -> None:
    """The record target's directory must exist and be writable (we create no directories at
    configuration time: validation has no side effects)."""
    _check_json_path(name, value)
    path = Path(value)
    if path.is_dir():
        raise ConfigError(name, f"{value!r} is a directory; give a file path ending in .json")
    parent = path.parent
    if not parent.is_dir():
        raise ConfigError(name, f"directory {str(parent)!r} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(name, f"directory {str(parent)!r} is not writable")


def _check_policy_type(name: str, value: int) -> None:
    if value not in LEGACY_POLICY_TYPES:
        shown = ", ".join(f"{k} ({v})" for k, v in LEGACY_POLICY_TYPES.items())
        raise ConfigError(name, f"must be one of {shown}, got {value}")


@dataclass(frozen=True)
class LegacyEplbConfig(_Validated):
    """vllm-ascend Model Runner V1 EPLB keys, with vllm-ascend's rules plus range checks.

    Setting ``expert_map_record_path`` forces ``dynamic_eplb`` on (vllm-ascend's rule: a map can
    only be recorded while the dynamic cycle runs).
    """

    _PREFIX: typing.ClassVar[str] = _ADDITIONAL_EPLB

    dynamic_eplb: bool = _option(False, doc="run the collect/plan/move cycle")
    expert_heat_collection_interval: int = _option(600, minimum=1, doc="steps of load collection")
    algorithm_execution_interval: int = _option(50, minimum=1, doc="steps the policy may take")
    eplb_policy_type: int = _option(
        2, check=_check_policy_type, doc="0..3, see LEGACY_POLICY_TYPES"
    )
    num_redundant_experts: int = _option(0, minimum=0, doc="extra physical slots")
    eplb_heat_collection_stage: str = _option("all", choices=BATCH_PHASES, doc="iteration phase")
    expert_map_path: str | None = _option(None, check=_check_map_path, doc="static map to load")
    expert_map_record_path: str | None = _option(
        None, check=_check_record_path, doc="where to record maps"
    )

    def __post_init__(self) -> None:
        self._validate_all()
        if self.expert_map_record_path is not None and not self.dynamic_eplb:
            object.__setattr__(self, "dynamic_eplb", True)

    @classmethod
    def field_names(cls) -> list[str]:
        return list(cls._fields())

    @property
    def enabled(self) -> bool:
        return self.dynamic_eplb or self.expert_map_path is not None

    @property
    def mode(self) -> str:
        """``record`` | ``dynamic`` | ``static`` | ``off`` (vllm-ascend's three modes)."""
        if self.expert_map_record_path is not None:
            return "record"
        if self.dynamic_eplb:
            return "dynamic"
        return "static" if self.expert_map_path is not None else "off"

    @property
    def policy(self) -> str:
        return LEGACY_POLICY_TYPES[self.eplb_policy_type]


def _v2_equivalent(key: str) -> str:
    """Where a legacy key's intent lives in V2 (for mixing/misplacement messages)."""
    return {
        "dynamic_eplb": "V2 is switched on by --enable-eplb alone",
        "expert_heat_collection_interval": "the V2 setting is --eplb-config.window_size",
        "algorithm_execution_interval": (
            "the closest V2 setting is --eplb-config.step_interval (steps between rearrangements)"
        ),
        "eplb_policy_type": (
            "the V2 setting is --eplb-config.policy with a name "
            f"({', '.join(f'{k}={v}' for k, v in LEGACY_POLICY_TYPES.items())})"
        ),
        "num_redundant_experts": "the V2 setting is --eplb-config.num_redundant_experts",
        "eplb_heat_collection_stage": (
            'the V2 setting is --additional-config \'{"eplb_config": {"load_collection_phase": '
            "...}}' (it classifies whole batches, not iterations by token count)"
        ),
        "expert_map_path": "V2 has no static map; drop --enable-eplb to use the legacy path",
        "expert_map_record_path": (
            "V2 has no map recording; drop --enable-eplb to use the legacy path"
        ),
    }[key]


# -- resolution ---------------------------------------------------------------------------------
class EplbPath(str, Enum):
    """Which configuration world a run uses; exactly one, decided once."""

    DISABLED = "disabled"
    V2 = "v2"
    LEGACY = "legacy"


@dataclass(frozen=True)
class ResolvedEplbConfig:
    """The validated outcome of :func:`resolve_eplb_config`.

    Exactly one of ``v2`` / ``legacy`` is set for an enabled path and neither for ``disabled``,
    so code on one path cannot read the other's settings (invariant 8).

    Attributes:
        expert_map: the legacy ``expert_map_path`` map, loaded and validated against
            ``num_experts`` and ``ep_size`` (``None`` otherwise).
    """

    path: EplbPath
    num_experts: int
    ep_size: int
    v2: EplbConfig | None = None
    legacy: LegacyEplbConfig | None = None
    expert_map: Placement | None = None

    def __post_init__(self) -> None:
        expected = {
            EplbPath.DISABLED: (False, False),
            EplbPath.V2: (True, False),
            EplbPath.LEGACY: (False, True),
        }[self.path]
        if (self.v2 is not None, self.legacy is not None) != expected:
            raise ValueError(f"ResolvedEplbConfig({self.path.value}) must carry only its config")

    @property
    def enabled(self) -> bool:
        return self.path is not EplbPath.DISABLED

    @property
    def policy(self) -> str | None:
        if self.v2 is not None:
            return self.v2.policy
        return self.legacy.policy if self.legacy is not None else None

    @property
    def num_redundant_experts(self) -> int:
        if self.v2 is not None:
            return self.v2.num_redundant_experts
        return self.legacy.num_redundant_experts if self.legacy is not None else 0

    @property
    def num_physical_experts(self) -> int:
        return self.num_experts + self.num_redundant_experts


def known_policy_names(policy_names: Sequence[str] | None = None) -> tuple[str, ...]:
    """Policy names a config may use: ``policy_names`` if given, else the live registry.

    The registry module is imported lazily (it is optional at configuration time, and importing
    it here at module load would couple config parsing to every policy's dependencies). If it
    cannot be imported, or registers nothing yet, :data:`FALLBACK_POLICY_NAMES` is used.
    """
    if policy_names is not None:
        return tuple(policy_names)
    try:
        from eplb_graph.policy import policy_names as registered
    except ImportError:
        logger.debug("eplb_graph.policy not importable; using the fallback policy names")
        return FALLBACK_POLICY_NAMES
    names = tuple(registered())
    return names or FALLBACK_POLICY_NAMES


def check_policy_name(name: str, field: str, policy_names: Sequence[str] | None = None) -> None:
    """Raise :class:`ConfigError` unless ``name`` is a known policy."""
    known = known_policy_names(policy_names)
    if name not in known:
        raise ConfigError(
            field,
            f"unknown policy {name!r}{_suggest(name, known)}; choose one of: {', '.join(known)}",
        )


def _check_sizes(num_experts: Any, ep_size: Any) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ConfigError("num_experts", f"must be an integer >= 1, got {_show(num_experts)}")
    if isinstance(ep_size, bool) or not isinstance(ep_size, int):
        raise ConfigError("ep_size", f"must be an integer, got {_show(ep_size)}")
    if ep_size <= 1:
        raise ConfigError(
            "ep_size",
            f"EPLB needs expert parallelism: ep_size must be > 1, got {ep_size}; "
            "enable expert parallelism across > 1 ranks or disable EPLB",
        )


def _check_divisible(num_experts: int, num_redundant: int, ep_size: int, field: str) -> None:
    total = num_experts + num_redundant
    if total % ep_size == 0:
        return
    lower = num_redundant - total % ep_size
    higher = num_redundant + (-total) % ep_size
    options = " or ".join(str(v) for v in (lower, higher) if v >= 0)
    raise ConfigError(
        field,
        f"num_experts + num_redundant_experts = {num_experts} + {num_redundant} = {total} is not "
        f"divisible by ep_size={ep_size} (every EP rank holds the same number of slots); "
        f"set num_redundant_experts to {options}",
    )


def _env_flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in ("1", "true")


def _as_mapping(name: str, value: Any) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(name, f"expected a JSON object (mapping), got {_show(value)}")
    return value


def _split_additional(
    additional_config: Mapping[str, Any] | None,
) -> tuple[dict[str, tuple[str, Any]], str | None]:
    """Pick the EPLB keys out of ``additional_config``.

    Returns ``(legacy, phase)``: ``legacy`` maps each legacy key to ``(where it was spelled,
    value)``; ``phase`` is ``load_collection_phase`` if given. Unknown or misplaced keys under
    ``eplb_config`` are rejected by name. Top-level keys that are not legacy EPLB keys belong to
    other features and are left alone.
    """
    legacy: dict[str, tuple[str, Any]] = {}
    phase: Any = None
    if additional_config is None:
        return legacy, None
    nested = _as_mapping(_ADDITIONAL_EPLB, additional_config.get("eplb_config"))
    legacy_keys = LegacyEplbConfig.field_names()
    for key, value in (nested or {}).items():
        name = f"{_ADDITIONAL_EPLB}.{key}"
        if key in EplbConfig.ADDITIONAL_ONLY:
            phase = value
        elif key in legacy_keys:
            legacy[key] = (name, value)
        elif key in EplbConfig.eplb_config_keys():
            raise ConfigError(
                name,
                f"EPLBConfig fields are not accepted in additional_config; pass "
                f"--eplb-config.{key} (or inside --eplb-config JSON) with --enable-eplb. "
                "Only load_collection_phase belongs under additional_config.eplb_config in V2",
            )
        else:
            known = [*EplbConfig.ADDITIONAL_ONLY, *legacy_keys]
            raise ConfigError(
                name,
                f"unknown key{_suggest(str(key), known + EplbConfig.eplb_config_keys())}; "
                f"additional_config.eplb_config accepts load_collection_phase (V2, with "
                f"--enable-eplb) or the legacy keys {', '.join(legacy_keys)}",
            )
    for key in legacy_keys:
        if key in additional_config:
            name = f"{_ADDITIONAL}.{key}"
            if key in legacy:
                raise ConfigError(
                    name,
                    f"also given as {legacy[key][0]}; keep one "
                    "(additional_config.eplb_config is the current spelling)",
                )
            legacy[key] = (name, additional_config[key])
    if phase is not None:
        phase = EplbConfig.coerce_field(
            "load_collection_phase", phase, prefix=_ADDITIONAL_EPLB, from_text=False
        )
    return legacy, phase


def resolve_eplb_config(
    *,
    enable_eplb: bool,
    eplb_config: Mapping[str, Any] | None,
    additional_config: Mapping[str, Any] | None,
    num_experts: int,
    ep_size: int,
    policy_names: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> ResolvedEplbConfig:
    """Validate every EPLB setting and decide the path: ``disabled``, ``v2`` or ``legacy``.

    Args:
        enable_eplb: ``--enable-eplb`` (the V2 switch).
        eplb_config: ``--eplb-config`` as a mapping of upstream EPLBConfig field names.
        additional_config: the whole ``--additional-config`` mapping (other features' keys are
            ignored; ``eplb_config`` and top-level legacy EPLB keys are read).
        num_experts: logical experts N of the model.
        ep_size: expert-parallel ranks.
        policy_names: allowed policy names; default: the live registry (see
            :func:`known_policy_names`).
        environ: environment for the legacy switches ``DYNAMIC_EPLB`` / ``EXPERT_MAP_RECORD``;
            default ``os.environ``.

    Raises:
        ConfigError: the first invalid setting, naming its field and the fix.
    """
    if not isinstance(enable_eplb, bool):
        raise ConfigError("enable_eplb", f"expected true or false, got {_show(enable_eplb)}")
    v2_mapping = dict(_as_mapping(_V2_PREFIX, eplb_config) or {})
    additional = _as_mapping(_ADDITIONAL, additional_config)
    environ = os.environ if environ is None else environ
    legacy_values, phase = _split_additional(additional)

    v2_requested = enable_eplb or bool(v2_mapping)
    if v2_requested:
        v2_switch = "--enable-eplb" if enable_eplb else f"--eplb-config.{next(iter(v2_mapping))}"
        if legacy_values:
            key, (name, _value) = next(iter(legacy_values.items()))
            raise ConfigError(
                name,
                f"legacy (V1) EPLB key cannot be combined with {v2_switch} (V2); "
                f"{_v2_equivalent(key)}. Use one configuration world: V2 "
                "(--enable-eplb/--eplb-config) or legacy (additional_config keys)",
            )
        for flag in LEGACY_ENV_FLAGS:
            if _env_flag(environ, flag):
                raise ConfigError(
                    flag,
                    f"environment variable {flag} is a legacy (V1) EPLB control and cannot be "
                    f"combined with {v2_switch} (V2); unset it",
                )
        if not enable_eplb:
            raise ConfigError(
                f"{_V2_PREFIX}.{next(iter(v2_mapping))}",
                "is set but EPLB is disabled; add --enable-eplb or remove the --eplb-config "
                "settings",
            )
        return _resolve_v2(v2_mapping, phase, num_experts, ep_size, policy_names)

    if phase is not None and legacy_values:
        key, (name, _value) = next(iter(legacy_values.items()))
        raise ConfigError(
            f"{_ADDITIONAL_EPLB}.load_collection_phase",
            f"is a V2 setting and cannot be combined with the legacy key {name}; the legacy "
            "path uses eplb_heat_collection_stage (per-iteration token-count classification)",
        )
    if phase is not None and phase != "all":
        raise ConfigError(
            f"{_ADDITIONAL_EPLB}.load_collection_phase",
            f"{phase!r} requires --enable-eplb; add it or remove load_collection_phase",
        )
    if legacy_values:
        return _resolve_legacy(legacy_values, num_experts, ep_size, policy_names)
    return ResolvedEplbConfig(EplbPath.DISABLED, num_experts=num_experts, ep_size=ep_size)


def _resolve_v2(
    mapping: Mapping[str, Any],
    phase: str | None,
    num_experts: int,
    ep_size: int,
    policy_names: Sequence[str] | None,
) -> ResolvedEplbConfig:
    config = EplbConfig.from_mapping(mapping, load_collection_phase=phase or "all")
    check_policy_name(config.policy, f"{_V2_PREFIX}.policy", policy_names)
    _check_sizes(num_experts, ep_size)
    _check_divisible(
        num_experts, config.num_redundant_experts, ep_size, f"{_V2_PREFIX}.num_redundant_experts"
    )
    if config.window_size > config.step_interval:
        logger.warning(
            "eplb_config.window_size=%d exceeds step_interval=%d: each rearrangement uses only "
            "the %d steps recorded since the previous one (older load describes a placement "
            "that no longer exists); set window_size <= step_interval to silence this",
            config.window_size,
            config.step_interval,
            config.effective_window_size,
        )
    return ResolvedEplbConfig(EplbPath.V2, num_experts=num_experts, ep_size=ep_size, v2=config)


def _resolve_legacy(
    values: Mapping[str, tuple[str, Any]],
    num_experts: int,
    ep_size: int,
    policy_names: Sequence[str] | None,
) -> ResolvedEplbConfig:
    typed = {
        key: LegacyEplbConfig.coerce_field(key, value, prefix=name.rsplit(".", 1)[0])
        for key, (name, value) in values.items()
    }
    config = LegacyEplbConfig(**typed)
    if not config.enabled:
        if set(typed) - {"dynamic_eplb"}:
            key = next(k for k in typed if k != "dynamic_eplb")
            raise ConfigError(
                values[key][0],
                "is set but legacy EPLB is off; set dynamic_eplb: true (or expert_map_path / "
                "expert_map_record_path) to enable it, or remove the legacy keys",
            )
        return ResolvedEplbConfig(EplbPath.DISABLED, num_experts=num_experts, ep_size=ep_size)
    if typed.get("dynamic_eplb") is False and config.expert_map_record_path is not None:
        logger.warning(
            "%s is set, which forces dynamic_eplb on (recording needs the dynamic cycle)",
            values["expert_map_record_path"][0],
        )
    policy_field = values.get("eplb_policy_type", (f"{_ADDITIONAL_EPLB}.eplb_policy_type",))[0]
    if config.policy not in known_policy_names(policy_names):
        raise ConfigError(
            policy_field,
            f"eplb_policy_type {config.eplb_policy_type} selects policy {config.policy!r}, "
            f"which is not registered (known: {', '.join(known_policy_names(policy_names))}); "
            "choose another type",
        )
    _check_sizes(num_experts, ep_size)
    redundant_field = values.get(
        "num_redundant_experts", (f"{_ADDITIONAL_EPLB}.num_redundant_experts",)
    )[0]
    expert_map = None
    if config.expert_map_path is not None:
        expert_map = _load_legacy_map(values["expert_map_path"][0], config, num_experts, ep_size)
        redundancy = expert_map.num_redundant
        if "num_redundant_experts" in typed and typed["num_redundant_experts"] != redundancy:
            raise ConfigError(
                redundant_field,
                f"conflicting redundant expert counts: {typed['num_redundant_experts']} here but "
                f"the map {values['expert_map_path'][0]} has {redundancy} "
                f"({expert_map.num_slots} slots - {num_experts} experts); remove "
                "num_redundant_experts or make them agree",
            )
        config = dataclasses.replace(config, num_redundant_experts=redundancy)
    _check_divisible(num_experts, config.num_redundant_experts, ep_size, redundant_field)
    return ResolvedEplbConfig(
        EplbPath.LEGACY,
        num_experts=num_experts,
        ep_size=ep_size,
        legacy=config,
        expert_map=expert_map,
    )


def _load_legacy_map(
    field: str, config: LegacyEplbConfig, num_experts: int, ep_size: int
) -> Placement:
    """Load and fully validate the static map now, so a bad map fails at initialization."""
    from eplb_graph.expert_map import ExpertMapError, load_expert_map

    path = config.expert_map_path
    assert path is not None
    try:
        placement = load_expert_map(path, num_logical=num_experts)
    except ExpertMapError as error:
        raise ConfigError(field, f"invalid expert map: {error}") from error
    except OSError as error:
        raise ConfigError(field, f"cannot read {path!r}: {error.strerror or error}") from error
    if placement.num_ranks != ep_size:
        raise ConfigError(
            field,
            f"the map {path!r} places experts on {placement.num_ranks} devices but ep_size="
            f"{ep_size}; use a map recorded with the same EP size",
        )
    return placement


# -- command line -------------------------------------------------------------------------------
@dataclass(frozen=True)
class EplbCliArgs:
    """The EPLB part of a command line, parsed and typed; ``rest`` holds every other argument."""

    enable_eplb: bool = False
    eplb_config: dict[str, Any] | None = None
    additional_config: dict[str, Any] | None = None
    rest: tuple[str, ...] = ()

    def resolve(
        self,
        *,
        num_experts: int,
        ep_size: int,
        policy_names: Sequence[str] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ResolvedEplbConfig:
        """:func:`resolve_eplb_config` on these arguments."""
        return resolve_eplb_config(
            enable_eplb=self.enable_eplb,
            eplb_config=self.eplb_config,
            additional_config=self.additional_config,
            num_experts=num_experts,
            ep_size=ep_size,
            policy_names=policy_names,
            environ=environ,
        )


def _load_json_object(name: str, option: str, text: str, example: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(
            name,
            f"{option} is not valid JSON (line {error.lineno}, column {error.colno}: "
            f"{error.msg}); pass a JSON object such as {example}",
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(name, f"{option} must be a JSON object such as {example}, got {text!r}")
    return value


def parse_cli_args(argv: Sequence[str]) -> EplbCliArgs:
    """Parse the EPLB options of a serve command line.

    Understands ``--enable-eplb``, ``--eplb-config.<field> VALUE`` / ``--eplb-config.<field>=VALUE``
    (text coerced by the field's type), ``--eplb-config '<json object>'`` and
    ``--additional-config '<json object>'``. Option names may use ``_`` for ``-`` and field names
    ``-`` for ``_`` (as vLLM's parser allows). A field given twice (in any spelling) is an error
    rather than "last wins", because the two spellings usually come from different layers of a
    launch script and silently dropping one is exactly what invariant 7 forbids.

    Raises:
        ConfigError: naming the field (``eplb_config.window_size``) on any bad value.
    """
    enable = False
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
            enable = _coerce("enable_eplb", inline, bool, from_text=True) if has_inline else True
            continue
        if has_inline:
            value = inline
        elif index < len(argv) and not argv[index].startswith("--"):
            value = argv[index]
            index += 1
        else:
            field_name = f"{_V2_PREFIX}.{key}" if dotted else option.replace("-", "_")
            raise ConfigError(field_name, f"--{head} needs a value")
        if option == "additional-config":
            if dotted:
                raise ConfigError(
                    f"{_ADDITIONAL}.{key}",
                    "pass --additional-config as one JSON object, e.g. "
                    '\'{"eplb_config": {"load_collection_phase": "prefill"}}\'',
                )
            if additional is not None:
                raise ConfigError(_ADDITIONAL, "--additional-config given twice; merge them")
            additional = _load_json_object(
                _ADDITIONAL, "--additional-config", value, "'{\"eplb_config\": {...}}'"
            )
            continue
        if dotted:
            items = [(key.replace("-", "_"), value, f"--eplb-config.{key}", True)]
        else:
            parsed = _load_json_object(
                _V2_PREFIX, "--eplb-config", value, "'{\"window_size\": 100}'"
            )
            items = [(str(k), v, "--eplb-config JSON", False) for k, v in parsed.items()]
        for field_key, raw, source, from_text in items:
            EplbConfig.check_key(field_key)
            if field_key in v2:
                raise ConfigError(
                    f"{_V2_PREFIX}.{field_key}",
                    f"given twice ({v2_source[field_key]} and {source}); give it once",
                )
            v2[field_key] = EplbConfig.coerce_field(field_key, raw, from_text=from_text)
            v2_source[field_key] = source
    return EplbCliArgs(
        enable_eplb=enable,
        eplb_config=v2 or None,
        additional_config=additional,
        rest=tuple(rest),
    )
