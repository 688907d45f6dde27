"""Control plane: batch phases, the load window and the per-step state machine.

- ``phases``: which batches' load is collected;
- ``window``: the device ring of load passes, the per-step state machine that closes it
  (``EplbController``), its snapshots and their cross-rank reduction;
- ``planning``: a reduced window through a registered policy (and what it tells us).

Its settings are :class:`eplb_graph.settings.RuntimeSettings` (one value for both planes).
"""

from eplb_graph.control.phases import BatchPhase, CollectionPhase
from eplb_graph.control.window import (
    EplbController,
    LoadWindow,
    WindowLoad,
    WindowSnapshot,
    local_reducer,
    process_group_reducer,
)

__all__ = [
    "BatchPhase",
    "CollectionPhase",
    "EplbController",
    "LoadWindow",
    "WindowLoad",
    "WindowSnapshot",
    "local_reducer",
    "process_group_reducer",
]
