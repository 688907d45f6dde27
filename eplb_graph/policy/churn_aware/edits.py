"""Candidate edits of ``"churn_aware"``'s local search, scored around each layer's hottest rank.

Three kinds, each a family of every possible edit of that kind with a cheap bound on the
layer's new peak (``inf`` where not allowed: invalid, over budget, or not lowering the peak):

- *swap*: exchange an expert on the hot rank with an expert on another rank (counts kept);
- *shed*: re-point a slot on the hot rank from an expert with a spare replica to another expert;
- *spread*: re-point a slot on another rank from an expert with a spare replica to an expert on
  the hot rank, adding a replica that lowers every rank holding it.

The best few of each kind by bound are shortlisted (:func:`shortlist`), scored exactly
(:func:`exact_rank_loads`), and one is chosen per layer (:func:`choose`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from eplb_graph.policy.churn_aware.step import Step

__all__ = [
    "Candidates",
    "choose",
    "exact_rank_loads",
    "holder_peaks",
    "others_after_drop",
    "shortlist",
]

_SWAP, _SHED, _SPREAD = 0, 1, 2
_RELATIVE_TOLERANCE = 1e-9  # an edit must lower the peak by more than this fraction of it


@dataclass(frozen=True)
class _Family:
    """One kind of edit: ``score``/``cost`` ``[A, X]`` (``inf`` score: not allowed) and a decoder
    from chosen columns ``[A, k]`` to assignments ``(slots, experts)``, each ``[A, k, 2]``
    (slot ``slots[..., t]`` gets ``experts[..., t]``; -1 where unused)."""

    kind: int
    score: np.ndarray
    cost: np.ndarray
    decode: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def _assignments(*pairs: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Stack one or two (slot, expert) ``[A, k]`` pairs into ``[A, k, 2]``, -1 padded."""
    slots = [slot for slot, _ in pairs]
    experts = [expert for _, expert in pairs]
    pad = np.full_like(slots[0], -1)
    while len(slots) < 2:
        slots.append(pad)
        experts.append(pad)
    return np.stack(slots, axis=2), np.stack(experts, axis=2)


