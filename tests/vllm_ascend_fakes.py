"""Fakes of vllm-ascend 0.30.0rc2's EPLB interfaces, shaped by the attach's own fact table.

Every fake takes its names from ``eplb_graph.integrations.vllm_ascend.facts`` (the rows the
source test checks against the real sdist), and refuses what the real one lacks: the layer state
and the MoE layer have ``__slots__`` of exactly the real attribute names, the router's mapping
has the real ``(self, topk_ids)`` signature, the quantization schemes return
``get_eplb_weight_views`` in the real order (per-expert lists on Model Runner V2 with EPLB, or
stacked tensors), and the recording module records ``expert_tokens`` after compute as the real
``_record_v2_eplb_load`` does; the worker's ``shutdown`` shuts its model runner down, and the
runner keeps its controller as ``eplb``, as the real ones do.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from eplb_graph.integrations.vllm_ascend.facts import FACTS, UPSTREAM_FACTS


def _fact(name: str, facts=FACTS):
    return next(f for f in facts if f.name == name)


#: Upstream EplbLayerState's fields plus AscendEplbLayerState's attributes, from the facts.
LAYER_STATE_FIELDS = (
    *_fact("EplbLayerState", UPSTREAM_FACTS).uses,
    *_fact("AscendEplbLayerState").attributes,
)
ASCEND_MARKER = _fact("_EPLB_ROUTER_ADAPTED").value
W8A8_LAYER_TENSORS = _fact("AscendW8A8DynamicFusedMoEMethod.get_eplb_weight_views").uses
W4A8_EXTRA = ("w13_scale_bias", "w2_scale_bias", "w13_scale_bias_list", "w2_scale_bias_list")
W4A8_BASE = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")
W4A8_LISTS = tuple(f"{name}_list" for name in W4A8_BASE)


class FakeLayerState:
    """AscendEplbLayerState: only the real fields can be set."""

    __slots__ = LAYER_STATE_FIELDS

    def __init__(self) -> None:
        for name in LAYER_STATE_FIELDS:
            setattr(self, name, 0 if name.startswith("local_expert") else None)


class FakeRouter:
    """An upstream router: validates its layer state, then calls ``self._apply_eplb_mapping``."""

    def __init__(self, eplb_state: FakeLayerState | None = None) -> None:
        self.eplb_state = eplb_state

    def _apply_eplb_mapping(self, topk_ids: torch.Tensor) -> torch.Tensor:
        raise AssertionError("vllm-ascend's table mapping ran: the router was not adapted")

    def select(self, topk_ids: torch.Tensor) -> torch.Tensor:
        state = self.eplb_state
        for name in LAYER_STATE_FIELDS[:5]:
            if getattr(state, name) is None:
                raise RuntimeError(f"EPLB layer state {name} is not set")
        return self._apply_eplb_mapping(topk_ids)


class RouterWithOtherSignature(FakeRouter):
    def _apply_eplb_mapping(self, ids: torch.Tensor) -> torch.Tensor:  # not (self, topk_ids)
        return ids


@dataclass
class FakeResult:
    """FusedExpertsResult's recording fields."""

    expert_tokens: torch.Tensor
    group_list_type: int = 1


def recording_module() -> types.ModuleType:
    """``routed_experts`` with the real post-compute recording of local expert counts."""
    module = types.ModuleType("fake_routed_experts")

    def _record_v2_eplb_load(router, result) -> None:
        state = router.eplb_state
        start, count = state.local_expert_start, state.local_expert_count
        state.expert_load_view[start : start + count] += (
            result.expert_tokens * state.should_record_tensor
        )

    module._record_v2_eplb_load = _record_v2_eplb_load
    return module


class FakeRoutedExperts:
    """AscendRoutedExperts: route, count each local expert's rows (the MoE operator), record."""

    __slots__ = tuple(
        dict.fromkeys(
            (
                "router",
                "quant_method",
                "local_num_experts",
                *W8A8_LAYER_TENSORS,
                *W4A8_BASE,
                *W4A8_LISTS,
                *W4A8_EXTRA,
            )
        )
    )

    def __init__(self, router, quant_method, local_num_experts: int) -> None:
        self.router = router
        self.quant_method = quant_method
        self.local_num_experts = local_num_experts

    def forward(self, topk_ids: torch.Tensor, module: types.ModuleType, ep_rank: int):
        slots = self.router.select(topk_ids)
        first = ep_rank * self.local_num_experts
        local = slots[(slots >= first) & (slots < first + self.local_num_experts)] - first
        tokens = torch.bincount(local.flatten(), minlength=self.local_num_experts)
        module._record_v2_eplb_load(self.router, FakeResult(tokens))
        return slots


class AscendW8A8DynamicFusedMoEMethod:
    """The W8A8 scheme's ``get_eplb_weight_views`` (lists first, fused scales in pairs)."""

    @staticmethod
    def get_eplb_weight_views(layer) -> list:
        if getattr(layer, "w13_weight_list", None) is not None:
            names = ["w13_weight_list", "w2_weight_list", "w13_weight_scale_fp32_list"]
            names += ["w2_weight_scale_list", "fused_w1_scale_list", "fused_w2_scale_list"]
        else:
            names = ["w13_weight", "w2_weight", "w13_weight_scale_fp32", "w2_weight_scale"]
            names += ["fused_w1_scale", "fused_w2_scale"]
        return [getattr(layer, n) for n in names if getattr(layer, n, None) is not None]


