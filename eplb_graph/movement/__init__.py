"""Movement plane: weight views per format and hazard-free transfer plans.

- :mod:`~eplb_graph.movement.views`: the exact storage each fused kernel reads, packed one expert
  per payload and written back in place (invariant 5).
- :mod:`~eplb_graph.movement.planner`: pure, deterministic per-layer transfer plans, identical on
  every rank, with an in-process executor for tests and simulation.

The gloo-staged communicator, the async worker and the commit scheduler live in sibling modules
of this package (``communicator``, ``staging``, ``worker``, ``scheduler``); they are imported
from there directly and are not re-exported here, so importing the pure planning code never pulls
in ``torch.distributed`` machinery.
"""

from __future__ import annotations

from eplb_graph.movement.planner import (
    LocalCopy,
    RankPlan,
    Receive,
    Send,
    TraceEvent,
    TransferPlan,
    TransferPlanError,
    plan_transfer,
)
from eplb_graph.movement.views import (
    ExpertWeightView,
    InternalLayoutView,
    PackedSlotView,
    PayloadSection,
    SlotField,
    StridedPackedView,
    UnquantizedView,
    UnsupportedWeightFormat,
    W4A8View,
    W8A8View,
    WeightViewError,
    from_nd,
    make_expert_view,
    nd_as_nz,
    register_weight_format,
    supported_formats,
    to_nd,
)

__all__ = [
    "ExpertWeightView",
    "InternalLayoutView",
    "LocalCopy",
    "PackedSlotView",
    "PayloadSection",
    "RankPlan",
    "Receive",
    "Send",
    "SlotField",
    "StridedPackedView",
    "TraceEvent",
    "TransferPlan",
    "TransferPlanError",
    "UnquantizedView",
    "UnsupportedWeightFormat",
    "W4A8View",
    "W8A8View",
    "WeightViewError",
    "from_nd",
    "make_expert_view",
    "nd_as_nz",
    "plan_transfer",
    "register_weight_format",
    "supported_formats",
    "to_nd",
]