def _allowed(step: Step, valid: np.ndarray, score: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """``score`` where an edit is valid, affordable and lowers the peak below today's; else inf."""
    shape = (-1,) + (1,) * (score.ndim - 1)
    peak = step.rank_load[step.index, step.by_load[:, 0]].reshape(shape)
    ok = valid & (cost <= step.left.reshape(shape)) & (score < peak)
    return np.where(ok, score, np.inf).reshape(score.shape[0], -1)


def _swaps(step: Step) -> _Family:
    """Hot slot i (expert a) <-> slot j (expert b) on another rank: ``[A, s * P]``."""
    hot = step.by_load[:, 0]
    hot_slots = step.rank_slots(hot[:, None])  # [A, s]
    a = np.take_along_axis(step.phy2log, hot_slots, 1)[:, :, None]
    a_load = np.take_along_axis(step.slot_load, hot_slots, 1)[:, :, None]
    b, b_load = step.phy2log[:, None, :], step.slot_load[:, None, :]
    other = step.slot_rank[None, None, :]
    hot3 = hot[:, None, None]
    valid = (other != hot3) & (a != b) & ~step.holds(b, hot3) & ~step.holds(a, other)
    cost = (
        step.add_cost(b, hot3)
        + step.add_cost(a, other)
        - step.refund(a, hot3)
        - step.refund(b, other)
    )
    peak = step.rank_load[step.index, hot][:, None, None]
    other_load = step.rank_load[:, step.slot_rank][:, None, :]
    score = np.maximum(peak - a_load + b_load, other_load + a_load - b_load)
    width = step.phy2log.shape[1]

    def decode(column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        hot_slot = np.take_along_axis(hot_slots, column // width, 1)
        other_slot = column % width
        hot_expert = np.take_along_axis(step.phy2log, hot_slot, 1)
        other_expert = np.take_along_axis(step.phy2log, other_slot, 1)
        return _assignments((hot_slot, other_expert), (other_slot, hot_expert))

    return _Family(
        _SWAP, _allowed(step, valid, score, cost), cost.reshape(cost.shape[0], -1), decode
    )


def holder_peaks(step: Step) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per expert, the load of the hottest and second-hottest rank holding it.

    Returns:
        ``top_load [A, N]``, ``top_rank [A, N]`` and ``second_load [A, N]`` (``-inf`` / -1 where
        an expert has fewer holders). They bound how much an edit that drops one replica of an
        expert raises the hottest of the expert's *other* holders.
    """
    num_rows, num_logical = step.load.shape
    num_ranks = step.rank_load.shape[1]
    position = np.argsort(step.by_load, axis=1)  # 0 = hottest
    slot_position = position[:, step.slot_rank]
    order = np.argsort(step.phy2log * num_ranks + slot_position, axis=1)
    expert = np.take_along_axis(step.phy2log, order, 1)
    rank = step.slot_rank[order]
    value = np.take_along_axis(step.rank_load, rank, 1)
    first = np.ones_like(expert, dtype=bool)
    first[:, 1:] = expert[:, 1:] != expert[:, :-1]
    second = np.zeros_like(first)
    second[:, 1:] = first[:, :-1] & ~first[:, 1:]
    top_load = np.full((num_rows, num_logical), -np.inf)
    top_rank = np.full((num_rows, num_logical), -1, dtype=np.int64)
    second_load = np.full((num_rows, num_logical), -np.inf)
    rows, cols = np.nonzero(first)
    top_load[rows, expert[rows, cols]] = value[rows, cols]
    top_rank[rows, expert[rows, cols]] = rank[rows, cols]
    rows, cols = np.nonzero(second)
    second_load[rows, expert[rows, cols]] = value[rows, cols]
    return top_load, top_rank, second_load


def others_after_drop(
    step: Step, peaks: tuple[np.ndarray, ...], expert: np.ndarray, excluded: np.ndarray
) -> np.ndarray:
    """Load of the hottest holder of ``expert`` other than rank ``excluded`` once the expert has
    one replica fewer (``[A, k]`` inputs)."""
    top_load, top_rank, second_load = (np.take_along_axis(p, expert, 1) for p in peaks)
    raised = np.take_along_axis(step.after_drop - step.per_replica, expert, 1)
    return np.where(top_rank == excluded, second_load, top_load) + raised


def _sheds(step: Step, peaks: tuple[np.ndarray, ...]) -> _Family:
    """Hot slot i drops expert a (a spare replica) for expert e absent from the hot rank:
    ``[A, s * N]``."""
    hot = step.by_load[:, 0]
    hot_slots = step.rank_slots(hot[:, None])
    a = np.take_along_axis(step.phy2log, hot_slots, 1)
    a_load = np.take_along_axis(step.slot_load, hot_slots, 1)[:, :, None]
    on_hot = step.holds(np.arange(step.load.shape[1])[None, :], hot[:, None])  # [A, N]
    valid = np.take_along_axis(step.droppable, a, 1)[:, :, None] & ~on_hot[:, None, :]
    cost = (
        step.add_cost(np.arange(step.load.shape[1])[None, None, :], hot[:, None, None])
        - step.refund(a, hot[:, None])[:, :, None]
    )
    added = (step.load / (step.count + 1))[:, None, :]
    peak = step.rank_load[step.index, hot][:, None, None]
    score = np.maximum(
        peak - a_load + added, others_after_drop(step, peaks, a, hot[:, None])[:, :, None]
    )
    width = step.load.shape[1]

    def decode(column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _assignments((np.take_along_axis(hot_slots, column // width, 1), column % width))

    return _Family(
        _SHED, _allowed(step, valid, score, cost), cost.reshape(cost.shape[0], -1), decode
    )


def _spreads(step: Step, peaks: tuple[np.ndarray, ...]) -> _Family:
    """Slot j on another rank drops expert b (a spare replica) for a hot-rank expert a, giving a
    one more replica: ``[A, s * P]``."""
    hot = step.by_load[:, 0]
    hot_slots = step.rank_slots(hot[:, None])
    a = np.take_along_axis(step.phy2log, hot_slots, 1)[:, :, None]
    a_load = np.take_along_axis(step.slot_load, hot_slots, 1)[:, :, None]
    a_added = np.take_along_axis(step.load / (step.count + 1), a[:, :, 0], 1)[:, :, None]
    a_on_hot = step.holds(a, hot[:, None, None])  # no duplicates are created, so 1 copy
    b, b_load = step.phy2log[:, None, :], step.slot_load[:, None, :]
    other = step.slot_rank[None, None, :]
    valid = (
        (other != hot[:, None, None])
        & np.take_along_axis(step.droppable, step.phy2log, 1)[:, None, :]
        & (a != b)
        & ~step.holds(a, other)
    )
    cost = step.add_cost(a, other) - step.refund(b[:, 0, :], step.slot_rank[None, :])[:, None, :]
    peak = step.rank_load[step.index, hot][:, None, None]
    other_load = step.rank_load[:, step.slot_rank][:, None, :]
    dropped = others_after_drop(
        step, peaks, step.phy2log, np.broadcast_to(step.slot_rank, step.phy2log.shape)
    )
    score = np.maximum(
        np.maximum(peak - a_on_hot * (a_load - a_added), other_load - b_load + a_added),
        dropped[:, None, :],
    )
    width = step.phy2log.shape[1]

    def decode(column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        expert = np.take_along_axis(
            step.phy2log, np.take_along_axis(hot_slots, column // width, 1), 1
        )
        return _assignments((column % width, expert))

    return _Family(
        _SPREAD, _allowed(step, valid, score, cost), cost.reshape(cost.shape[0], -1), decode
    )


@dataclass(frozen=True)
class Candidates:
    """``[A, K]`` shortlisted edits: ``kind``, ``cost`` (change in transfers), ``valid``, and
    assignments ``slots`` / ``experts`` ``[A, K, 2]`` (-1 where unused)."""

    kind: np.ndarray
    cost: np.ndarray
    valid: np.ndarray
    slots: np.ndarray
    experts: np.ndarray


def shortlist(step: Step, per_kind: int) -> Candidates:
    """The ``per_kind`` best edits of every kind by their cheap bound, per active layer."""
    peaks = holder_peaks(step)
    families = (_swaps(step), _sheds(step, peaks), _spreads(step, peaks))
    parts = []
    for family in families:
        k = min(per_kind, family.score.shape[1])
        column = np.argpartition(family.score, k - 1, axis=1)[:, :k]
        slots, experts = family.decode(column)
        parts.append(
            (
                np.full(column.shape, family.kind),
                np.take_along_axis(family.cost, column, 1),
                np.isfinite(np.take_along_axis(family.score, column, 1)),
                slots,
                experts,
            )
        )
    kind, cost, valid, slots, experts = (
        np.concatenate(p, axis=1) for p in zip(*parts, strict=True)
    )
    return Candidates(kind, cost, valid, slots, experts)


def exact_rank_loads(step: Step, cand: Candidates) -> np.ndarray:
    """``[A, K, ranks]``: every rank's load after each candidate edit.

    Swaps keep replica counts, so each assignment (slot s: o -> n) adds
    ``u_n - u_o`` to the rank of s. A re-point (shed, spread) changes the per-replica load of
    o and n on every rank holding them: ``delta[r] = on[o, r] (u'_o - u_o) + on[n, r] (u'_n -
    u_n)``, plus ``u'_n - u'_o`` on the slot's own rank.
    """
    index = step.index[:, None]
    k_index = np.arange(cand.kind.shape[1])[None, :]
    used = cand.valid[:, :, None] & (cand.slots >= 0)
    slots = np.where(used, cand.slots, 0)
    new = np.where(used, cand.experts, 0)
    old = np.take_along_axis(step.phy2log, slots.reshape(slots.shape[0], -1), 1).reshape(
        slots.shape
    )
    ranks = step.slot_rank[slots]
    # Count-preserving kinds.
    delta = np.zeros(cand.kind.shape + step.rank_load.shape[1:])
    moved = np.take_along_axis(step.per_replica[:, None, :], new, 2) - np.take_along_axis(
        step.per_replica[:, None, :], old, 2
    )
    for t in range(slots.shape[2]):
        delta[index, k_index, ranks[:, :, t]] += np.where(used[:, :, t], moved[:, :, t], 0.0)
    # Re-points: the first assignment only.
    o, n, rank = old[:, :, 0], new[:, :, 0], ranks[:, :, 0]
    on = step.on_rank
    o_before, n_before = step.per_replica[index, o], step.per_replica[index, n]
    o_after = step.load[index, o] / np.maximum(step.count[index, o] - 1, 1)
    n_after = step.load[index, n] / (step.count[index, n] + 1)
    repoint = (
        on[index, o] * (o_after - o_before)[:, :, None]
        + on[index, n] * (n_after - n_before)[:, :, None]
    )
    repoint[index, k_index, rank] += n_after - o_after
    delta = np.where((cand.kind == _SWAP)[:, :, None], delta, repoint)
    return step.rank_load[:, None, :] + delta


def choose(
    rank_load: np.ndarray, new_rank_load: np.ndarray, cand: Candidates
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each layer's edit: largest peak reduction per transfer, then the coolest touched rank.

    Returns:
        ``best [A]`` candidate column, ``improves [A]`` bool, ``gain [A]`` peak reduction.
    """
    peak = rank_load.max(axis=1)
    gain = peak[:, None] - new_rank_load.max(axis=2)
    improves = cand.valid & (gain > _RELATIVE_TOLERANCE * peak[:, None])
    # Free edits (undoing an earlier transfer) weigh as half a transfer.
    efficiency = np.where(improves, gain / (np.maximum(cand.cost, 0) + 0.5), -np.inf)
    touched = new_rank_load != rank_load[:, None, :]
    touched_peak = np.where(touched, new_rank_load, -np.inf).max(axis=2)
    best = np.lexsort((touched_peak, -efficiency), axis=1)[:, 0]
    rows = np.arange(rank_load.shape[0])
    return best, improves[rows, best], gain[rows, best]
