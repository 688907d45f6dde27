"""Placement by predicted time: the busiest rank's expert time, not its row count, is minimised.

Counts-based policies give a hot expert replicas until the rows even out. When a rank's time is
mostly its active experts' weight reads (small decode batches), every replica that receives rows
adds a read on its rank and evening the rows saves little, so the fewest replicas can be the
fastest plan. This packer searches the number of replicas per layer under a fitted
:class:`~eplb_graph.control.cost_model.ExpertCostModel`:

1. for a budget ``b`` of replicas for hot experts (``0 .. P - N``, a handful of values), give
   them one at a time to the expert with the most rows per copy (DeepSeek's replication rule);
   the redundant slots left over hold a second copy of the *coldest* experts, whose slots then
   see almost no rows (a slot must hold some expert; an idle one costs nothing);
2. pack the slots onto ranks, longest predicted slot time first, each to the rank with the least
   predicted time that has room and does not hold that expert yet;
3. keep the budget whose busiest rank is predicted fastest.

Pure numpy on ``[L, N]`` arrays: the planner calls it with the window's average rows per step.
"""

from __future__ import annotations

import numpy as np
import torch

from eplb_graph.control.cost_model import ExpertCostModel

__all__ = ["pack_by_predicted_time"]


def pack_by_predicted_time(
    per_step: torch.Tensor,
    num_slots: int,
    num_ranks: int,
    max_replicas: int,
    model: ExpertCostModel,
) -> torch.Tensor:
    """``phy2log [L, P]`` minimising each layer's predicted busiest-rank time.

    Args:
        per_step: ``[L, N]`` average rows per step of every logical expert.
        num_slots: ``P`` (a multiple of ``num_ranks``, at least ``N``).
        num_ranks: EP ranks.
        max_replicas: the lookup width ``R``: no expert gets more copies.
        model: fitted cost model (coefficients in µs).
    """
    load = torch.as_tensor(per_step).to(torch.float64).numpy()
    num_layers, num_logical = load.shape
    if num_slots < num_logical or num_slots % num_ranks:
        raise ValueError(
            f"{num_slots} slots cannot hold {num_logical} experts on {num_ranks} ranks"
        )
    table = np.empty((num_layers, num_slots), dtype=np.int64)
    cap = max(1, min(max_replicas, num_ranks))
    for layer in range(num_layers):
        best: tuple[float, np.ndarray] | None = None
        for budget in _budgets(num_slots - num_logical):
            copies = _replicate(load[layer], num_slots, budget, cap)
            row, peak = _pack(load[layer], copies, num_ranks, model)
            if best is None or peak < best[0] - 1e-9:
                best = (peak, row)
        table[layer] = best[1]
    return torch.from_numpy(table)


def _budgets(extra: int) -> list[int]:
    """0, every power of two below ``extra``, and ``extra``: the few budgets worth comparing."""
    values = {0, extra}
    step = 1
    while step < extra:
        values.add(step)
        step *= 2
    return sorted(values)


def _replicate(load: np.ndarray, num_slots: int, budget: int, cap: int) -> np.ndarray:
    """Copies per expert: ``budget`` to the hottest per copy, the rest to the coldest."""
    num_logical = load.shape[0]
    copies = np.ones(num_logical, dtype=np.int64)
    for _ in range(budget):
        per_copy = np.where(copies < cap, load / copies, -1.0)
        expert = int(per_copy.argmax())
        if per_copy[expert] < 0:
            break
        copies[expert] += 1
    left = num_slots - int(copies.sum())
    coldest = np.argsort(load, kind="stable")
    while left:  # one more copy of each coldest expert in turn (more only if every one is full)
        room = [int(e) for e in coldest if copies[e] < cap] or [int(e) for e in coldest]
        for expert in room[:left]:
            copies[expert] += 1
        left -= min(left, len(room))
    return copies


def _pack(
    load: np.ndarray, copies: np.ndarray, num_ranks: int, model: ExpertCostModel
) -> tuple[np.ndarray, float]:
    """Slots of ``copies`` packed onto ranks; returns the row ``[P]`` and the predicted peak."""
    experts = np.repeat(np.arange(load.shape[0]), copies)
    rows = load[experts] / copies[experts]
    cost = model.row_us * rows + model.read_us * (1.0 - np.exp(-rows))
    per_rank = experts.shape[0] // num_ranks
    order = np.lexsort((experts, -cost))  # longest first, ties by expert id
    rank_time = np.zeros(num_ranks)
    rank_fill = np.zeros(num_ranks, dtype=np.int64)
    held = [set() for _ in range(num_ranks)]
    members: list[list[int]] = [[] for _ in range(num_ranks)]
    for index in order:
        expert = int(experts[index])
        open_ranks = [r for r in range(num_ranks) if rank_fill[r] < per_rank]
        allowed = [r for r in open_ranks if expert not in held[r]] or open_ranks
        rank = min(allowed, key=lambda r: (rank_time[r], r))
        rank_time[rank] += cost[index]
        rank_fill[rank] += 1
        held[rank].add(expert)
        members[rank].append(expert)
    row = np.array([e for rank in members for e in sorted(rank)], dtype=np.int64)
    return row, float(rank_time.max()) + model.fixed_us
