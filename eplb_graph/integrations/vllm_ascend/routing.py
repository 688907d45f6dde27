"""vllm-ascend's routers, routed through ``torch.ops.eplb_graph.map_and_record``.

On vllm-ascend's Model Runner V2, patching vLLM's module global routing hook does nothing: each
router instance carries its own ``_apply_eplb_mapping``, bound by vllm-ascend's
``_adapt_eplb_router`` when the layer is built. :func:`adapt_router` binds eplb-graph's in its
place, per instance, after the model is loaded, and points the router's layer state at one layer
of eplb-graph's ``EplbState`` (so vLLM's own ``_validate_eplb_state`` still passes).

Routing and load recording are one op at routing time, so vllm-ascend's recording after compute
(``_record_v2_eplb_load``, fed by the MoE operator's per-expert token counts) is switched off for
adapted routers (:func:`install_recording_switch`): each token is counted once.

Which rank counts a token depends on the MoE communication method of the forward, which
vllm-ascend picks per batch: with all-gather every rank routes every token, so only EP rank 0
records; with MC2 / all-to-all each rank routes its own tokens and every rank records. Every rank
uses the same replica offset, so under all-gather a token picks the same replica everywhere.
Rows at or past the step's unpadded token count are not counted (the attach runs with
data_parallel_size=1, where that count is the batch's).
"""

from __future__ import annotations

import functools
import inspect
from types import MethodType
from typing import Any

import torch

from eplb_graph.integrations.vllm import routing
from eplb_graph.integrations.vllm_ascend.facts import VllmAscendPluginError
from eplb_graph.state import EplbState

ADAPTED = "_eplb_graph_router"
"""Set on every router eplb-graph adapted: its :class:`RouterRecording`."""

ROUTER_MAPPING_PARAMETERS = ("self", "topk_ids")


class RouterRecording:
    """Which record flag the routers use, by this forward's communication method.

    ``replicated()`` answers whether this forward's routing is replicated across EP ranks
    (vllm-ascend: ``_EXTRA_CTX.moe_comm_type == MoECommType.ALLGATHER``). Read while the forward
    is traced, as vllm-ascend's own router does for the same question; the tensors chosen are
    made once, so nothing is copied to the device per call.
    """

    def __init__(self, state: EplbState, ep_rank: int, replicated: Any) -> None:
        self.state = state
        self.ep_rank = ep_rank
        self.replicated = replicated
        self.never = torch.zeros((), dtype=torch.bool, device=state.device)

    def record_enabled(self) -> torch.Tensor:
        """The step's record flag, or a constant false where another rank counts these tokens."""
        if self.ep_rank != 0 and self.replicated():
            return self.never
        return self.state.record_enabled


def _map_and_record(self: Any, topk_ids: torch.Tensor) -> torch.Tensor:
    """The adapted router's ``_apply_eplb_mapping``: logical ids -> physical slots, recorded."""
    layer_state = self.eplb_state
    return routing.map_and_record(
        topk_ids,
        layer_state.expert_load_view,
        layer_state.logical_to_physical_map,
        layer_state.logical_replica_count,
        getattr(self, ADAPTED).record_enabled(),
        layer_state.num_unpadded_tokens_tensors[0],
    )


def adapt_router(
    router: Any, layer: int, state: EplbState, recording: RouterRecording, ascend_marker: str
) -> None:
    """Route ``router`` (MoE layer ``layer``) through eplb-graph's state.

    Raises:
        VllmAscendPluginError: the router's class mapping method is not ``(self, topk_ids)``, or
            the router has no EPLB layer state (vllm-ascend did not build it for EPLB).
    """
    name = type(router).__name__
    method = getattr(type(router), "_apply_eplb_mapping", None)
    if method is None:
        raise VllmAscendPluginError(f"MoE router {name} has no _apply_eplb_mapping")
    found = tuple(inspect.signature(method).parameters)
    if found != ROUTER_MAPPING_PARAMETERS:
        raise VllmAscendPluginError(
            f"MoE router {name}._apply_eplb_mapping has parameters {list(found)}, "
            f"expected {list(ROUTER_MAPPING_PARAMETERS)}"
        )
    layer_state = getattr(router, "eplb_state", None)
    if layer_state is None:
        raise VllmAscendPluginError(
            f"MoE layer {layer}'s router {name} has no EPLB layer state: vllm-ascend builds one "
            "only with enable_eplb on Model Runner V2"
        )
    layer_state.expert_load_view = state.load[layer]
    layer_state.logical_to_physical_map = state.log2phy[layer]
    layer_state.logical_replica_count = state.replica_count[layer]
    layer_state.should_record_tensor = state.record_enabled
    layer_state.num_unpadded_tokens_tensors = [state.num_valid_tokens]
    router._apply_eplb_mapping = MethodType(_map_and_record, router)
    setattr(router, ascend_marker, True)  # vllm-ascend never rebinds it
    setattr(router, ADAPTED, recording)


def install_recording_switch(module: Any) -> None:
    """Wrap ``module._record_v2_eplb_load`` so adapted routers record nothing after compute."""
    original = module._record_v2_eplb_load
    if getattr(original, "_eplb_graph_switch", False):
        return

    @functools.wraps(original)
    def record_unless_adapted(router, result):
        if getattr(router, ADAPTED, None) is not None:
            return None  # eplb-graph recorded this layer's load while routing
        return original(router, result)

    record_unless_adapted._eplb_graph_switch = True
    module._record_v2_eplb_load = record_unless_adapted
