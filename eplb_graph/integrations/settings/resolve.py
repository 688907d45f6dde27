"""Which configuration world a run uses, decided once, with every setting validated.

Two configuration worlds exist, and they must not leak into each other (invariant 8):

- **V2** (upstream vLLM ``EPLBConfig``): ``--enable-eplb`` plus ``--eplb-config.<field>`` (or
  ``--eplb-config '<json>'``); the only V2 key under ``additional_config["eplb_config"]`` is
  ``load_collection_phase``.
- **Legacy** (vllm-ascend Model Runner V1 keys): ``dynamic_eplb``, ``expert_map_path``, ... under
  ``additional_config["eplb_config"]`` (current spelling) or at the top level of
  ``additional_config`` (older spelling).

:func:`resolve_eplb_config` takes the values as a host engine holds them (``enable_eplb``, the
``eplb_config`` fields as a mapping, the whole ``additional_config`` dict), checks all of them at
initialization, before any device state exists (invariant 7), and returns the core's
:class:`~eplb_graph.settings.RuntimeSettings` built from exactly one of the two worlds (``None``
when EPLB is off): nothing of the other world's settings reaches the runtime.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from eplb_graph.control.phases import CollectionPhase
from eplb_graph.integrations.settings.fields import (
    ADDITIONAL,
    ADDITIONAL_EPLB,
    MAX_EXPERTS,
    V2_PREFIX,
    ConfigError,
    show_integer,
    show_value,
    suggest,
)
from eplb_graph.integrations.settings.legacy import LegacyEplbConfig, v2_equivalent
from eplb_graph.integrations.settings.runtime_settings import settings_from_legacy, settings_from_v2
from eplb_graph.integrations.settings.v2 import EplbConfig
from eplb_graph.placement import Placement
from eplb_graph.policy import policy_names as registered_policy_names
from eplb_graph.settings import RuntimeSettings

logger = logging.getLogger(__name__)

#: vllm-ascend's Model Runner V1 environment switches; they must not be set with V2.
LEGACY_ENV_FLAGS: tuple[str, ...] = ("DYNAMIC_EPLB", "EXPERT_MAP_RECORD")


def known_policy_names(policy_names: Sequence[str] | None = None) -> tuple[str, ...]:
    """Policy names a config may use: ``policy_names`` if given, else the live registry.

    The registry is read at call time, so a policy registered after import is accepted too.
    """
    return tuple(registered_policy_names() if policy_names is None else policy_names)


def check_policy_name(name: str, field: str, policy_names: Sequence[str] | None = None) -> None:
    """Raise :class:`ConfigError` unless ``name`` is a known policy."""
    known = known_policy_names(policy_names)
    if name not in known:
        raise ConfigError(
            field,
            f"unknown policy {name!r}{suggest(name, known)}; choose one of: {', '.join(known)}",
        )


def _check_sizes(num_experts: Any, ep_size: Any) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ConfigError("num_experts", f"must be an integer >= 1, got {show_value(num_experts)}")
    if num_experts > MAX_EXPERTS:
        raise ConfigError(
            "num_experts", f"must be <= {MAX_EXPERTS}, got {show_integer(num_experts)}"
        )
    if isinstance(ep_size, bool) or not isinstance(ep_size, int):
        raise ConfigError("ep_size", f"must be an integer, got {show_value(ep_size)}")
    if ep_size <= 1:
        raise ConfigError(
            "ep_size",
            f"EPLB needs expert parallelism: ep_size must be > 1, got {show_integer(ep_size)}; "
            "enable expert parallelism across > 1 ranks or disable EPLB",
        )
    if ep_size > MAX_EXPERTS:
        raise ConfigError("ep_size", f"must be <= {MAX_EXPERTS}, got {show_integer(ep_size)}")


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
        raise ConfigError(name, f"expected a JSON object (mapping), got {show_value(value)}")
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
    nested = _as_mapping(ADDITIONAL_EPLB, additional_config.get("eplb_config"))
    legacy_keys = LegacyEplbConfig.field_names()
    for key, value in (nested or {}).items():
        name = f"{ADDITIONAL_EPLB}.{key}"
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
                f"unknown key{suggest(str(key), known + EplbConfig.eplb_config_keys())}; "
                f"additional_config.eplb_config accepts load_collection_phase (V2, with "
                f"--enable-eplb) or the legacy keys {', '.join(legacy_keys)}",
            )
    for key in legacy_keys:
        if key in additional_config:
            name = f"{ADDITIONAL}.{key}"
            if key in legacy:
                raise ConfigError(
                    name,
                    f"also given as {legacy[key][0]}; keep one "
                    "(additional_config.eplb_config is the current spelling)",
                )
            legacy[key] = (name, additional_config[key])
    if phase is not None:
        phase = EplbConfig.coerce_field(
            "load_collection_phase", phase, prefix=ADDITIONAL_EPLB, from_text=False
        )
    return legacy, phase


def resolve_eplb_config(
    *,
    enable_eplb: bool,
    eplb_config: Mapping[str, Any] | None,
    additional_config: Mapping[str, Any] | None,
    num_experts: int,
    ep_size: int,
    num_layers: int | None = None,
    num_groups: int = 1,
    num_nodes: int = 1,
    policy_names: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    **control: Any,
) -> RuntimeSettings | None:
    """Validate every EPLB setting, decide the world (V2 or legacy) and return the core's
    settings; ``None`` when EPLB is off.

    Args:
        enable_eplb: ``--enable-eplb`` (the V2 switch; vLLM's ``ParallelConfig.enable_eplb``).
        eplb_config: ``--eplb-config`` as a mapping of upstream EPLBConfig field names. Pass
            only the fields the user set (upstream's defaults are :class:`EplbConfig`'s): any
            field here without ``enable_eplb`` is rejected as "set but disabled".
        additional_config: the whole ``--additional-config`` mapping (other features' keys are
            ignored; ``eplb_config`` and top-level legacy EPLB keys are read).
        num_experts: logical experts N of the model.
        ep_size: expert-parallel ranks.
        num_layers: the model's MoE layers (the default placement's rows; a legacy map must
            have exactly as many); ``None`` where the model is not loaded yet (then
            ``initial_placement`` is the legacy map, or ``None``).
        num_groups, num_nodes: the model's expert groups and the cluster's nodes (for the
            hierarchical ``default`` policy).
        policy_names: allowed policy names; default: the live registry (see
            :func:`known_policy_names`).
        environ: environment for the legacy switches ``DYNAMIC_EPLB`` / ``EXPERT_MAP_RECORD``;
            default ``os.environ``.
        control: more control settings (``policy_options=``, ``time_samples=``).

    Raises:
        ConfigError: the first invalid setting, naming its field and the fix.
    """
    if not isinstance(enable_eplb, bool):
        raise ConfigError("enable_eplb", f"expected true or false, got {show_value(enable_eplb)}")
    v2_mapping = dict(_as_mapping(V2_PREFIX, eplb_config) or {})
    additional = _as_mapping(ADDITIONAL, additional_config)
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
                f"{v2_equivalent(key)}. Use one configuration world: V2 "
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
                f"{V2_PREFIX}.{next(iter(v2_mapping))}",
                "is set but EPLB is disabled; add --enable-eplb or remove the --eplb-config "
                "settings",
            )
        config = _resolve_v2(v2_mapping, phase, num_experts, ep_size, policy_names)
        return settings_from_v2(
            config,
            num_experts=num_experts,
            ep_size=ep_size,
            num_layers=num_layers,
            num_groups=num_groups,
            num_nodes=num_nodes,
            **control,
        )

    if phase is not None and legacy_values:
        key, (name, _value) = next(iter(legacy_values.items()))
        raise ConfigError(
            f"{ADDITIONAL_EPLB}.load_collection_phase",
            f"is a V2 setting and cannot be combined with the legacy key {name}; the legacy "
            "path uses eplb_heat_collection_stage (per-iteration token-count classification)",
        )
    if phase is not None and phase != CollectionPhase.ALL.value:
        raise ConfigError(
            f"{ADDITIONAL_EPLB}.load_collection_phase",
            f"{phase!r} requires --enable-eplb; add it or remove load_collection_phase",
        )
    resolved = _resolve_legacy(legacy_values, num_experts, ep_size, policy_names)
    if resolved is None:
        return None
    config, expert_map = resolved
    return settings_from_legacy(
        config,
        expert_map,
        num_experts=num_experts,
        ep_size=ep_size,
        num_layers=num_layers,
        num_groups=num_groups,
        num_nodes=num_nodes,
        **control,
    )


def _resolve_v2(
    mapping: Mapping[str, Any],
    phase: str | None,
    num_experts: int,
    ep_size: int,
    policy_names: Sequence[str] | None,
) -> EplbConfig:
    config = EplbConfig.from_mapping(
        mapping, load_collection_phase=phase or CollectionPhase.ALL.value
    )
    check_policy_name(config.policy, f"{V2_PREFIX}.policy", policy_names)
    _check_sizes(num_experts, ep_size)
    _check_divisible(
        num_experts, config.num_redundant_experts, ep_size, f"{V2_PREFIX}.num_redundant_experts"
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
    return config


def _resolve_legacy(
    values: Mapping[str, tuple[str, Any]],
    num_experts: int,
    ep_size: int,
    policy_names: Sequence[str] | None,
) -> tuple[LegacyEplbConfig, Placement | None] | None:
    """The legacy keys, typed and checked, and the static map they name; ``None`` when they
    leave legacy EPLB off (no keys, or ``dynamic_eplb: false`` alone)."""
    if not values:
        return None
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
        return None
    if typed.get("dynamic_eplb") is False and config.expert_map_record_path is not None:
        logger.warning(
            "%s is set, which forces dynamic_eplb on (recording needs the dynamic cycle)",
            values["expert_map_record_path"][0],
        )
    policy_field = values.get("eplb_policy_type", (f"{ADDITIONAL_EPLB}.eplb_policy_type",))[0]
    if config.policy not in known_policy_names(policy_names):
        raise ConfigError(
            policy_field,
            f"eplb_policy_type {config.eplb_policy_type} selects policy {config.policy!r}, "
            f"which is not registered (known: {', '.join(known_policy_names(policy_names))}); "
            "choose another type",
        )
    _check_sizes(num_experts, ep_size)
    redundant_field = values.get(
        "num_redundant_experts", (f"{ADDITIONAL_EPLB}.num_redundant_experts",)
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
    return config, expert_map


def _load_legacy_map(
    field: str, config: LegacyEplbConfig, num_experts: int, ep_size: int
) -> Placement:
    """Load and fully validate the static map now, so a bad map fails at initialization."""
    from eplb_graph.expert_map import ExpertMapError

    path = config.expert_map_path
    assert path is not None
    try:
        placement = Placement.load_expert_map(path, num_logical=num_experts)
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
