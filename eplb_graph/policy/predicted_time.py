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
    if load.ndim != 2:
        raise ValueError(f"per_step must be [L, N], got {tuple(load.shape)}")
    num_layers, num_logical = load.shape
    if num_slots < num_logical or num_slots % num_ranks:
        raise ValueError(
            f"{num_slots} slots cannot hold {num_logical} experts on {num_ranks} ranks"
        )
    cap = max(1, min(max_replicas, num_ranks))
    budgets = _budgets(num_slots - num_logical)
    copies = _replicate(load, num_slots, budgets, cap)  # [L, B, N]
    rows, peaks = _pack(
        np.repeat(load, len(budgets), axis=0),
        copies.reshape(num_layers * len(budgets), num_logical),
        num_ranks,
        model,
    )
    rows = rows.reshape(num_layers, len(budgets), num_slots)
    peaks = peaks.reshape(num_layers, len(budgets))
    table = np.empty((num_layers, num_slots), dtype=np.int64)
    for layer in range(num_layers):
        best = 0  # the smallest budget among those within 1e-9 µs of the fastest, in order
        for index in range(1, len(budgets)):
            if peaks[layer, index] < peaks[layer, best] - 1e-9:
                best = index
        table[layer] = rows[layer, best]
    return torch.from_numpy(table)


def _budgets(extra: int) -> list[int]:
    """0, every power of two below ``extra``, and ``extra``: the few budgets worth comparing."""
    values = {0, extra}
    step = 1
    while step < extra:
        values.add(step)
        step *= 2
    return sorted(values)


def _replicate(load: np.ndarray, num_slots: int, budgets: list[int], cap: int) -> np.ndarray:
    """Copies per expert ``[L, B, N]``: for each budget, that many to the hottest per copy (one
    at a time, all layers at once; a smaller budget's copies are a prefix of a larger one's), the
    rest of the slots to the coldest."""
    num_layers, num_logical = load.shape
    layers = np.arange(num_layers)
    copies = np.ones((num_layers, num_logical), dtype=np.int64)
    out = np.empty((num_layers, len(budgets), num_logical), dtype=np.int64)
    given = 0
    for index, budget in enumerate(budgets):
        for _ in range(budget - given):
            per_copy = np.where(copies < cap, load / copies, -1.0)
            expert = per_copy.argmax(axis=1)
            room = per_copy[layers, expert] >= 0  # a layer with every expert at the cap stops
            copies[layers[room], expert[room]] += 1
        given = budget
        out[:, index] = copies
    coldest = np.argsort(load, axis=1, kind="stable")
    for layer in range(num_layers):
        for index in range(len(budgets)):
            row = out[layer, index]
            left = num_slots - int(row.sum())
            while left:  # one more copy of each coldest expert in turn (more only if all full)
                room = coldest[layer][row[coldest[layer]] < cap]
                if not room.size:
                    room = coldest[layer]
                row[room[:left]] += 1
                left -= min(left, room.size)
    return out


def _pack(
    load: np.ndarray, copies: np.ndarray, num_ranks: int, model: ExpertCostModel
) -> tuple[np.ndarray, np.ndarray]:
    """Slots of ``copies [M, N]`` (each row summing to ``P``) packed onto ranks, every row at
    once: longest predicted slot first (ties by expert id), each to the least loaded rank with
    room that does not hold the expert yet (any rank with room if all hold it). Returns the rows
    ``[M, P]`` (each rank's experts ascending, ranks in order) and each row's predicted peak.

    The loop runs over slot positions, not over rows: a DeepSeek-V3-sized plan (58 layers x 7
    budgets) is one pass of ``P`` small array steps instead of 400 Python packings, which matters
    because planning shares the interpreter with the serving thread.
    """
    num_rows, num_logical = load.shape
    num_slots = int(copies[0].sum())
    per_rank = num_slots // num_ranks
    experts = np.repeat(np.tile(np.arange(num_logical), num_rows), copies.ravel())
    experts = experts.reshape(num_rows, num_slots)
    rows = np.take_along_axis(load / copies, experts, axis=1)
    cost = model.row_us * rows + model.read_us * (1.0 - np.exp(-rows))
    order = np.lexsort((experts, -cost), axis=-1)
    experts = np.take_along_axis(experts, order, axis=1)
    cost = np.take_along_axis(cost, order, axis=1)
    every = np.arange(num_rows)
    ranks = np.arange(num_ranks)
    rank_time = np.zeros((num_rows, num_ranks))
    rank_fill = np.zeros((num_rows, num_ranks), dtype=np.int64)
    held = np.zeros((num_rows, num_ranks, num_logical), dtype=bool)
    placed = np.empty((num_rows, num_slots), dtype=np.int64)
    for position in range(num_slots):
        expert = experts[:, position]
        open_ranks = rank_fill < per_rank
        free = open_ranks & ~held[every[:, None], ranks[None, :], expert[:, None]]
        allowed = np.where(free.any(axis=1, keepdims=True), free, open_ranks)
        rank = np.where(allowed, rank_time, np.inf).argmin(axis=1)  # ties: the lowest rank
        rank_time[every, rank] += cost[:, position]
        rank_fill[every, rank] += 1
        held[every, rank, expert] = True
        placed[:, position] = rank
    by_rank = np.lexsort((experts, placed), axis=-1)
    return np.take_along_axis(experts, by_rank, axis=1), rank_time.max(axis=1) + model.fixed_us
