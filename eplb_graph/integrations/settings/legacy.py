"""vllm-ascend's Model Runner V1 EPLB keys (the legacy world), typed and checked.

The keys live under ``additional_config["eplb_config"]`` (current spelling) or at the top level of
``additional_config`` (older spelling); :mod:`.resolve` finds them there. This module owns what
each key means: its type and range, the policy each ``eplb_policy_type`` number selects, and
where a legacy key's intent lives in the V2 world (for the messages that reject mixing).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass

from eplb_graph.control.phases import CollectionPhase
from eplb_graph.integrations.settings.fields import (
    ADDITIONAL_EPLB,
    MAX_EXPERTS,
    MAX_STEPS,
    MAX_WINDOW_STEPS,
    ConfigError,
    Validated,
    enum_values,
    option,
    show_integer,
)
from eplb_graph.integrations.settings.paths import check_map_path, check_record_path

#: vllm-ascend ``eplb_policy_type`` -> registered policy name (vllm-ascend's PolicyFactory order).
#: Type 0 (vllm-ascend's RandomLoadBalance) is deliberately absent: random placement exists only
#: to exercise movement in tests, and a serving setting must not be able to select it.
LEGACY_POLICY_TYPES: dict[int, str] = {1: "default", 2: "swift_balance", 3: "flash_lb"}
_RANDOM_POLICY_TYPE = 0


def _accepted_policy_types() -> str:
    return ", ".join(f"{number} ({name})" for number, name in LEGACY_POLICY_TYPES.items())


def _check_policy_type(name: str, value: int) -> None:
    if value == _RANDOM_POLICY_TYPE:
        raise ConfigError(
            name,
            "type 0 selects random placement, a test policy not offered for serving; "
            f"accepted types: {_accepted_policy_types()}",
        )
    if value not in LEGACY_POLICY_TYPES:
        raise ConfigError(
            name, f"must be one of {_accepted_policy_types()}, got {show_integer(value)}"
        )


@dataclass(frozen=True)
class LegacyEplbConfig(Validated):
    """vllm-ascend Model Runner V1 EPLB keys, with vllm-ascend's rules plus range checks.

    Setting ``expert_map_record_path`` forces ``dynamic_eplb`` on (vllm-ascend's rule: a map can
    only be recorded while the dynamic cycle runs).
    """

    _PREFIX: typing.ClassVar[str] = ADDITIONAL_EPLB

    dynamic_eplb: bool = option(False, doc="run the collect/plan/move cycle")
    expert_heat_collection_interval: int = option(
        600, minimum=1, maximum=MAX_WINDOW_STEPS, doc="steps of load collection (the window)"
    )
    algorithm_execution_interval: int = option(
        50,
        minimum=1,
        maximum=MAX_STEPS - MAX_WINDOW_STEPS,
        doc="steps the policy may take (plus the collection: the rearrangement interval)",
    )
    eplb_policy_type: int = option(2, check=_check_policy_type, doc="see LEGACY_POLICY_TYPES")
    num_redundant_experts: int = option(
        0, minimum=0, maximum=MAX_EXPERTS, doc="extra physical slots"
    )
    eplb_heat_collection_stage: str = option(
        CollectionPhase.ALL.value, choices=enum_values(CollectionPhase), doc="iteration phase"
    )
    expert_map_path: str | None = option(None, check=check_map_path, doc="static map to load")
    expert_map_record_path: str | None = option(
        None, check=check_record_path, doc="where to record maps"
    )

    def __post_init__(self) -> None:
        self._validate_all()
        if self.expert_map_record_path is not None and not self.dynamic_eplb:
            object.__setattr__(self, "dynamic_eplb", True)

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


def v2_equivalent(key: str) -> str:
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
