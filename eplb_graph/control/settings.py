"""``ControlSettings``: what the per-step state machine and the planner need, as plain values.

The library core takes this object, never a host engine's configuration: the integration layer
(``eplb_graph.integrations``) validates the host's settings and builds one of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from eplb_graph.control.phases import CollectionPhase


@dataclass(frozen=True)
class ControlSettings:
    """What the state machine needs from the validated configuration."""

    window_size: int = 1000
    step_interval: int = 3000
    load_collection_phase: CollectionPhase = CollectionPhase.ALL
    policy: str = "default"
    policy_options: dict = field(default_factory=dict)
    num_groups: int = 1
    num_nodes: int = 1
    log_balancedness: bool = False
    log_balancedness_interval: int = 1
    time_samples: int = 8

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "load_collection_phase", CollectionPhase.parse(self.load_collection_phase)
        )
        for name in ("window_size", "step_interval", "log_balancedness_interval", "time_samples"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def effective_window_size(self) -> int:
        """Load older than the previous rearrangement cannot inform the next one."""
        return min(self.window_size, self.step_interval)

    @classmethod
    def from_legacy(cls, config, *, num_groups: int = 1, num_nodes: int = 1, **extra):
        """Settings from a validated :class:`eplb_graph.config.LegacyEplbConfig` (V1 keys).

        vllm-ascend's cycle collects heat for ``expert_heat_collection_interval`` steps, then
        gives the policy ``algorithm_execution_interval`` steps; here that is a window of the
        collection length closing every collection + algorithm steps, with the same policy
        (``eplb_policy_type``) and phase filter (``eplb_heat_collection_stage``). The layer-by-
        layer swap phase is the movement worker's (``MovementSettings.layers_per_step``).
        """
        if not config.dynamic_eplb:
            raise ValueError(
                f"legacy EPLB mode is {config.mode!r}: only dynamic (or record) mode rebalances; "
                "a static expert map is loaded with Placement.load_expert_map"
            )
        collect = config.expert_heat_collection_interval
        return cls(
            window_size=collect,
            step_interval=collect + config.algorithm_execution_interval,
            load_collection_phase=config.eplb_heat_collection_stage,
            policy=config.policy,
            num_groups=num_groups,
            num_nodes=num_nodes,
            **extra,
        )

    @classmethod
    def from_config(cls, config, *, num_groups: int = 1, num_nodes: int = 1, **extra):
        """Settings from a validated :class:`eplb_graph.config.EplbConfig` (V2 path)."""
        return cls(
            window_size=config.effective_window_size,
            step_interval=config.step_interval,
            load_collection_phase=config.load_collection_phase,
            policy=config.policy,
            num_groups=num_groups,
            num_nodes=num_nodes,
            log_balancedness=config.log_balancedness,
            log_balancedness_interval=config.log_balancedness_interval,
            **extra,
        )
