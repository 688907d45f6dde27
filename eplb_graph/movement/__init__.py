"""Movement plane: moving expert weights between ranks and committing them between steps.

Rooms, bottom to top:

- ``views``: the exact storage each fused kernel reads, packed one expert per payload and
  written back in place (invariant 5);
- ``planner``: pure, deterministic per-layer transfer plans, identical on every rank, with an
  in-process executor for tests and simulation;
- ``staging``: staging memory handed between threads by ownership, packing sources and
  installing payloads;
- ``transport``: the gloo groups EPLB owns (``GroupRing``) and the batched point-to-point
  exchange;
- ``agreement``: store-decided votes every rank acts on alike;
- ``rebalance``: the one pipeline (reduce, plan, agree, stage, exchange, deliver);
- ``worker``: its asynchronous mode's job loop on a thread;
- ``commit``: the asynchronous commit protocol (publish at an agreed step, fence, install,
  acknowledge) and synchronous mode's install.

This package exports the planning and weight-view API; the runtime pieces are imported from
their modules (``eplb_graph`` exports what a model runner needs).
"""

from __future__ import annotations

from eplb_graph.movement import views
from eplb_graph.movement.planner import TransferPlan, TransferPlanError, plan_transfer
from eplb_graph.movement.views import *  # noqa: F403  (the weight-view API, listed once there)

__all__ = ["TransferPlan", "TransferPlanError", "plan_transfer", *views.__all__]
