"""vLLM's and vllm-ascend's validated configurations -> the core's :class:`RuntimeSettings`.

The core (``EplbRuntime``, ``EplbState``, :class:`~eplb_graph.settings.RuntimeSettings`) knows
nothing of vLLM's or vllm-ascend's option names; this module is the one place that maps them.
Every host goes through it: :func:`~.resolve.resolve_eplb_config` validates what the host holds
(a launcher's command line through ``parse_cli_args``, vllm-ascend's V1 keys, vLLM's
``EPLBConfig``) and returns the :class:`RuntimeSettings` built here; the vLLM plugin then adds
what only its own section sets. Every validated field lands in :class:`RuntimeSettings`, so a
setting a user gave is either acted on or rejected at initialization, never validated and then
dropped.

A runner does, once per rank::

    settings = resolve_eplb_config(..., num_layers=L)    # None: EPLB is off
    if settings is not None:
        state = EplbState(settings.initial_placement, rank=rank, device=device)
        if settings.rebalances:                          # False: legacy static map
            runtime = EplbRuntime(state, views, settings, groups, rank)
"""

from __future__ import annotations

from typing import Any

from eplb_graph.integrations.settings.fields import ConfigError
from eplb_graph.integrations.settings.legacy import LegacyEplbConfig
from eplb_graph.integrations.settings.v2 import EplbConfig
from eplb_graph.placement import Placement
from eplb_graph.settings import GLOO_COMMUNICATOR, RuntimeSettings


def _control_from_v2(config: EplbConfig) -> dict[str, Any]:
    """The control fields of a validated V2 :class:`EplbConfig`.

    The window is ``config.effective_window_size``: load older than the previous rearrangement
    describes a placement that no longer exists.
    """
    return {
        "window_size": config.effective_window_size,
        "step_interval": config.step_interval,
        "load_collection_phase": config.load_collection_phase,
        "policy": config.policy,
        "log_balancedness": config.log_balancedness,
        "log_balancedness_interval": config.log_balancedness_interval,
        "use_async": config.use_async,
    }


def _control_from_legacy(config: LegacyEplbConfig) -> dict[str, Any]:
    """The control fields of a validated :class:`LegacyEplbConfig` (vllm-ascend V1 keys).

    vllm-ascend's cycle collects heat for ``expert_heat_collection_interval`` steps, then gives
    the policy ``algorithm_execution_interval`` steps; here that is a window of the collection
    length closing every collection + algorithm steps, with the same policy
    (``eplb_policy_type``) and phase filter (``eplb_heat_collection_stage``). The layer-by-layer
    swap phase is the movement worker's (``RuntimeSettings.layers_per_step``). vllm-ascend runs
    its cycle off the serving thread, and record mode needs the worker: the legacy path is
    always asynchronous. A static map (``dynamic_eplb`` off) builds no runtime.
    """
    if not config.dynamic_eplb:
        return {"rebalances": False}
    collect = config.expert_heat_collection_interval
    return {
        "window_size": collect,
        "step_interval": collect + config.algorithm_execution_interval,
        "load_collection_phase": config.eplb_heat_collection_stage,
        "policy": config.policy,
        "record_map_path": config.expert_map_record_path,
    }


def settings_from_v2(
    config: EplbConfig,
    *,
    num_experts: int,
    ep_size: int,
    num_layers: int | None,
    **control: Any,
) -> RuntimeSettings:
    """:class:`RuntimeSettings` of a validated V2 config; ``control`` adds core fields the V2
    schema does not spell (``num_groups``, ``num_nodes``, ``policy_options``, ...)."""
    return RuntimeSettings(
        num_experts=num_experts,
        ep_size=ep_size,
        num_redundant_experts=config.num_redundant_experts,
        initial_placement=initial_placement(
            None, num_experts, config.num_redundant_experts, ep_size, num_layers
        ),
        communicator=config.communicator or GLOO_COMMUNICATOR,
        **_control_from_v2(config),
        **control,
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
    """:class:`RuntimeSettings` of an enabled legacy config and its loaded ``expert_map``."""
    return RuntimeSettings(
        num_experts=num_experts,
        ep_size=ep_size,
        num_redundant_experts=config.num_redundant_experts,
        initial_placement=initial_placement(
            expert_map, num_experts, config.num_redundant_experts, ep_size, num_layers
        ),
        **_control_from_legacy(config),
        **control,
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
