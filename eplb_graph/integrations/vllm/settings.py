"""vLLM's configuration objects -> eplb-graph's validated settings, at engine start and in workers.

The same function runs twice with the same inputs: in the process that builds vLLM's config
(so a bad setting fails ``LLM(...)`` / server start-up with a ``ConfigError`` naming the field),
and in every worker when the model is loaded (where the layer count and expert groups are
known). The path is every host's (``eplb_graph.integrations.settings``): vLLM's
``ParallelConfig.enable_eplb``, ``ParallelConfig.eplb_config`` and ``additional_config`` go
through ``resolve_eplb_config``; this module then adds to its ``RuntimeSettings`` what only
the plugin's own section (:class:`~eplb_graph.integrations.vllm.options.PluginOptions`) sets.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from eplb_graph.control.phases import CollectionPhase
from eplb_graph.control.planning import PolicyPlanner
from eplb_graph.control.window_record import WINDOWS_FILE
from eplb_graph.integrations.settings import ConfigError, RuntimeSettings, resolve_eplb_config
from eplb_graph.integrations.vllm.model_shape import hidden_layer_count, moe_layer_count
from eplb_graph.integrations.vllm.options import PREFIX, SECTION, PluginOptions
from eplb_graph.movement.staging import StagingBudgetError
from eplb_graph.placement import Placement

#: vLLM ``EPLBConfig`` fields eplb-graph implements (everything but migration batching).
_EPLB_CONFIG_FIELDS = (
    "window_size",
    "step_interval",
    "num_redundant_experts",
    "log_balancedness",
    "log_balancedness_interval",
    "use_async",
    "policy",
    "communicator",
)


def plugin_section(vllm_config: Any) -> Any:
    return (vllm_config.additional_config or {}).get(SECTION)


def eplb_settings(
    vllm_config: Any,
    *,
    num_layers: int | None = None,
    num_expert_groups: int = 1,
    timed_experts: bool = True,
) -> RuntimeSettings | None:
    """Validate every EPLB setting of ``vllm_config``; ``None`` when EPLB is off.

    ``timed_experts``: whether the host's expert op records its own time (vLLM's CPU kernels
    do; vllm-ascend's NPU kernels do not), which ``rearrange="when_it_pays"`` (the default where
    it is) needs to fit its cost model; elsewhere the default is ``always`` and asking for
    ``when_it_pays`` is refused.

    ``num_layers`` (the loaded model's, in workers) checks an expert map's layer count and caps
    ``layers_per_step``. Without it (where vLLM builds its config) the count comes from the
    model's configuration when its family is known (``model_shape``), else only the decoder
    layer count bounds the map.

    Raises:
        ConfigError: naming the first invalid setting and how to fix it.
    """
    parallel = vllm_config.parallel_config
    section = plugin_section(vllm_config)
    options = PluginOptions.from_section(section)
    if not parallel.enable_eplb:
        if section is not None:
            raise ConfigError(
                PREFIX, "is set but EPLB is off; add --enable-eplb (enable_eplb=True) or drop it"
            )
        return None
    _check_supported_modes(vllm_config)
    eplb_config = parallel.eplb_config
    mapping = {name: getattr(eplb_config, name) for name in _EPLB_CONFIG_FIELDS}
    additional = dict(vllm_config.additional_config or {})
    additional.pop(SECTION, None)
    model_config = vllm_config.model_config
    if num_layers is None:
        num_layers = moe_layer_count(model_config)
    settings = resolve_eplb_config(
        enable_eplb=True,
        eplb_config=mapping,
        additional_config=additional,
        num_experts=model_config.get_num_experts(),
        ep_size=parallel.tensor_parallel_size * parallel.data_parallel_size,
        num_layers=num_layers,
        num_groups=num_expert_groups,
    )
    # --enable-eplb selects V2 (legacy keys beside it raised), and V2 always rebalances.
    assert settings is not None and settings.rebalances
    changes = _option_changes(settings, options, additional)
    changes["rearrange"] = _rearrange(options, timed_experts)
    if options.record_windows:
        changes["windows_path"] = str(Path(options.metrics_path) / WINDOWS_FILE)
    settings = dataclasses.replace(
        settings,
        **changes,
        layers_per_step=options.layers_per_step,
        commit_margin_steps=options.commit_margin_steps,
        staging_budget_bytes=options.staging_budget_mib << 20,
        move_to=_expert_map(options, settings, num_layers, hidden_layer_count(model_config)),
        record_map_path=options.record_map_path,
        metrics_path=options.metrics_path,
        weight_digests=options.weight_digests,
    )
    _check_policy_options(settings)
    return settings if num_layers is None else settings.for_layers(num_layers)


def staging_budget_config_error(error: StagingBudgetError) -> ConfigError:
    """The runtime's budget error in this section's words (MiB, the plugin's key names)."""
    needed_mib = -(-error.needed // (1 << 20))
    return ConfigError(
        f"{PREFIX}.staging_budget_mib",
        f"the staging blocks need {needed_mib} MiB ({error.blocks} blocks x 2 x "
        f"{error.slots_per_rank} slots x {error.slot_nbytes} bytes per expert), more than the "
        f"budget of {error.budget >> 20} MiB; lower {PREFIX}.layers_per_step or raise "
        f"{PREFIX}.staging_budget_mib to at least {needed_mib}",
    )


def _check_supported_modes(vllm_config: Any) -> None:
    """Modes the plugin does not implement fail here, at engine start (never degrade later)."""
    parallel = vllm_config.parallel_config
    if parallel.data_parallel_size != 1:
        raise ConfigError(
            "data_parallel_size",
            f"eplb-graph's vLLM plugin supports data_parallel_size=1 (got "
            f"{parallel.data_parallel_size}); vLLM's CPU backend has no data-parallel expert "
            "parallelism (its CPU communicator lacks all_gatherv / reduce_scatterv)",
        )
    if parallel.enable_dbo or parallel.ubatch_size > 1:
        raise ConfigError(
            "enable_dbo",
            "micro-batching (DBO) is not supported with eplb-graph's EPLB; turn it off",
        )
    if vllm_config.speculative_config is not None:
        raise ConfigError(
            "speculative_config",
            "speculative decoding is not supported with eplb-graph's EPLB (a drafter would route "
            "through the same EPLB tables); turn one of them off",
        )
    if parallel.eplb_config.enable_migration_batching:
        raise ConfigError(
            "eplb_config.enable_migration_batching",
            "is vLLM's own migration scheduler; eplb-graph batches transfers itself "
            "(RuntimeSettings.max_batch_ops): leave it false",
        )


def _option_changes(
    settings: RuntimeSettings, options: PluginOptions, additional: dict
) -> dict[str, Any]:
    """The control fields this section sets over what ``resolve_eplb_config`` returned."""
    changes: dict[str, Any] = {
        "time_samples": options.time_samples,
        "min_gain_percent": options.min_gain_percent,
    }
    if options.policy is not None:
        changes["policy"] = options.policy
        changes["policy_options"] = dict(options.policy_options or {})
    if options.load_collection_phase is not None:
        # Two spellings, one setting: vllm-ascend's additional_config.eplb_config (users copy it
        # from its guide) is already in ``control``; this section's own is the same setting.
        nested = additional.get("eplb_config") or {}
        ours = CollectionPhase.parse(options.load_collection_phase)
        if "load_collection_phase" in nested and settings.load_collection_phase is not ours:
            raise ConfigError(
                f"{PREFIX}.load_collection_phase",
                f"is {ours.value!r} but additional_config.eplb_config.load_collection_phase is "
                f"{settings.load_collection_phase.value!r}: they are one setting; keep one "
                "spelling or give both the same value",
            )
        changes["load_collection_phase"] = ours
    return changes


def _rearrange(options: PluginOptions, timed_experts: bool) -> str:
    """``when_it_pays`` by default where the expert op is timed, ``always`` elsewhere."""
    if options.rearrange is None:
        return "when_it_pays" if timed_experts else "always"
    if options.rearrange == "when_it_pays" and not timed_experts:
        raise ConfigError(
            f"{PREFIX}.rearrange",
            "'when_it_pays' needs the expert op's own timings to fit its cost model, and this "
            "host's expert kernels do not record them (vllm-ascend's NPU kernels); use 'always'",
        )
    return options.rearrange


def _expert_map(
    options: PluginOptions,
    settings: RuntimeSettings,
    num_layers: int | None,
    max_layers: int | None,
) -> Placement | None:
    """The starting map, validated against the model (N, EP size, redundancy, layers)."""
    if options.expert_map_path is None:
        return None
    field = f"{PREFIX}.expert_map_path"
    from eplb_graph.expert_map import ExpertMapError

    try:
        placement = Placement.load_expert_map(
            options.expert_map_path, num_logical=settings.num_experts
        )
    except ExpertMapError as error:
        raise ConfigError(field, f"invalid expert map: {error}") from None
    except OSError as error:
        raise ConfigError(field, f"cannot read the map: {error}") from None
    expected = (settings.ep_size, settings.num_physical_experts)
    if (placement.num_ranks, placement.num_slots) != expected:
        raise ConfigError(
            field,
            f"the map has {placement.num_ranks} devices x {placement.slots_per_rank} slots, the "
            f"engine {settings.ep_size} EP ranks x "
            f"{settings.num_physical_experts // settings.ep_size} slots "
            f"({settings.num_experts} experts + {settings.num_redundant_experts} redundant); use "
            "a map of this shape or change eplb_config.num_redundant_experts",
        )
    if num_layers is not None and placement.num_layers != num_layers:
        raise ConfigError(
            field,
            f"the map has {placement.num_layers} MoE layers, the model {num_layers}; use a map "
            "recorded for this model",
        )
    if max_layers is not None and placement.num_layers > max_layers:
        raise ConfigError(
            field,
            f"the map has {placement.num_layers} MoE layers, more than the model's "
            f"{max_layers} decoder layers; use a map recorded for this model",
        )
    return placement


def _check_policy_options(settings: RuntimeSettings) -> None:
    """Policy options are checked against the policy's signature now, not at the first window."""
    try:
        PolicyPlanner(
            settings.policy,
            settings.num_physical_experts,
            settings.num_groups,
            settings.num_nodes,
            settings.ep_size,
            dict(settings.policy_options),
        )
    except TypeError as error:
        raise ConfigError(f"{PREFIX}.policy_options", str(error)) from None
