"""The plain settings the core runtime takes, built from a validated host configuration.

The core (``EplbRuntime``, ``EplbState``, ``ControlSettings``) knows nothing of vLLM's or
vllm-ascend's option names; this module is the one place that maps them. Every host goes
through it: :func:`~.resolve.resolve_eplb_config` validates what the host holds (a launcher's
command line through ``parse_cli_args``, vllm-ascend's V1 keys, vLLM's ``EPLBConfig``) and
returns a :class:`RuntimeSettings` built here; the vLLM plugin then adds what only its own
section sets. Every validated field lands in :class:`RuntimeSettings`, so a setting a user gave
is either acted on or rejected at initialization, never validated and then dropped.

A runner does, once per rank::

    settings = resolve_eplb_config(..., num_layers=L)    # None: EPLB is off
    if settings is not None:
        state = EplbState(settings.initial_placement, rank=rank, device=device)
        if settings.rebalances:                          # False: legacy static map
            runtime = EplbRuntime(state, views, settings.control, groups, rank,
                                  use_async=settings.use_async, movement=settings.movement,
                                  record_map_path=settings.record_map_path)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eplb_graph.control.settings import ControlSettings
from eplb_graph.integrations.settings.fields import ConfigError
from eplb_graph.integrations.settings.legacy import LegacyEplbConfig
from eplb_graph.integrations.settings.v2 import GLOO_COMMUNICATOR, EplbConfig
from eplb_graph.movement.settings import MovementSettings
from eplb_graph.placement import Placement


@dataclass(frozen=True)
class RuntimeSettings:
    """Everything one rank's EPLB needs from the configuration, in the core's vocabulary.

    Attributes:
        num_experts: logical experts N of the model.
        ep_size: expert-parallel ranks.
        num_redundant_experts: redundant slots over the logical experts.
        control: the window, interval, phase filter, policy and balancedness log for
            ``EplbRuntime``; ``None`` in legacy static mode, where the map is served as loaded
            and no runtime is built.
        use_async: ``EplbRuntime(use_async=...)``: plan and move on the worker thread.
        record_map_path: ``EplbRuntime(record_map_path=...)``: record mode writes every
            agreed plan to this expert-map file and applies none; ``None`` otherwise.
        initial_placement: the placement to build ``EplbState`` from: the legacy
            ``expert_map_path`` map when one is given, else the default placement of
            ``num_experts + num_redundant_experts`` slots over ``ep_size`` ranks. ``None`` only
            where the model's layer count is not known yet (vLLM checks the settings where it
            builds its config, before any model is loaded).
        communicator: the weight-transfer backend the runner's group provider must use;
            ``"torch_gloo"``, the only one eplb-graph implements (V2's ``null`` picks it).
        movement: ``EplbRuntime(movement=...)``: how weights are staged and committed.
        move_to: start from this placement: the weights, loaded in ``initial_placement``, are
            moved there before serving (the vLLM plugin's ``expert_map_path``).
        metrics_path: directory of the per-rank metrics files (``None``: none written).
        weight_digests: hash every local slot's kernel tensors at attach and after each commit.
    """

    num_experts: int
    ep_size: int
    num_redundant_experts: int
    control: ControlSettings | None
    use_async: bool = True
    record_map_path: str | None = None
    initial_placement: Placement | None = None
    communicator: str = GLOO_COMMUNICATOR
    movement: MovementSettings = field(default_factory=MovementSettings)
    move_to: Placement | None = None
    metrics_path: str | None = None
    weight_digests: bool = False

    @property
    def rebalances(self) -> bool:
        """Whether an ``EplbRuntime`` runs at all (false only for a legacy static map)."""
        return self.control is not None

    @property
    def num_physical_experts(self) -> int:
        """Physical slots P over all ranks."""
        return self.num_experts + self.num_redundant_experts


def control_settings_from_v2(
    config: EplbConfig, *, num_groups: int = 1, num_nodes: int = 1, **extra: Any
) -> ControlSettings:
    """Control settings from a validated V2 :class:`EplbConfig`.

    The window is ``config.effective_window_size``: load older than the previous rearrangement
    describes a placement that no longer exists. ``num_groups`` / ``num_nodes`` are the model's
    expert groups and the cluster's nodes (for the hierarchical ``default`` policy); ``extra``
    takes ``policy_options=`` and ``time_samples=``.
    """
    return ControlSettings(
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


def control_settings_from_legacy(
    config: LegacyEplbConfig, *, num_groups: int = 1, num_nodes: int = 1, **extra: Any
) -> ControlSettings:
    """Control settings from a validated :class:`LegacyEplbConfig` (vllm-ascend V1 keys).

    vllm-ascend's cycle collects heat for ``expert_heat_collection_interval`` steps, then gives
    the policy ``algorithm_execution_interval`` steps; here that is a window of the collection
    length closing every collection + algorithm steps, with the same policy
    (``eplb_policy_type``) and phase filter (``eplb_heat_collection_stage``). The layer-by-layer
    swap phase is the movement worker's (``MovementSettings.layers_per_step``).

    Raises:
        ValueError: the config does not rebalance (static map or off).
    """
    if not config.dynamic_eplb:
        raise ValueError(
            f"legacy EPLB mode is {config.mode!r}: only dynamic (or record) mode rebalances; "
            "a static expert map is loaded with Placement.load_expert_map"
        )
    collect = config.expert_heat_collection_interval
    return ControlSettings(
        window_size=collect,
        step_interval=collect + config.algorithm_execution_interval,
        load_collection_phase=config.eplb_heat_collection_stage,
        policy=config.policy,
        num_groups=num_groups,
        num_nodes=num_nodes,
        **extra,
    )


def settings_from_v2(
    config: EplbConfig,
    *,
    num_experts: int,
    ep_size: int,
    num_layers: int | None,
    **control: Any,
) -> RuntimeSettings:
    """:class:`RuntimeSettings` of a validated V2 config (``control``: see
    :func:`control_settings_from_v2`)."""
    return RuntimeSettings(
        num_experts=num_experts,
        ep_size=ep_size,
        num_redundant_experts=config.num_redundant_experts,
        control=control_settings_from_v2(config, **control),
        use_async=config.use_async,
        initial_placement=initial_placement(
            None, num_experts, config.num_redundant_experts, ep_size, num_layers
        ),
        communicator=config.communicator or GLOO_COMMUNICATOR,
    )


def settings_from_legacy(
    config: LegacyEplbConfig,
    expert_map: Placement | None,
    *,
    num_experts: int,
    ep_size: int,
    num_layers: int | None,
    **control: Any,
) -> RuntimeSettings:
    """:class:`RuntimeSettings` of an enabled legacy config and its loaded ``expert_map``.

    vllm-ascend runs its cycle off the serving thread, and record mode needs the worker: the
    legacy path is always asynchronous. A static map (``dynamic_eplb`` off) builds no runtime.
    """
    return RuntimeSettings(
        num_experts=num_experts,
        ep_size=ep_size,
        num_redundant_experts=config.num_redundant_experts,
        control=control_settings_from_legacy(config, **control) if config.dynamic_eplb else None,
        use_async=True,
        record_map_path=config.expert_map_record_path,
        initial_placement=initial_placement(
            expert_map, num_experts, config.num_redundant_experts, ep_size, num_layers
        ),
    )


def initial_placement(
    expert_map: Placement | None,
    num_experts: int,
    num_redundant: int,
    ep_size: int,
    num_layers: int | None,
) -> Placement | None:
    """The placement ``EplbState`` starts from: a legacy map (checked against the model's
    ``num_layers``), else the default one; ``None`` while the layer count is unknown."""
    if expert_map is None:
        if num_layers is None:
            return None
        return Placement.default(num_layers, num_experts, num_redundant, ep_size)
    if num_layers is not None and expert_map.num_layers != num_layers:
        raise ConfigError(
            "expert_map_path",
            f"the map has {expert_map.num_layers} MoE layers but the model has {num_layers}; "
            "use a map recorded for this model",
        )
    return expert_map
