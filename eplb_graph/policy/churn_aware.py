"""Policy ``"churn_aware"``: the best balance a bounded migration budget can buy.

Why: DeepSeek's planner re-plans from scratch. After a typical window-to-window drift it moves
91-96% of the experts (``shared/research/anchor_numbers.md`` section 4) to restore a balance that
the next drift erodes again anyway. This policy starts from the installed placement and edits it
slot by slot, only while an edit lowers a layer's peak rank load, within a budget of cross-rank
transfers.

Algorithm (every step runs on all layers at once with numpy; Python loops only over steps):

1. **Predictor.** The next window's load per expert is the window's samples averaged with weights
   ``recency_decay ** age`` (the newest sample has age 0), so recent samples count more when the
   popularity drifts. With one sample it is that sample.

   **Drift hedge** (:mod:`eplb_graph.policy.drift`): the plan serves the *next* window, whose
   popularity has drifted by a factor this window cannot see. Given the previous planning
   window's load, the policy measures the window-to-window log drift ``sigma`` and plans on the
   predicted load shrunk in log space by ``beta = s^2 / (s^2 + sigma^2)`` (``s^2``: the layer's
   spread of log load). Without drift nothing changes. On the drifting traces of
   ``docs/benchmarks.md`` this is what puts the next window's balance ahead of a fresh DeepSeek
   plan; without it the budgeted search trails DeepSeek on A1.
2. **Replica counts.** DeepSeek's replication (one slot each, then every spare slot to the
   expert with the highest load per replica) gives the lowest achievable largest per-replica
   load ``u*``, here for the load hedged as if the drift variance were ``replica_hedge`` (3)
   times larger: the counts decide which single replica can turn a rank hot, and the stronger
   hedge measured best on the drifting traces (2x gained less; 4x was no better overall and
   fell behind at sigma 0.4). An expert
   whose per-replica load exceeds ``u* (1 + replica_slack)`` gets replicas back first, taken
   from experts that can spare one. Why: under drift the rank holding the largest single
   replica is the likeliest to become the hottest, since its load follows one expert's
   popularity; an expert that grew since the last plan must not stay concentrated. Later
   edits respect the same cap when they drop a replica.
3. **Local search.** Per layer, around the hottest rank ``h``:

   - *swap*: exchange an expert on ``h`` with an expert on another rank (counts kept);
   - *shed*: re-point a slot on ``h`` from an expert with a spare replica to another expert;
   - *spread*: re-point a slot on another rank from an expert with a spare replica to an expert
     on ``h``, adding a replica that lowers every rank holding it.

   Cheap bounds rank all edits; the best few of each kind are scored exactly (every rank's new
   load, replica counts updated), and the layer applies the edit with the largest reduction of
   its peak per transfer (ties: the coolest touched rank). An edit must strictly lower the
   layer's peak, so the search cannot cycle; it stops when no edit helps or the budget is spent.
4. **Cost.** A transfer is an (expert, rank) pair present in the new placement but not on that
   rank in the old one: exactly :func:`eplb_graph.policy.preserve.transfers_needed`. An edit that
   undoes an earlier one refunds it. Experts never move between slots of one rank, so no other
   slot changes and no slot-preservation pass is needed.
5. **Gating.** A layer whose predicted balancedness (mean / max rank load) gains less than
   ``min_gain`` keeps its old row (moving weights is not free); if the whole placement's predicted
   balancedness gains less than ``min_total_gain``, the old placement is returned unchanged.

Every expert keeps at least one slot (a replica is only dropped from an expert that has another),
and edits never put a second copy of an expert on a rank that already holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from eplb_graph.policy.deepseek import rebalance_experts, replicate_experts
from eplb_graph.policy.drift import estimate_drift, hedge_load, shrinkage
from eplb_graph.policy.registry import normalize_weight, register_policy

__all__ = ["churn_aware_policy", "local_search", "predict_load", "transfer_budget"]

logger = logging.getLogger(__name__)

_SWAP, _SHED, _SPREAD = 0, 1, 2
_RELATIVE_TOLERANCE = 1e-9  # an edit must lower the peak by more than this fraction of it


def predict_load(weight: torch.Tensor | np.ndarray, recency_decay: float) -> np.ndarray:
    """Exponentially time-weighted mean load, the predictor of the next window's load.

    Args:
        weight: ``[S, L, N]`` load samples, oldest first.
        recency_decay: weight multiplier per sample of age, in ``(0, 1]``; 1.0 is the plain mean.

    Returns:
        ``[L, N]`` float64, on the scale of one sample.
    """
    if not 0.0 < recency_decay <= 1.0:
        raise ValueError(f"recency_decay must be in (0, 1], got {recency_decay}")
    samples = np.asarray(
        weight.numpy() if isinstance(weight, torch.Tensor) else weight, dtype=np.float64
    )
    age = np.arange(samples.shape[0] - 1, -1, -1, dtype=np.float64)
    weights = recency_decay**age
    return np.tensordot(weights / weights.sum(), samples, axes=1)


def transfer_budget(
    num_slots: int,
    max_transfer_fraction: float,
    max_bytes: int | None,
    expert_bytes: int | None,
) -> tuple[int, int | None]:
    """Per-layer and whole-placement transfer budgets from the options.

    Returns:
        ``(per_layer, total)``: ``floor(max_transfer_fraction * P)`` transfers per layer, and
        ``floor(max_bytes / expert_bytes)`` for all layers together (None without a byte budget).
    """
    if not 0.0 <= max_transfer_fraction <= 1.0:
        raise ValueError(f"max_transfer_fraction must be in [0, 1], got {max_transfer_fraction}")
    per_layer = int(np.floor(max_transfer_fraction * num_slots + 1e-9))
    if max_bytes is None:
        return per_layer, None
    if expert_bytes is None or expert_bytes <= 0:
        raise ValueError("max_bytes needs expert_bytes > 0 (the bytes of one expert's weights)")
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    return per_layer, int(max_bytes // expert_bytes)


def _rank_loads(phy2log: np.ndarray, load: np.ndarray, num_ranks: int) -> np.ndarray:
    """``[L, ranks]`` rank loads of ``phy2log [L, P]`` under ``load [L, N]`` (even split)."""
    num_layers, num_slots = phy2log.shape
    count = np.zeros(load.shape, dtype=np.int64)
    np.add.at(count, (np.arange(num_layers)[:, None], phy2log), 1)
    per_slot = np.take_along_axis(load / np.maximum(count, 1), phy2log, 1)
    return per_slot.reshape(num_layers, num_ranks, num_slots // num_ranks).sum(axis=2)


@dataclass
class _Search:
    """Mutable state of the search over all layers (internal).

    Attributes:
        phy2log: ``[L, P]`` current placement.
        count: ``[L, N]`` replicas per expert.
        on_rank: ``[L, N, ranks]`` int32 copies of expert e on rank r.
        was_on_rank: ``[L, N, ranks]`` bool presence in the old placement (transfer accounting).
        slot_rank: ``[P]`` rank of every slot.
    """

    phy2log: np.ndarray
    count: np.ndarray
    on_rank: np.ndarray
    was_on_rank: np.ndarray
    slot_rank: np.ndarray

    @classmethod
    def start(cls, old_phy2log: np.ndarray, num_logical: int, num_ranks: int) -> _Search:
        num_layers, num_slots = old_phy2log.shape
        slot_rank = np.arange(num_slots) // (num_slots // num_ranks)
        layers = np.arange(num_layers)[:, None]
        count = np.zeros((num_layers, num_logical), dtype=np.int64)
        np.add.at(count, (layers, old_phy2log), 1)
        on_rank = np.zeros((num_layers, num_logical, num_ranks), dtype=np.int32)
        np.add.at(on_rank, (layers, old_phy2log, slot_rank[None, :]), 1)
        return cls(old_phy2log.copy(), count, on_rank, on_rank > 0, slot_rank)

    def reassign_(self, layers: np.ndarray, slots: np.ndarray, experts: np.ndarray) -> None:
        """Put ``experts[i]`` into slot ``slots[i]`` of layer ``layers[i]`` (in place)."""
        old = self.phy2log[layers, slots]
        ranks = self.slot_rank[slots]
        np.subtract.at(self.on_rank, (layers, old, ranks), 1)
        np.add.at(self.on_rank, (layers, experts, ranks), 1)
        np.subtract.at(self.count, (layers, old), 1)
        np.add.at(self.count, (layers, experts), 1)
        self.phy2log[layers, slots] = experts


class _Step:
    """Derived arrays of one search step for the active layers ``rows`` (``A`` of them).

    Attributes: phy2log ``[A, P]``, count / load / per_replica ``[A, N]``, slot_load ``[A, P]``,
    rank_load ``[A, ranks]``, by_load ``[A, ranks]`` ranks hottest first, left ``[A]`` transfers
    still allowed, drop_cap ``[A]`` the per-replica cap an expert must respect after losing one,
    measured on ``replica_load`` (the load replica counts are planned for; default ``load``):
    cap_per_replica ``[A, N]`` and droppable ``[A, N]``.
    """

    def __init__(
        self,
        state: _Search,
        rows: np.ndarray,
        load: np.ndarray,
        left: np.ndarray,
        drop_cap: np.ndarray,
        replica_load: np.ndarray | None = None,
    ) -> None:
        self.slot_rank = state.slot_rank
        self.phy2log = state.phy2log[rows]
        self.count = state.count[rows]
        self.load = load[rows]
        self.left = left
        self.drop_cap = drop_cap[rows]
        on_rank = state.on_rank[rows]
        self._shape = on_rank.shape  # [A, N, ranks]
        self._on = on_rank.reshape(-1)
        self._was = state.was_on_rank[rows].reshape(-1)
        self.index = np.arange(rows.size)
        self.per_replica = self.load / self.count
        self.slot_load = np.take_along_axis(self.per_replica, self.phy2log, 1)
        num_ranks = self._shape[2]
        self.per_rank = self.phy2log.shape[1] // num_ranks
        self.rank_load = self.slot_load.reshape(rows.size, num_ranks, self.per_rank).sum(axis=2)
        self.by_load = np.argsort(-self.rank_load, axis=1, kind="stable")
        self.after_drop = self.load / np.maximum(self.count - 1, 1)
        counted = self.load if replica_load is None else replica_load[rows]
        self.cap_per_replica = counted / self.count
        self.droppable = (self.count >= 2) & (
            counted / np.maximum(self.count - 1, 1) <= self.drop_cap[:, None]
        )

    def _flat(self, expert: np.ndarray, rank: np.ndarray) -> np.ndarray:
        rows = self.index.reshape((-1,) + (1,) * (max(np.ndim(expert), np.ndim(rank)) - 1))
        return (rows * self._shape[1] + expert) * self._shape[2] + rank

    def holds(self, expert: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Does ``rank`` hold ``expert`` now (broadcast over ``[A, ...]``)."""
        return self._on[self._flat(expert, rank)] > 0

    def add_cost(self, expert: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Transfers for putting ``expert`` on ``rank`` (absent now): 0 if it was there before."""
        return (~self._was[self._flat(expert, rank)]).astype(np.int64)

    def refund(self, expert: np.ndarray, rank: np.ndarray) -> np.ndarray:
        """Transfers saved by removing one copy of ``expert`` from ``rank``: 1 if it was the
        last copy and had itself been transferred in."""
        flat = self._flat(expert, rank)
        return ((self._on[flat] == 1) & ~self._was[flat]).astype(np.int64)

    def rank_slots(self, ranks: np.ndarray) -> np.ndarray:
        """``[A, k * per_rank]`` the slots of ``ranks [A, k]``."""
        slots = ranks[:, :, None] * self.per_rank + np.arange(self.per_rank)
        return slots.reshape(ranks.shape[0], -1)


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


def _allowed(step: _Step, valid: np.ndarray, score: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """``score`` where an edit is valid, affordable and lowers the peak below today's; else inf."""
    shape = (-1,) + (1,) * (score.ndim - 1)
    peak = step.rank_load[step.index, step.by_load[:, 0]].reshape(shape)
    ok = valid & (cost <= step.left.reshape(shape)) & (score < peak)
    return np.where(ok, score, np.inf).reshape(score.shape[0], -1)


def _swaps(step: _Step) -> _Family:
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


def _holder_peaks(step: _Step) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _others_after_drop(
    step: _Step, peaks: tuple[np.ndarray, ...], expert: np.ndarray, excluded: np.ndarray
) -> np.ndarray:
    """Load of the hottest holder of ``expert`` other than rank ``excluded`` once the expert has
    one replica fewer (``[A, k]`` inputs)."""
    top_load, top_rank, second_load = (np.take_along_axis(p, expert, 1) for p in peaks)
    raised = np.take_along_axis(step.after_drop - step.per_replica, expert, 1)
    return np.where(top_rank == excluded, second_load, top_load) + raised


def _sheds(step: _Step, peaks: tuple[np.ndarray, ...]) -> _Family:
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
        peak - a_load + added, _others_after_drop(step, peaks, a, hot[:, None])[:, :, None]
    )
    width = step.load.shape[1]

    def decode(column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _assignments((np.take_along_axis(hot_slots, column // width, 1), column % width))

    return _Family(
        _SHED, _allowed(step, valid, score, cost), cost.reshape(cost.shape[0], -1), decode
    )


def _spreads(step: _Step, peaks: tuple[np.ndarray, ...]) -> _Family:
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
    dropped = _others_after_drop(
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
class _Candidates:
    """``[A, K]`` shortlisted edits: ``kind``, ``cost`` (change in transfers), ``valid``, and
    assignments ``slots`` / ``experts`` ``[A, K, 2]`` (-1 where unused)."""

    kind: np.ndarray
    cost: np.ndarray
    valid: np.ndarray
    slots: np.ndarray
    experts: np.ndarray


def _shortlist(step: _Step, per_kind: int) -> _Candidates:
    """The ``per_kind`` best edits of every kind by their cheap bound, per active layer."""
    peaks = _holder_peaks(step)
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
    return _Candidates(kind, cost, valid, slots, experts)


def _exact_rank_loads(step: _Step, cand: _Candidates) -> np.ndarray:
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
    on = step._on.reshape(step._shape)
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


def _choose(
    rank_load: np.ndarray, new_rank_load: np.ndarray, cand: _Candidates
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


def _fits_total(
    priority: np.ndarray, cost: np.ndarray, wanted: np.ndarray, left: int
) -> np.ndarray:
    """Which wanted edits fit a global budget of ``left`` transfers, highest priority first."""
    positive = np.where(wanted, np.maximum(cost, 0), 0)
    order = np.argsort(-np.where(wanted, priority, -np.inf), kind="stable")
    fits = np.zeros_like(wanted)
    fits[order] = np.cumsum(positive[order]) <= left
    return fits & wanted


class _Budget:
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


def _restore_replicas_(
    state: _Search,
    load: np.ndarray,
    replica_cap: np.ndarray,
    budget: _Budget,
    replica_load: np.ndarray | None = None,
) -> None:
    """Step 2 of the module docstring (in place): replicas back to experts above the cap.

    Each step, per layer, the expert with the highest per-replica load above ``replica_cap``
    (both measured on ``replica_load``, default ``load``) takes a slot from an expert that can
    spare one (>= 2 replicas, still <= cap after the drop) on a rank not holding it; of those
    slots, the one whose rank (and the donor's other holders) end up coolest, then the cheapest.
    """
    num_layers = state.phy2log.shape[0]
    active = np.ones(num_layers, dtype=bool)
    for _ in range(budget.per_layer):
        if budget.exhausted():
            break
        rows = np.flatnonzero(active)
        if rows.size == 0:
            break
        step = _Step(state, rows, load, budget.left(rows), replica_cap, replica_load)
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
        others = _others_after_drop(step, _holder_peaks(step), step.phy2log, slot_rank)
        score = np.where(valid, np.maximum(own, others), np.inf)
        slot = np.lexsort((cost, score), axis=1)[:, 0]
        chosen_cost = cost[step.index, slot]
        wanted = budget.admit(excess, chosen_cost, (excess > 0) & valid[step.index, slot])
        active[rows[~wanted]] = False
        take = np.flatnonzero(wanted)
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
    """Budgeted peak-lowering edits from ``old_phy2log`` (module docstring, steps 2-4).

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
    state = _Search.start(old_phy2log, load.shape[1], num_ranks)
    budget = _Budget(num_layers, budget_per_layer, total_budget)
    if replica_cap is None:
        drop_cap = np.full(num_layers, np.inf)
    else:
        drop_cap = replica_cap
        _restore_replicas_(state, load, replica_cap, budget, replica_load)
    active = np.ones(num_layers, dtype=bool)
    steps = max_steps if max_steps is not None else 4 * budget_per_layer + 16
    for _ in range(steps):
        if budget.exhausted():
            break
        rows = np.flatnonzero(active)
        if rows.size == 0:
            break
        step = _Step(state, rows, load, budget.left(rows), drop_cap, replica_load)
        cand = _shortlist(step, per_kind)
        best, improves, gain = _choose(step.rank_load, _exact_rank_loads(step, cand), cand)
        cost = cand.cost[step.index, best]
        improves = budget.admit(gain / (np.maximum(cost, 0) + 0.5), cost, improves)
        active[rows[~improves]] = False
        take = np.flatnonzero(improves)
        if take.size == 0:
            break
        slots, experts = cand.slots[take, best[take]], cand.experts[take, best[take]]
        for t in range(slots.shape[1]):
            used = slots[:, t] >= 0
            state.reassign_(rows[take][used], slots[used, t], experts[used, t])
        budget.charge_(rows[take], cost[take])
    return state.phy2log


def _mean_and_peak(
    phy2log: np.ndarray, load: np.ndarray, num_ranks: int
) -> tuple[np.ndarray, np.ndarray]:
    """``[L]`` mean and max rank load (1 and 1 for a layer without load)."""
    rank_load = _rank_loads(phy2log, load, num_ranks)
    peak = rank_load.max(axis=1)
    idle = peak <= 0
    return np.where(idle, 1.0, rank_load.mean(axis=1)), np.where(idle, 1.0, peak)


@register_policy("churn_aware")
def churn_aware_policy(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old_phy2log: torch.Tensor | None,
    *,
    max_transfer_fraction: float = 0.15,
    max_bytes: int | None = None,
    expert_bytes: int | None = None,
    min_gain: float = 0.01,
    min_total_gain: float = 0.002,
    recency_decay: float = 0.5,
    replica_slack: float | None = 0.0,
    per_kind: int = 8,
    max_steps: int | None = None,
    previous_weight: torch.Tensor | None = None,
    drift_sigma: float | None = None,
    replica_hedge: float = 3.0,
) -> torch.Tensor:
    """Registered policy ``"churn_aware"`` (see the module docstring).

    Args:
        weight: ``[S, L, N]`` float64 load samples of the window, oldest first.
        num_replicas: ``P`` slots per layer.
        num_groups, num_nodes: used only for the first placement (DeepSeek, see below).
        num_ranks: EP ranks.
        old_phy2log: ``[L, P]`` installed placement. None (first placement): DeepSeek's
            ``rebalance_experts`` on the predicted load, since there is nothing to keep.
        max_transfer_fraction: at most ``floor(fraction * P)`` (expert, rank) transfers per layer.
            The default 0.15 is the migration target's ceiling: on the drifting traces of
            ``docs/benchmarks.md`` (churn section), with the drift hedge, 0.15 is ahead of a
            fresh DeepSeek plan on the next window's balance on all three shapes, while 0.10
            leaves the 5-slots-per-rank case (A1) 0.003 behind.
        max_bytes, expert_bytes: optional budget for the whole rebalance in bytes, each transfer
            costing ``expert_bytes``.
        min_gain: a layer whose predicted balancedness gains less keeps its old row.
        min_total_gain: if the whole placement's predicted balancedness gains less, nothing
            changes (the old placement is returned).
        recency_decay: time weighting of the predictor (:func:`predict_load`).
        replica_slack: per-replica cap ``u* (1 + slack)`` of step 2; None disables step 2 and the
            cap (edits may then concentrate a grown expert, which costs balance under drift).
        per_kind: edits per kind scored exactly each step (more: slower, rarely better).
        max_steps: cap on local-search steps (:func:`local_search`).
        previous_weight: ``[L, N]`` or ``[S, L, N]`` load of the previous planning window;
            :class:`eplb_graph.control.planning.PolicyPlanner` passes it. With it, the drift
            between the two windows is measured and hedged (step 1).
        drift_sigma: the window-to-window log drift to hedge against; None measures it from
            ``previous_weight`` (0 without one); 0 turns the hedge off.
        replica_hedge: replica counts hedge as if the drift variance were this many times
            larger (step 2); 1 hedges them like the load, 0 not at all.

    Returns:
        ``phy2log [L, P]`` int64.
    """
    if not replica_hedge >= 0:  # also rejects NaN
        raise ValueError(f"replica_hedge must be >= 0, got {replica_hedge}")
    if drift_sigma is not None and not drift_sigma >= 0:
        raise ValueError(f"drift_sigma must be >= 0 or None, got {drift_sigma}")
    observed = predict_load(weight, recency_decay)
    if drift_sigma is None:
        drift_sigma = (
            0.0
            if previous_weight is None
            else estimate_drift(normalize_weight(previous_weight).numpy(), weight.numpy())
        )
    load = hedge_load(observed, shrinkage(observed, drift_sigma))
    replica_load = hedge_load(observed, shrinkage(observed, drift_sigma * replica_hedge**0.5))
    if old_phy2log is None:
        phy2log, _, _ = rebalance_experts(
            torch.from_numpy(load), num_replicas, num_groups, num_nodes, num_ranks
        )
        return phy2log
    old = old_phy2log.numpy().astype(np.int64, copy=True)
    num_layers, num_logical = load.shape
    present = np.zeros((num_layers, num_logical), dtype=np.int64)
    np.add.at(present, (np.arange(num_layers)[:, None], old), 1)
    if (present == 0).any():
        raise ValueError("old_phy2log must hold every logical expert in every layer")
    per_layer, total = transfer_budget(num_replicas, max_transfer_fraction, max_bytes, expert_bytes)
    replica_cap = None
    if replica_slack is not None:
        if replica_slack < 0:
            raise ValueError(f"replica_slack must be >= 0 or None, got {replica_slack}")
        _, _, target = replicate_experts(replica_load, num_replicas)
        replica_cap = (replica_load / target).max(axis=1) * (1.0 + replica_slack)
    new = local_search(
        load, old, num_ranks, per_layer, total, replica_cap, per_kind, max_steps, replica_load
    )

    old_mean, old_peak = _mean_and_peak(old, load, num_ranks)
    new_mean, new_peak = _mean_and_peak(new, load, num_ranks)
    keep_old = new_mean / new_peak - old_mean / old_peak < min_gain
    new[keep_old] = old[keep_old]
    new_peak = np.where(keep_old, old_peak, new_peak)
    total_gain = old_mean.sum() / new_peak.sum() - old_mean.sum() / old_peak.sum()
    logger.debug(
        "churn_aware: %d of %d layers changed, predicted balancedness gain %.4f, "
        "drift sigma %.3f hedged",
        int((~keep_old).sum()),
        num_layers,
        total_gain,
        drift_sigma,
    )
    if total_gain < min_total_gain:
        return torch.from_numpy(old)
    return torch.from_numpy(new)
