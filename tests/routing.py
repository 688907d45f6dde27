"""Drive a state's load recording the way a routed MoE forward does, for control-plane tests."""

from __future__ import annotations

import torch

from eplb_graph.state import EplbState


def route_and_record(state: EplbState, ids: torch.Tensor) -> None:
    """Route logical ``ids [T, K]`` through every layer with ``map_and_record`` (load recorded
    only where the state's step knobs say so, exactly as in a compiled model)."""
    for layer in range(state.log2phy.shape[0]):
        torch.ops.eplb_graph.map_and_record(
            ids,
            state.log2phy[layer],
            state.replica_count[layer],
            state.offset,
            state.load[layer],
            state.num_valid_tokens,
            state.record_enabled,
        )
