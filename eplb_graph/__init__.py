"""eplb-graph: a graph-capture-first Expert Parallelism Load Balancer for MoE inference.

Importing this package registers ``torch.ops.eplb_graph.*`` (see ``custom_ops``).
"""

from __future__ import annotations

import custom_ops as _custom_ops  # noqa: F401  (registers torch.ops.eplb_graph)
from eplb_graph.errors import EplbError
from eplb_graph.expert_map import ExpertMapError
from eplb_graph.integrations.settings import (
    ConfigError,
    EplbConfig,
    LegacyEplbConfig,
    resolve_eplb_config,
)
from eplb_graph.placement import Placement, PlacementError
from eplb_graph.state import EplbState

__all__ = [
    "ConfigError",
    "EplbConfig",
    "EplbError",
    "EplbState",
    "ExpertMapError",
    "LegacyEplbConfig",
    "Placement",
    "PlacementError",
    "resolve_eplb_config",
]
__version__ = "0.1.0"