class AscendW4A8DynamicFusedMoEMethod:
    """The W4A8 scheme's ``get_eplb_weight_views`` (W8A8's four plus the scale biases)."""

    @staticmethod
    def get_eplb_weight_views(layer) -> list:
        lists = getattr(layer, "w13_weight_list", None) is not None
        names = [*W4A8_LISTS, *W4A8_EXTRA[2:]] if lists else [*W4A8_BASE, *W4A8_EXTRA[:2]]
        return [getattr(layer, n) for n in names if getattr(layer, n, None) is not None]


class AscendFusedMoEMethod:
    """The quantized layers' adapter: forwards to its scheme."""

    def __init__(self, scheme) -> None:
        self.quant_method = scheme

    def get_eplb_weight_views(self, layer) -> list:
        return self.quant_method.get_eplb_weight_views(layer)


def w8a8_layer(
    experts: list[int], *, lists: bool, hidden: int = 32, inter: int = 16, router=None
) -> FakeRoutedExperts:
    """A W8A8 layer whose slot ``s`` holds expert ``experts[s]``: every weight and scale of an
    expert encodes its id, so a moved expert is recognisable in every one of its tensors."""
    layer = FakeRoutedExperts(
        router, AscendFusedMoEMethod(AscendW8A8DynamicFusedMoEMethod()), len(experts)
    )
    shapes = {
        "w13_weight": ((hidden, 2 * inter), torch.int8),
        "w2_weight": ((inter, hidden), torch.int8),
        "w13_weight_scale_fp32": ((2 * inter,), torch.float32),
        "w2_weight_scale": ((hidden,), torch.float32),
        "fused_w1_scale": ((2 * inter,), torch.int64),
        "fused_w2_scale": ((hidden,), torch.int64),
    }
    for index, (name, (shape, dtype)) in enumerate(shapes.items()):
        per_expert = [torch.full(shape, 3 * e + index, dtype=dtype) for e in experts]
        if lists:
            setattr(layer, f"{name}_list", per_expert)
        else:
            setattr(layer, name, torch.stack(per_expert))
    return layer


def expert_of(layer: FakeRoutedExperts, slot: int) -> set[int]:
    """The expert ids every W8A8 tensor of ``slot`` encodes (one id when they agree)."""
    views = layer.quant_method.get_eplb_weight_views(layer)
    return {int(views[i][slot].flatten()[0].item() - i) // 3 for i in range(len(views))}


class FakeModelRunner:
    """Model Runner V2: keeps its EPLB controller as ``eplb`` (row ``NPUModelRunner.__init__``);
    its ``shutdown`` (upstream's) notes whether eplb-graph was closed before it ran."""

    __slots__ = ("eplb", "shutdowns")

    def __init__(self, eplb) -> None:
        self.eplb = eplb
        self.shutdowns: list[bool] = []  # per call: was eplb-graph's adapter closed by then

    def shutdown(self) -> None:
        state = getattr(self.eplb, "state", None)
        self.shutdowns.append(bool(getattr(state, "closed", False)))


class NPUWorker:
    """The worker, with the pinned release's ``NPUWorker.shutdown`` as written there (rows
    ``NPUWorker.init_device`` and ``NPUWorker.shutdown``; the KV-transfer and weight-transfer
    branches have nothing to shut down here)."""

    def __init__(self, model_runner) -> None:
        self.profiler = None
        self.model_runner = model_runner

    def shutdown(self) -> None:
        if self.profiler is not None:
            self.profiler.shutdown()

        if weight_transfer_engine := getattr(self, "weight_transfer_engine", None):
            weight_transfer_engine.shutdown()

        if model_runner := getattr(self, "model_runner", None):
            shutdown_fn = getattr(model_runner, "shutdown", None)
            if callable(shutdown_fn):
                shutdown_fn()


def fake_vllm_config(
    num_experts: int, redundant: int, ep_size: int, use_async: bool, metrics_path: str | None = None
):
    """The fields of vLLM's config that eplb-graph's settings read (no engine is built)."""
    eplb = SimpleNamespace(
        window_size=2,
        step_interval=3,
        num_redundant_experts=redundant,
        log_balancedness=False,
        log_balancedness_interval=1,
        use_async=use_async,
        policy="default",
        communicator=None,
        enable_migration_batching=False,
    )
    parallel = SimpleNamespace(
        enable_eplb=True,
        eplb_config=eplb,
        tensor_parallel_size=ep_size,
        data_parallel_size=1,
        enable_dbo=False,
        ubatch_size=1,
    )
    return SimpleNamespace(
        parallel_config=parallel,
        model_config=SimpleNamespace(get_num_experts=lambda: num_experts, enforce_eager=True),
        compilation_config=SimpleNamespace(mode=0),  # vLLM's CompilationMode.NONE
        additional_config={
            "eplb_graph": {} if metrics_path is None else {"metrics_path": metrics_path}
        },
        speculative_config=None,
    )
