"""Synchronous rearrangement: the comparison path (``use_async=False``), on the calling thread.

Every rank calls :func:`rearrange_sync_` at the same step with the same plan. Layer by layer it
stages, exchanges over ``group`` and installs, then commits the lookup. Serving is stalled for
the duration (what upstream's sync EPLB does); use it to compare against the async path, or
where a stall is acceptable. A failure raises after restoring nothing: layers already committed
stay new, the failing layer and the rest stay old (the same per-layer atomicity as async).
"""

from __future__ import annotations

import torch

from eplb_graph.movement.communicator import GlooStagedCommunicator, install_layer_, stage_reads_
from eplb_graph.movement.planner import plan_transfer
from eplb_graph.movement.staging import StagingPool
from eplb_graph.state import EplbState


def rearrange_sync_(
    state: EplbState,
    views,
    new_phy2log: torch.Tensor,
    group,
    rank: int,
    pool: StagingPool,
    *,
    timeout_s: float = 60.0,
    max_batch_ops: int = 32,
) -> list[int]:
    """Move weights and commit every changed layer now; returns the layers committed."""
    _, old = state.committed_snapshot()
    communicator = GlooStagedCommunicator(
        group, rank, max_batch_ops=max_batch_ops, timeout_s=timeout_s
    )
    committed = []
    for layer in range(state.num_layers):
        if torch.equal(old[layer], new_phy2log[layer]):
            continue
        plan = plan_transfer(old[layer], new_phy2log[layer], state.num_ranks)
        prepared = state.prepare_layer(layer, new_phy2log[layer])
        block = pool.acquire(layer, timeout=timeout_s)
        if block is None:
            raise TimeoutError("no free staging block")
        try:
            rank_plan = plan.ranks[rank]
            stage_reads_(views[layer], rank_plan, block)
            communicator.exchange(plan, block, tag_base=layer * 1_000_003 % (1 << 30))
            install_layer_(views[layer], rank_plan, block)
            state.commit_prepared_(layer, prepared)
        finally:
            pool.release(block)
        committed.append(layer)
    return committed
