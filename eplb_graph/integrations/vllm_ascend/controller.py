"""eplb-graph's runtime where vllm-ascend's Model Runner V2 keeps its EPLB controller.

vllm-ascend's ``NPUModelRunner`` builds ``self.eplb = AscendEPLBController(parallel_config,
device, ascend_eplb_config)`` from its module global, then drives it from the upstream Model
Runner V2 call sites: ``prepare_load``, ``maybe_register_model`` after loading,
``set_batch_phase`` and ``prepare_forward`` before each forward, ``step`` after it (and after
each dummy run). :class:`EplbGraphController` answers the same calls: registering the model
builds eplb-graph's ``EplbState``, adapts every router (``routing.adapt_router``), builds weight
views over ``get_eplb_weight_views`` and starts an ``EplbRuntime`` whose movement is eplb-graph's
own (gloo groups of its own, payloads staged through host memory); ``AscendEplbState`` and
vllm-ascend's communicators are never built. No controller call marks the end of serving: the
worker's ``shutdown``, wrapped by ``vllm_ascend.install``, calls :meth:`EplbGraphController.close`.

Refused at start-up (never degraded): a mixture-of-experts draft model, and elastic EP
(``setup_from_mapping``).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

from eplb_graph.integrations.vllm import routing as vllm_routing
from eplb_graph.integrations.vllm.attach import start
from eplb_graph.integrations.vllm.moe_model import UnsupportedVllmModel
from eplb_graph.integrations.vllm.runner import VllmEplbAdapter
from eplb_graph.integrations.vllm_ascend.routing import RouterRecording, adapt_router
from eplb_graph.integrations.vllm_ascend.weights import layer_view

logger = logging.getLogger(__name__)


class AscendEplbAdapter(VllmEplbAdapter):
    """The CPU plugin's adapter, told the batch phase by the runner (``set_batch_phase``)."""

    batch_has_prefill = True

    def _batch_has_prefill(self) -> bool:
        return self.batch_has_prefill


class EplbGraphController:
    """Stands where ``AscendEPLBController`` stands (``NPUModelRunner.eplb``)."""

    def __init__(
        self, parallel_config: Any, device: Any, ascend_eplb_config: Any = None, *, vllm_config
    ) -> None:
        self.parallel_config = parallel_config
        self.device = device
        self.vllm_config = vllm_config
        self.state: AscendEplbAdapter | None = None  # where AscendEplbState would be
        self.suppressed = False
        self._has_prefill = True

    # -- Model Runner V2's call sites ----------------------------------------------------------
    def prepare_load(self) -> None:
        """Before loading: nothing to build until the model exists."""

    def maybe_register_speculator(
        self, speculator: Any, speculative_config: Any, load_dummy_weights: bool
    ) -> bool:
        draft = getattr(speculator, "model", None)
        if draft is not None and _moe_part(draft) is not None:
            raise UnsupportedVllmModel(
                "eplb-graph balances the target model only; this draft model is a mixture of "
                "experts (serve without the draft, or without eplb-graph)"
            )
        return False

    def maybe_register_model(self, model: Any, model_config: Any) -> bool:
        moe = _moe_part(model)
        if moe is None or not self.parallel_config.enable_eplb:
            return False
        self.state = attach(self, moe, model_config)
        self.state.batch_has_prefill = self._has_prefill
        return True

    def maybe_start_async_loop(self, eplb_models_added: bool, load_dummy_weights: bool = False):
        """eplb-graph's movement worker starts with its runtime."""

    def set_batch_phase(self, batch_has_prefill: bool) -> None:
        self._has_prefill = bool(batch_has_prefill)
        if self.state is not None:
            self.state.batch_has_prefill = self._has_prefill

    def prepare_forward(
        self, model_config: Any, num_unpadded_tokens: int, ubatch_slices: list | None = None
    ) -> None:
        if self.state is not None and not self.suppressed:
            self.state.prepare_forward(model_config, num_unpadded_tokens, ubatch_slices)

    def step(self, is_dummy: bool = False, is_profile: bool = False) -> None:
        if self.state is not None and not self.suppressed:
            self.state.step(is_dummy=is_dummy, is_profile=is_profile)

    def setup_from_mapping(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedVllmModel(
            "elastic expert parallelism is not supported with eplb-graph's EPLB on vllm-ascend"
        )

    def close(self) -> None:
        """Stop the runtime (movement worker thread), log and write the final figures (metrics
        file ``closed: true``); called by the worker's shutdown (see ``vllm_ascend.install``).
        Once: later calls do nothing (``VllmEplbAdapter.close``)."""
        if self.state is not None:
            self.state.close()


def _moe_part(model: Any) -> Any:
    from vllm.model_executor.models.interfaces import get_mixture_of_experts_model

    return get_mixture_of_experts_model(model)


def attach(controller: EplbGraphController, moe: Any, model_config: Any) -> AscendEplbAdapter:
    """Build this rank's eplb-graph EPLB over vllm-ascend's loaded MoE model."""
    from vllm.distributed.parallel_state import get_ep_group
    from vllm_ascend.ascend_forward_context import _EXTRA_CTX, MoECommType
    from vllm_ascend.patch.platform.patch_fused_moe import _EPLB_ROUTER_ADAPTED

    group = get_ep_group()
    return attach_to(
        controller,
        moe,
        model_config,
        group,
        replicated=lambda: _EXTRA_CTX.moe_comm_type == MoECommType.ALLGATHER,
        ascend_marker=_EPLB_ROUTER_ADAPTED,
    )


def attach_to(
    controller: EplbGraphController,
    moe: Any,
    model_config: Any,
    group: Any,
    *,
    replicated: Any,
    ascend_marker: str,
) -> AscendEplbAdapter:
    """:func:`attach` with vllm-ascend's names passed in (what the tests drive with fakes)."""
    slots_per_rank = (moe.num_logical_experts + moe.num_redundant_experts) // group.world_size

    def bind(model: Any, state) -> None:
        recording = RouterRecording(state, group.rank_in_group, replicated)
        for index, layer in enumerate(model.moe_layers):
            adapt_router(layer.routed_experts.router, index, state, recording, ascend_marker)
        vllm_routing.bind_offset(state.offset)

    def weight_views(model: Any) -> list:
        return [layer_view(layer.routed_experts, slots_per_rank) for layer in model.moe_layers]

    runner = SimpleNamespace(vllm_config=controller.vllm_config, model_config=model_config)
    adapter = start(
        runner,
        moe,
        group,
        bind=bind,
        weight_views=weight_views,
        record_load=lambda ep_rank: True,  # per forward: routing.RouterRecording
        adapter_cls=AscendEplbAdapter,
        device=controller.device,
        timed_experts=False,  # NPU expert kernels record no time: rearrange defaults to always
    )
    assert isinstance(adapter, AscendEplbAdapter)
    return adapter
