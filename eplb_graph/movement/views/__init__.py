"""Weight views: the exact storage a fused MoE kernel reads, one expert slot at a time.

A view packs one expert slot into one byte payload (``pack_slot``) and writes a payload back into
the live storage in place (``unpack_slot_``); the movement plane moves nothing but these payloads.
Formats that cannot keep this contract are rejected by name when the view is built
(:class:`UnsupportedWeightFormat`), never at the first rearrangement.

- :mod:`.contract`: the :class:`ExpertWeightView` protocol and the errors views raise.
- :mod:`.payload`: the payload layout engine, :class:`PackedSlotView`, and its fields.
- :mod:`.nz`: fractal NZ <-> ND conversion (payloads are always ND).
- :mod:`.checks`: the shape, dtype and layout checks the formats state.
- :mod:`.table`: a per-expert format's table of tensors, from which its constructor derives.
- :mod:`.formats`: the concrete formats (unquantized, W8A8, W4A8, strided, internal layout).
- :mod:`.cpu_int8`: vLLM's CPU int8 experts (VNNI-packed weights, compensation, scales).
- :mod:`.cpu_int4`: vLLM's CPU int4 experts (blocked int4 weights, group scales, zero points).
- :mod:`.cpu_fp8`: vLLM's CPU FP8 block experts (packed fp8 weights, 128x128 block scales).
- :mod:`.registry`: format names, :func:`make_expert_view` and :func:`register_weight_format`.
"""

from __future__ import annotations

from eplb_graph.movement.views.contract import (
    ExpertWeightView,
    UnsupportedWeightFormat,
    WeightViewError,
)
from eplb_graph.movement.views.cpu_fp8 import CpuFp8BlockView
from eplb_graph.movement.views.cpu_int4 import CpuInt4PackedView
from eplb_graph.movement.views.cpu_int8 import CpuInt8PackedView
from eplb_graph.movement.views.formats import (
    InternalLayoutView,
    StridedPackedView,
    UnquantizedView,
    W4A8View,
    W8A8View,
)
from eplb_graph.movement.views.nz import from_nd, nd_as_nz, to_nd
from eplb_graph.movement.views.payload import PackedSlotView, PayloadSection, SlotField
from eplb_graph.movement.views.registry import (
    make_expert_view,
    register_weight_format,
    supported_formats,
)

__all__ = [
    "CpuFp8BlockView",
    "CpuInt4PackedView",
    "CpuInt8PackedView",
    "ExpertWeightView",
    "InternalLayoutView",
    "PackedSlotView",
    "PayloadSection",
    "SlotField",
    "StridedPackedView",
    "UnquantizedView",
    "UnsupportedWeightFormat",
    "W4A8View",
    "W8A8View",
    "WeightViewError",
    "from_nd",
    "make_expert_view",
    "nd_as_nz",
    "register_weight_format",
    "supported_formats",
    "to_nd",
]
