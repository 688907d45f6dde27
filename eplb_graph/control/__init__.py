"""Control plane: batch phases, the load window and the per-step state machine."""

from eplb_graph.control.controller import (
    EplbController,
    WindowLoad,
    WindowReport,
    balancedness_of_slots,
    local_reducer,
    process_group_reducer,
)
from eplb_graph.control.phases import BatchPhase, CollectionPhase
from eplb_graph.control.settings import ControlSettings
from eplb_graph.control.window import LoadWindow

__all__ = [
    "BatchPhase",
    "CollectionPhase",
    "ControlSettings",
    "EplbController",
    "LoadWindow",
    "WindowLoad",
    "WindowReport",
    "balancedness_of_slots",
    "local_reducer",
    "process_group_reducer",
]
