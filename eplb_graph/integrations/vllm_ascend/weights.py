"""Weight views over exactly the tensors vllm-ascend's quant methods expose for EPLB.

vllm-ascend names a layer's movable expert tensors in ``quant_method.get_eplb_weight_views(layer)``
(the same list its own EPLB moves): for each quantization scheme, the weights and every
per-expert scale the kernel reads, in a fixed order, either stacked ``[E, ...]`` or, on Model
Runner V2 with EPLB on, as per-expert tensor lists (one allocation per expert, which the fused
MC2 kernels read and which avoids slicing a whole fractal-NZ tensor). eplb-graph moves one expert
as one payload, so an expert's weights never land without their scales.

- Stacked tensors: one :class:`~eplb_graph.movement.views.StridedPackedView` (expert dim 0).
- Per-expert lists: :class:`ExpertListView`, one single-slot view per expert's own tensors.

Fractal NZ: on an NPU an NZ tensor keeps its logical ND shape and torch_npu converts the layout in
``copy_``; the payload is ND either way. That conversion has never run here (no NPU).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from eplb_graph.movement.views import (
    StridedPackedView,
    UnsupportedWeightFormat,
    WeightViewError,
)


@dataclass(frozen=True)
class AscendFormat:
    """The payload names of one scheme's ``get_eplb_weight_views`` list, in its order."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()  # present together or not at all

    def names_for(self, count: int) -> tuple[str, ...]:
        if count == len(self.required):
            return self.required
        if self.optional and count == len(self.required) + len(self.optional):
            return self.required + self.optional
        accepted = sorted({len(self.required), len(self.required) + len(self.optional)})
        raise UnsupportedWeightFormat(
            self.name, f"get_eplb_weight_views returned {count} tensors, expected {accepted}"
        )


#: By quantization scheme class (read in facts.FACTS: the order of get_eplb_weight_views).
FORMATS: dict[str, AscendFormat] = {
    "AscendW8A8DynamicFusedMoEMethod": AscendFormat(
        "ascend_w8a8", ("w13", "w2", "w13_scale", "w2_scale"), ("w13_fused_scale", "w2_fused_scale")
    ),
    "AscendW4A8DynamicFusedMoEMethod": AscendFormat(
        "ascend_w4a8", ("w13", "w2", "w13_scale", "w2_scale"), ("w13_scale_bias", "w2_scale_bias")
    ),
    "AscendUnquantizedFusedMoEMethod": AscendFormat(
        "ascend_unquantized", ("w13", "w2"), ("w13_bias", "w2_bias")
    ),
}

QUANT_ADAPTER = "AscendFusedMoEMethod"
"""vllm-ascend's quantized layers hold this adapter; the scheme is its ``quant_method``."""


class ExpertListView:
    """An expert-weight view over per-expert tensor lists: slot ``s`` is tensors ``[s]``.

    Each expert's tensors are their own allocations, so each slot gets a single-slot
    :class:`~eplb_graph.movement.views.PackedSlotView` over ``tensor.unsqueeze(0)`` (a view of
    that expert's storage, written in place). Every slot must have the same payload layout.
    """

    def __init__(self, format_name: str, lists: Mapping[str, Sequence[torch.Tensor]]) -> None:
        counts = {name: len(tensors) for name, tensors in lists.items()}
        if len(set(counts.values())) != 1:
            raise UnsupportedWeightFormat(
                format_name, f"per-expert lists differ in length {counts}"
            )
        self.format_name = format_name
        self.num_slots = next(iter(counts.values()))
        if self.num_slots < 1:
            raise UnsupportedWeightFormat(format_name, "per-expert lists are empty")
        self._slots = [
            StridedPackedView(
                {
                    name: _as_tensor(format_name, name, t[s]).unsqueeze(0)
                    for name, t in lists.items()
                },
                expert_dim=0,
                format_name=format_name,
            )
            for s in range(self.num_slots)
        ]
        layouts = {slot.sections for slot in self._slots}
        if len(layouts) != 1:
            raise UnsupportedWeightFormat(
                format_name, "experts differ in shape or dtype: one payload layout is needed"
            )
        self.slot_nbytes = self._slots[0].slot_nbytes
        self.sections = self._slots[0].sections

    def pack_slot(self, slot: int, out: torch.Tensor) -> None:
        self._slot(slot).pack_slot(0, out)

    def unpack_slot_(self, slot: int, src: torch.Tensor) -> None:
        self._slot(slot).unpack_slot_(0, src)

    def data_ptrs(self) -> dict[str, int]:
        return {
            f"{name}[{s}]": ptr
            for s, v in enumerate(self._slots)
            for name, ptr in v.data_ptrs().items()
        }

    def tensors(self) -> dict[str, torch.Tensor]:
        return {
            f"{name}[{s}]": t for s, v in enumerate(self._slots) for name, t in v.tensors().items()
        }

    def _slot(self, slot: int):
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise WeightViewError(f"{self.format_name}: slot {slot!r} not in [0, {self.num_slots})")
        return self._slots[slot]


def _as_tensor(format_name: str, name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise UnsupportedWeightFormat(format_name, f"{name!r} holds a {type(value).__name__}")
    return value


def scheme_of(quant_method: Any) -> Any:
    """The quantization scheme behind a layer's quant method (unwrapping vllm-ascend's adapter)."""
    if type(quant_method).__name__ == QUANT_ADAPTER:
        return quant_method.quant_method
    return quant_method


def layer_view(routed_experts: Any, num_slots: int):
    """The view of one MoE layer's movable expert tensors (``get_eplb_weight_views``).

    Raises:
        UnsupportedWeightFormat: an unknown scheme, a tensor count the scheme does not return,
            mixed stacked and list tensors, or an expert count other than ``num_slots``.
    """
    quant_method = routed_experts.quant_method
    scheme = scheme_of(quant_method)
    fmt = FORMATS.get(type(scheme).__name__)
    if fmt is None:
        raise UnsupportedWeightFormat(
            type(scheme).__name__,
            f"eplb-graph moves vllm-ascend's {sorted(FORMATS)} expert weights only",
        )
    tensors = list(quant_method.get_eplb_weight_views(routed_experts))
    named = dict(zip(fmt.names_for(len(tensors)), tensors, strict=True))
    lists = [isinstance(t, (list, tuple)) for t in tensors]
    if all(lists):
        view = ExpertListView(fmt.name, named)
    elif not any(lists):
        view = StridedPackedView(named, expert_dim=0, format_name=fmt.name)
    else:
        raise UnsupportedWeightFormat(fmt.name, "some tensors are per-expert lists, some stacked")
    if view.num_slots != num_slots:
        raise UnsupportedWeightFormat(
            fmt.name, f"{view.num_slots} experts on this rank, expected {num_slots} slots"
        )
    return view
