"""Post-pass: no expert gets more copies than there are ranks, when the slot count allows it.

A copy beyond one per rank lands on a rank that already holds the expert: the routing op spreads
the expert's tokens over all its copies, so that rank just carries a larger share of the same
expert, and the slot could have held another expert instead. Such a plan also cannot be written
as an expert map (vllm-ascend's schema holds at most one copy of an expert per device), so
``eplb-graph map write`` and record mode could not save what ``simulate`` would happily replay.
Packing by load alone produces it: DeepSeek's replication gives a hot expert as many copies as
its load asks for (3 copies of one expert on 2 ranks).

:func:`cap_replicas` gives each copy beyond ``num_ranks`` (one on a rank holding the expert twice)
to the expert with the highest load per copy among those with fewer than ``num_ranks`` copies,
preferring one the slot's rank does not hold yet. (Choosing the move that leaves the lowest peak
instead was measured worse once the spread pass has re-packed: 0.27% against 0.12% balancedness
lost on the skewed cases of ``tests/test_policy_spread.py``.)

The price of the rule: a third copy of a hot expert on two ranks splits its load 2:1, a finer
step than one copy per rank allows, so capped plans are on average about 0.1% less balanced on
those skewed cases (``default`` 0.978 -> 0.977, ``swift_balance`` and ``churn_aware`` -0.06%).
It only edits layers that need it, and only when the layer has room: with ``P > N x ranks``
slots a duplicate on some rank is unavoidable (:func:`replica_room_problem` says so, for the
commands to refuse such a shape up front). The spread post-pass (``policy/spread.py``) then moves
any remaining second copy on one rank to another rank.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["cap_replicas", "replica_room_problem"]


def replica_room_problem(num_experts: int, num_slots: int, num_ranks: int) -> str | None:
    """Why ``num_slots`` slots over ``num_ranks`` ranks cannot hold ``num_experts`` experts with
    at most one copy of an expert per rank (``None`` when they can)."""
    if num_slots <= num_experts * num_ranks:
        return None
    return (
        f"{num_slots} slots for {num_experts} experts on {num_ranks} ranks put a second copy "
        f"of some expert on one rank (at most {num_experts * num_ranks} slots fit, one copy of "
        "each expert per rank), and an expert map holds at most one copy of an expert per "
        "device"
    )


def cap_replicas(
    phy2log: torch.Tensor, logical_load: torch.Tensor | np.ndarray, num_ranks: int
) -> torch.Tensor:
    """``phy2log [L, P]`` with no expert holding more than ``num_ranks`` copies, where possible.

    Args:
        phy2log: ``[L, P]`` int64 plan.
        logical_load: ``[L, N]`` load per logical expert the plan was made for.
        num_ranks: EP ranks.

    Returns:
        the plan itself when no layer needs a change, else an edited copy (replica counts of the
        over-copied experts drop to ``num_ranks``; the freed slots go to the hottest experts per
        copy).
    """
    load = np.asarray(logical_load, dtype=np.float64)
    num_experts = load.shape[1]
    table = phy2log.detach().cpu().numpy().astype(np.int64, copy=True)
    num_slots = table.shape[1]
    if replica_room_problem(num_experts, num_slots, num_ranks) is not None:
        return phy2log
    per_rank = num_slots // num_ranks
    changed = False
    for row, layer_load in zip(table, load, strict=True):
        counts = np.bincount(row, minlength=num_experts)
        while counts.max() > num_ranks:
            changed = True
            expert = int(counts.argmax())
            slot = _surplus_slot(row, expert, per_rank)
            rank = slot // per_rank
            on_rank = set(row[rank * per_rank : (rank + 1) * per_rank].tolist())
            per_copy = layer_load / np.maximum(counts, 1)
            candidates = np.flatnonzero(counts < num_ranks).tolist()
            receiver = min(candidates, key=lambda e: (e in on_rank, -per_copy[e], e))
            row[slot] = receiver
            counts[expert] -= 1
            counts[receiver] += 1
    return torch.from_numpy(table) if changed else phy2log


def _surplus_slot(row: np.ndarray, expert: int, per_rank: int) -> int:
    """A copy of ``expert`` to give away: the last one on the rank holding the most copies."""
    slots = np.flatnonzero(row == expert)
    ranks = slots // per_rank
    held = np.bincount(ranks)
    return int(slots[ranks == held.argmax()][-1])
