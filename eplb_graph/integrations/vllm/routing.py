"""vLLM's routing hook, served by ``torch.ops.eplb_graph.map_and_record``.

vLLM's router calls the module global ``eplb_map_to_physical_and_record`` (looked up at call
time) with the layer's EPLB tensors, which the runner glue points at rows of eplb-graph's
``EplbState``. On CPU the MoE forward is traced, so this function lands inside vLLM's single
compiled graph as one custom op per MoE layer, every tensor a graph input: commits written in
place are seen without recompiling.

vLLM's hook has no offset argument; the per-step replica offset is the one tensor the runner
glue binds here (:func:`bind_offset`), shared by every layer of the process.
"""

from __future__ import annotations

import torch

_offset: torch.Tensor | None = None


def bind_offset(offset: torch.Tensor) -> None:
    """Route with ``offset`` (``EplbState.offset``, 0-d int64, advanced in place per step)."""
    global _offset
    _offset = offset


def map_and_record(
    topk_ids: torch.Tensor,
    expert_load_view: torch.Tensor,
    logical_to_physical_map: torch.Tensor,
    logical_replica_count: torch.Tensor,
    record_enabled: torch.Tensor,
    num_unpadded_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logical ``topk_ids [T, K]`` -> physical slots, counting executed load (vLLM's contract)."""
    if _offset is None or num_unpadded_tokens is None:
        raise RuntimeError(
            "eplb-graph's routing hook was called before the runner bound its EPLB state"
        )
    return torch.ops.eplb_graph.map_and_record(
        topk_ids,
        logical_to_physical_map,
        logical_replica_count,
        _offset,
        expert_load_view,
        num_unpadded_tokens,
        record_enabled,
    )


def install() -> None:
    from eplb_graph.integrations.vllm.compat import ROUTING_HOOK

    owner, name, current = ROUTING_HOOK.owner_and_value()
    if current is not map_and_record:
        setattr(owner, name, map_and_record)
