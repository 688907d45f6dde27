"""Building one rank's EPLB over a loaded vLLM MoE model, and handing it to the runner.

:func:`start` is shared by the attaches (vLLM's CPU runner here, vllm-ascend's Model Runner V2
in ``eplb_graph.integrations.vllm_ascend``): state, routing, weight views, runtime and the
:class:`~eplb_graph.integrations.vllm.runner.VllmEplbAdapter` that vLLM's call sites drive.
:func:`attach` is the CPU runner's: its routers, its kernels' weight views and expert clocks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch

from eplb_graph.integrations.vllm import quantized, routing
from eplb_graph.integrations.vllm.moe_model import UnsupportedVllmModel, moe_model
from eplb_graph.integrations.vllm.runner import (
    GROUP_RING_SIZE,
    GROUP_TIMEOUT_S,
    VllmEplbAdapter,
)
from eplb_graph.integrations.vllm.settings import eplb_settings, staging_budget_config_error
from eplb_graph.integrations.vllm.slot_digests import DigestLog, kernel_tensors
from eplb_graph.movement.staging import StagingBudgetError
from eplb_graph.movement.transport import GroupRing
from eplb_graph.movement.views import make_expert_view
from eplb_graph.placement import Placement
from eplb_graph.runtime import EplbRuntime
from eplb_graph.state import EplbState

logger = logging.getLogger(__name__)


def _bind_stats(model, state: EplbState) -> None:
    """Each layer's expert op times itself into ``state.expert_stats[layer]`` (rows, ns, active
    slots)."""
    for index, layer in enumerate(model.moe_layers):
        kernel = layer.routed_experts.quant_method.moe_kernel.fused_experts
        kernel.eplb_stats = state.expert_stats[index]


def _weight_views(model) -> list:
    """The unquantized CPU kernels' live expert tensors, one view per MoE layer.

    vLLM's CPU backend repacks each expert's weights into a blocked layout after loading; the
    packing is per expert and keeps the ``[slots, ...]`` shape, so a slot's bytes are exactly one
    expert and moving them moves the expert.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    views = []
    for index, layer in enumerate(model.moe_layers):
        experts = layer.routed_experts
        kernel = getattr(getattr(experts.quant_method, "moe_kernel", None), "fused_experts", None)
        if quantized.format_of(kernel) is not None:
            views.append(quantized.weight_view(index, experts, kernel))
            continue
        if not isinstance(kernel, CPUUnquantizedExperts):
            raise UnsupportedVllmModel(
                f"MoE layer {index} runs {type(kernel).__name__}; eplb-graph moves the weights of "
                "vLLM's unquantized CPU experts (bf16/fp32) and of its quantized CPU experts "
                f"{[f.experts_class for f in quantized.FORMATS]} only"
            )
        tensors = {"w13": experts.w13_weight.data, "w2": experts.w2_weight.data}
        for name in ("w13_bias", "w2_bias"):
            bias = getattr(experts, name, None)
            if bias is not None:
                tensors[name] = bias.data
        views.append(make_expert_view("unquantized", tensors))
    return views


def _kernel_tensors(model) -> list[dict[str, torch.Tensor]]:
    """Per MoE layer, every per-expert tensor its kernel reads (for the weight digests)."""
    return [
        kernel_tensors(
            layer.routed_experts, layer.routed_experts.quant_method.moe_kernel.fused_experts
        )
        for layer in model.moe_layers
    ]


def attach(runner: Any) -> VllmEplbAdapter:
    """Build this rank's EPLB after ``load_model`` and hand it to vLLM's runner."""
    from vllm.distributed.parallel_state import get_ep_group

    redundant = runner.parallel_config.eplb_config.num_redundant_experts
    model = moe_model(runner.model, int(redundant or 0))
    adapter = start(
        runner,
        model,
        get_ep_group(),
        bind=_bind_cpu_routers,
        weight_views=_weight_views,
        record_load=lambda ep_rank: ep_rank == 0,
    )
    if adapter.settings.weight_digests:
        adapter.weight_digests = DigestLog(_kernel_tensors(model))
        adapter._record_weight_digests()
    _bind_stats(model, adapter.state)
    runner.eplb_state = adapter
    runner._moe_model = model
    return adapter


def _bind_cpu_routers(model, state: EplbState) -> None:
    """vLLM's routers read eplb-graph's rows; its routing hook is ``routing.map_and_record``."""
    model.set_eplb_state(state.load, state.log2phy, state.replica_count)
    for layer in model.moe_layers:
        layer.eplb_state.should_record_tensor = state.record_enabled
        layer.eplb_state.num_unpadded_tokens_tensors = [state.num_valid_tokens]
    routing.bind_offset(state.offset)


