"""Budgeted local search of ``"churn_aware"``: restore replicas, then edit while the peak drops.

Every step runs on all layers still searching at once with numpy; Python loops only over steps.
A transfer is an (expert, rank) pair present in the new placement but not on that rank in the
old one (exactly :func:`eplb_graph.policy.preserve.transfers_needed`); an edit that undoes an
earlier one refunds it. Experts never move between slots of one rank, so no other slot changes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from eplb_graph.policy.churn_aware.edits import (
    choose,
    exact_rank_loads,
    holder_peaks,
    others_after_drop,
    shortlist,
)
from eplb_graph.policy.churn_aware.step import SearchState, Step

__all__ = ["TransferBudget", "local_search", "restore_replicas_"]


def _fits_total(
    priority: np.ndarray, cost: np.ndarray, wanted: np.ndarray, left: int
) -> np.ndarray:
    """Which wanted edits fit a global budget of ``left`` transfers, highest priority first."""
    positive = np.where(wanted, np.maximum(cost, 0), 0)
    order = np.argsort(-np.where(wanted, priority, -np.inf), kind="stable")
    fits = np.zeros_like(wanted)
    fits[order] = np.cumsum(positive[order]) <= left
    return fits & wanted


class TransferBudget:
    """Transfers spent per layer against a per-layer cap and an optional global cap."""

    def __init__(self, num_layers: int, per_layer: int, total: int | None) -> None:
        self.per_layer = per_layer
        self.spent = np.zeros(num_layers, dtype=np.int64)
        self.total_left = total

    def left(self, rows: np.ndarray) -> np.ndarray:
        left = self.per_layer - self.spent[rows]
        return left if self.total_left is None else np.minimum(left, self.total_left)

    def exhausted(self) -> bool:
        return self.total_left is not None and self.total_left <= 0

    def admit(self, priority: np.ndarray, cost: np.ndarray, wanted: np.ndarray) -> np.ndarray:
        if self.total_left is None:
            return wanted
        return _fits_total(priority, cost, wanted, self.total_left)

    def charge_(self, layers: np.ndarray, cost: np.ndarray) -> None:
        self.spent[layers] += cost
        if self.total_left is not None:
            self.total_left -= int(cost.sum())


def _searching(active: np.ndarray, budget: TransferBudget, steps: int) -> Iterator[np.ndarray]:
    """The layers still searching (``active``), once per step, for at most ``steps`` steps;
    stops early when none is left or the global budget is spent."""
    for _ in range(steps):
        if budget.exhausted():
            return
        rows = np.flatnonzero(active)
        if rows.size == 0:
            return
        yield rows


def _retire(active: np.ndarray, rows: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """Stop the layers ``rows[~wanted]`` searching; return the positions in ``rows`` that go on."""
    active[rows[~wanted]] = False
    return np.flatnonzero(wanted)


def restore_replicas_(
    state: SearchState,
    load: np.ndarray,
    replica_cap: np.ndarray,
    budget: TransferBudget,
    replica_load: np.ndarray | None = None,
) -> None:
    """Step 2 of :mod:`eplb_graph.policy.churn_aware` (in place): replicas back to experts above
    the cap.

    Each step, per layer, the expert with the highest per-replica load above ``replica_cap``
    (both measured on ``replica_load``, default ``load``) takes a slot from an expert that can
    spare one (>= 2 replicas, still <= cap after the drop) on a rank not holding it; of those
    slots, the one whose rank (and the donor's other holders) end up coolest, then the cheapest.
    """
    num_layers = state.phy2log.shape[0]
    active = np.ones(num_layers, dtype=bool)
    for rows in _searching(active, budget, budget.per_layer):
        step = Step(state, rows, load, budget.left(rows), replica_cap, replica_load)
        grow = step.cap_per_replica.argmax(axis=1)
        excess = step.cap_per_replica[step.index, grow] - replica_cap[rows]
        slot_rank = np.broadcast_to(state.slot_rank, step.phy2log.shape)
        cost = step.add_cost(grow[:, None], slot_rank) - step.refund(step.phy2log, slot_rank)
        valid = (
            np.take_along_axis(step.droppable, step.phy2log, 1)
            & ~step.holds(grow[:, None], slot_rank)
            & (cost <= step.left[:, None])
        )
        grown = (step.load[step.index, grow] / (step.count[step.index, grow] + 1))[:, None]
        own = step.rank_load[:, state.slot_rank] - step.slot_load + grown
        others = others_after_drop(step, holder_peaks(step), step.phy2log, slot_rank)
        score = np.where(valid, np.maximum(own, others), np.inf)
        slot = np.lexsort((cost, score), axis=1)[:, 0]
        chosen_cost = cost[step.index, slot]
        wanted = budget.admit(excess, chosen_cost, (excess > 0) & valid[step.index, slot])
        take = _retire(active, rows, wanted)
        if take.size == 0:
            break
        state.reassign_(rows[take], slot[take], grow[take])
        budget.charge_(rows[take], chosen_cost[take])


def local_search(
    load: np.ndarray,
    old_phy2log: np.ndarray,
    num_ranks: int,
    budget_per_layer: int,
    total_budget: int | None = None,
    replica_cap: np.ndarray | None = None,
    per_kind: int = 8,
    max_steps: int | None = None,
    replica_load: np.ndarray | None = None,
) -> np.ndarray:
    """Budgeted peak-lowering edits from ``old_phy2log`` (:mod:`eplb_graph.policy.churn_aware`,
    steps 2-4).

    Args:
        load: ``[L, N]`` predicted load per expert.
        old_phy2log: ``[L, P]`` installed placement (every expert present).
        num_ranks: EP ranks.
        budget_per_layer: transfers allowed per layer.
        total_budget: transfers allowed over all layers (None: no global cap); when the layers'
            proposals exceed it, the largest peak reductions per transfer go first.
        replica_cap: ``[L]`` per-replica load cap (step 2); None skips step 2 and lets edits
            drop any spare replica.
        per_kind: edits per kind that are scored exactly each step.
        max_steps: cap on search steps (default ``4 * budget_per_layer + 16``; every step lowers
            a layer's peak, so the cap only bounds time spent on free edits).
        replica_load: ``[L, N]`` load that ``replica_cap`` and replica drops are measured on
            (default ``load``); the policy passes a more strongly hedged load (step 2).

    Returns:
        ``[L, P]`` int64, with ``transfers_needed(old, new) <= budget_per_layer`` per layer and
        their sum ``<= total_budget``.
    """
    num_layers = old_phy2log.shape[0]
    state = SearchState.start(old_phy2log, load.shape[1], num_ranks)
    budget = TransferBudget(num_layers, budget_per_layer, total_budget)
    if replica_cap is None:
        drop_cap = np.full(num_layers, np.inf)
    else:
        drop_cap = replica_cap
        restore_replicas_(state, load, replica_cap, budget, replica_load)
    active = np.ones(num_layers, dtype=bool)
    steps = max_steps if max_steps is not None else 4 * budget_per_layer + 16
    for rows in _searching(active, budget, steps):
        step = Step(state, rows, load, budget.left(rows), drop_cap, replica_load)
        cand = shortlist(step, per_kind)
        best, improves, gain = choose(step.rank_load, exact_rank_loads(step, cand), cand)
        cost = cand.cost[step.index, best]
        improves = budget.admit(gain / (np.maximum(cost, 0) + 0.5), cost, improves)
        take = _retire(active, rows, improves)
        if take.size == 0:
            break
        slots, experts = cand.slots[take, best[take]], cand.experts[take, best[take]]
        for t in range(slots.shape[1]):
            used = slots[:, t] >= 0
            state.reassign_(rows[take][used], slots[used, t], experts[used, t])
        budget.charge_(rows[take], cost[take])
    return state.phy2log
