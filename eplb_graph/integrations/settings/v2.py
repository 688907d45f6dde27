"""vLLM's V2 EPLB settings: ``--enable-eplb`` plus the ``--eplb-config`` fields.

:class:`EplbConfig` mirrors upstream vLLM's ``EPLBConfig`` field names and defaults, so a plugin
can copy ``ParallelConfig.eplb_config`` into it field by field, plus ``load_collection_phase``,
which is spelled under ``additional_config["eplb_config"]`` as in vllm-ascend.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from eplb_graph.control.phases import CollectionPhase
from eplb_graph.integrations.settings.fields import (
    MAX_EXPERTS,
    MAX_STEPS,
    MAX_WINDOW_STEPS,
    V2_PREFIX,
    ConfigError,
    Validated,
    enum_values,
    option,
    suggest,
)
from eplb_graph.integrations.settings.legacy import LegacyEplbConfig, v2_equivalent
from eplb_graph.settings import GLOO_COMMUNICATOR

#: Accepted ``communicator`` values; ``None`` means "pick it automatically" (which picks gloo).
SUPPORTED_COMMUNICATORS: tuple[str | None, ...] = (None, GLOO_COMMUNICATOR)


@dataclass(frozen=True)
class EplbConfig(Validated):
    """V2 EPLB settings: upstream vLLM's ``EPLBConfig`` fields plus ``load_collection_phase``.

    Construction checks types and ranges; :func:`~.resolve.resolve_eplb_config` adds the checks
    that need context (policy registry, ``num_experts``, ``ep_size``).
    """

    _PREFIX: typing.ClassVar[str] = V2_PREFIX

    window_size: int = option(
        1000, minimum=1, maximum=MAX_WINDOW_STEPS, doc="steps of load the policy sees"
    )
    step_interval: int = option(
        3000, minimum=1, maximum=MAX_STEPS, doc="steps between rearrangements"
    )
    num_redundant_experts: int = option(
        0, minimum=0, maximum=MAX_EXPERTS, doc="extra physical slots"
    )
    log_balancedness: bool = option(False, doc="log the balancedness metric")
    log_balancedness_interval: int = option(
        1, minimum=1, maximum=MAX_STEPS, doc="log every n steps"
    )
    use_async: bool = option(True, doc="plan and move weights on a worker thread")
    policy: str = option("default", doc="registered rebalance policy name")
    communicator: str | None = option(
        None, choices=SUPPORTED_COMMUNICATORS, doc="weight-transfer backend"
    )
    load_collection_phase: str = option(
        CollectionPhase.ALL.value,
        choices=enum_values(CollectionPhase),
        doc="batches whose load feeds the window",
    )

    #: Keys that are V2 but spelled under ``additional_config["eplb_config"]``, not --eplb-config.
    ADDITIONAL_ONLY: typing.ClassVar[frozenset[str]] = frozenset({"load_collection_phase"})

    def __post_init__(self) -> None:
        self._validate_all()
        if not self.policy:
            raise ConfigError(f"{V2_PREFIX}.policy", "must be a non-empty policy name")

    @classmethod
    def eplb_config_keys(cls) -> list[str]:
        """Keys accepted by ``--eplb-config`` (upstream ``EPLBConfig`` field names)."""
        return [key for key in cls._fields() if key not in cls.ADDITIONAL_ONLY]

    @classmethod
    def check_key(cls, key: str, *, prefix: str = V2_PREFIX) -> None:
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
                name, f"{key} is a legacy additional_config key; {v2_equivalent(key)}"
            )
        raise ConfigError(
            name,
            f"unknown EPLBConfig field{suggest(key, cls.eplb_config_keys())}; "
            f"accepted fields: {', '.join(cls.eplb_config_keys())}",
        )

    @classmethod
    def from_mapping(
        cls,
        mapping: Mapping[str, Any],
        *,
        from_text: bool = False,
        load_collection_phase: str = CollectionPhase.ALL.value,
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