def start(
    runner: Any,
    model: Any,
    group: Any,
    *,
    bind: Callable[[Any, EplbState], None],
    weight_views: Callable[[Any], list],
    record_load: Callable[[int], bool],
    adapter_cls: type[VllmEplbAdapter] = VllmEplbAdapter,
    device: torch.device | str = "cpu",
    timed_experts: bool = True,
) -> VllmEplbAdapter:
    """One rank's EPLB over a loaded vLLM MoE model: state, routing, views, runtime, adapter.

    Shared by the attaches (vLLM's CPU runner, vllm-ascend's Model Runner V2); each brings how
    its routers are pointed at the state (``bind``), its weight views, and which ranks record
    load (``record_load(ep_rank)``: with replicated routing only one rank may), and whether its
    expert op times itself (``timed_experts``: the cost model of ``rearrange="when_it_pays"``).
    """
    settings = eplb_settings(
        runner.vllm_config,
        num_layers=model.num_moe_layers,
        num_expert_groups=max(1, int(getattr(model, "num_expert_groups", 1) or 1)),
        timed_experts=timed_experts,
    )
    assert settings is not None  # attach runs only with enable_eplb
    ep_rank, ep_size = group.rank_in_group, group.world_size
    # vLLM filled slot p of every layer with expert p (p < N), then p - N mod N: the default.
    placement = settings.initial_placement
    loaded = (model.num_moe_layers, model.num_logical_experts, model.num_redundant_experts, ep_size)
    configured = placement and (
        placement.num_layers,
        placement.num_logical,
        placement.num_redundant,
        placement.num_ranks,
    )
    if configured != loaded:  # one source of truth: a mismatch is a bug, never served through
        raise RuntimeError(
            f"eplb-graph: (MoE layers, experts, redundant, EP ranks) are {configured} in vLLM's "
            f"configuration but {loaded} in the loaded model"
        )
    # One offset seed on every rank: where routing is replicated, a token's replica must agree.
    state = EplbState(placement, rank=ep_rank, offset_seed=0, device=device)
    state.set_step_inputs_(0, False)  # the compile warm-up is a dummy run: record nothing
    bind(model, state)
    views = weight_views(model)
    groups = GroupRing(GROUP_RING_SIZE, timeout_s=GROUP_TIMEOUT_S, ranks=list(group.ranks))
    try:  # the staging budget is checked where the per-expert byte size is known: here
        if settings.move_to is not None:
            _move_to(settings, state, views, groups, ep_rank, settings.move_to)
        runtime = EplbRuntime(
            state,
            views,
            settings,
            groups,
            ep_rank,
            record_load=record_load(ep_rank),
        )
    except StagingBudgetError as error:
        raise staging_budget_config_error(error) from None
    adapter = adapter_cls(runner, runtime, settings, ep_rank, ep_size)
    if adapter._metrics is not None:
        adapter._refresh_digest()
        adapter._metrics.file.update(runtime.progress(), adapter.snapshot, force=True)
    from importlib import metadata

    try:
        version = metadata.version("eplb-graph")
    except metadata.PackageNotFoundError:
        version = "(source tree)"
    logger.info(
        "eplb-graph %s attached on EP rank %d/%d: %d MoE layers, %d experts + %d redundant "
        "(%d slots per rank), policy %s, window %d / interval %d steps, %s, metrics %s",
        version,
        ep_rank,
        ep_size,
        model.num_moe_layers,
        model.num_logical_experts,
        model.num_redundant_experts,
        placement.num_slots // ep_size,
        settings.policy,
        settings.window_size,
        settings.step_interval,
        "async" if settings.use_async else "sync",
        settings.metrics_path or "off",
    )
    return adapter


def _move_to(settings, state, views, groups, ep_rank: int, target: Placement) -> None:
    """Start from ``target``: move vLLM's load-time layout there before serving (every rank)."""
    once = dataclasses.replace(settings, use_async=False, record_map_path=None)
    starter = EplbRuntime(state, views, once, groups, ep_rank)
    try:
        starter.rearrange_to(target.phy2log)
    finally:
        starter.close()
    if not torch.equal(state.committed_snapshot()[1], target.phy2log):
        raise RuntimeError(
            f"eplb-graph could not move to the starting expert map: {starter.stats().last_error}"
        )
