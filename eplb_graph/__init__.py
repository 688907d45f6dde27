"""eplb-graph: a graph-capture-first Expert Parallelism Load Balancer for MoE inference.

The front door: everything a model-runner integration needs is importable from here.
Importing this package registers ``torch.ops.eplb_graph.*`` (see ``eplb_graph.ops``).

- ``Placement``: which logical expert sits in every physical slot (a value; expert-map files);
- ``EplbState``: the tensors a compiled graph reads, with stable addresses, committed in place;
- ``EplbRuntime``: what a runner calls around every forward (``begin_step`` / ``end_step``);
- ``ControlSettings``, ``MovementSettings``: its plain settings objects;
- ``GroupRing``: the gloo groups EPLB moves weights over (never the serving group);
- ``make_expert_view``: the weight view of one layer's experts, by format;
- ``parse_cli_args``, ``resolve_eplb_config``, ``to_runtime_settings``: vLLM / vllm-ascend EPLB
  settings, validated once and turned into the settings objects above;
- ``EplbError``: the base of every error the package raises on purpose.
"""

from __future__ import annotations

from eplb_graph import ops as _ops  # noqa: F401  (registers torch.ops.eplb_graph)
from eplb_graph.control.settings import ControlSettings
from eplb_graph.errors import EplbError
from eplb_graph.expert_map import ExpertMapError
from eplb_graph.integrations.settings import (
    ConfigError,
    EplbConfig,
    LegacyEplbConfig,
    parse_cli_args,
    resolve_eplb_config,
    to_runtime_settings,
)
from eplb_graph.movement.settings import MovementSettings
from eplb_graph.movement.transport import GroupRing
from eplb_graph.movement.views import make_expert_view, supported_formats
from eplb_graph.placement import Placement
from eplb_graph.runtime import EplbRuntime
from eplb_graph.state import EplbState
from eplb_graph.tables import PlacementError

__all__ = [
    "ConfigError",
    "ControlSettings",
    "EplbConfig",
    "EplbError",
    "EplbRuntime",
    "EplbState",
    "ExpertMapError",
    "GroupRing",
    "LegacyEplbConfig",
    "MovementSettings",
    "Placement",
    "PlacementError",
    "make_expert_view",
    "parse_cli_args",
    "resolve_eplb_config",
    "supported_formats",
    "to_runtime_settings",
]
__version__ = "0.1.0"
