"""Policy ``"swift_balance"``: move only redundant replicas, a few at a time (legacy type 2).

Why: on links too slow to reshuffle a model (vllm-ascend built SwiftBalance for such clusters),
rebalancing must be a handful of targeted moves. Experts with a single copy stay where they are;
only copies of replicated experts move, each move must lower the hottest rank, and both the
number of moves per layer and the number of transfers between any two ranks are capped.
It follows vllm-ascend's ``eplb_policy_type`` 2, so that legacy setting keeps its meaning.

Definitions (per layer):

- A slot is **movable** iff its expert has more than one replica in the *old* placement. Slots of
  single-copy experts never change, so every expert keeps its one non-redundant copy; a movable
  slot may only lose its expert while that expert still has another replica elsewhere.
- A **transfer** from rank ``s`` to rank ``d`` is one expert copy sent from ``s`` to ``d``;
  at most ``max_transfers_per_rank_pair`` per ordered pair ``(s, d)`` per rebalance.

Greedy, all layers at once (numpy; the Python loop runs over moves, at most ``max_swaps``):

1. Take the hottest rank ``h`` (rank load = each expert's load split evenly over its replicas).
2. Candidate moves on a movable slot of ``h``:

   - *swap* with a movable slot on another rank ``r`` (experts exchanged; two transfers
     ``h -> r`` and ``r -> h``; replica counts unchanged);
   - *replace*: the slot's expert ``a`` (>= 2 replicas) gives way to an expert ``f`` not on ``h``,
     copied from a rank holding ``f`` (one transfer to ``h``); ``a``'s other replicas each carry
     more, ``f``'s carry less.

3. Apply the move whose touched ranks end up lowest, provided all of them stay below ``h``'s
   load (so the layer's peak never rises and ``h`` strictly cools); stop when none qualifies or
   after ``max_swaps`` moves.
4. Keep the layer's new row only if its imbalance (max / mean rank load) improved.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from eplb_graph.policy.deepseek import default_policy
from eplb_graph.policy.metrics import rank_load_numpy, replica_counts_numpy
from eplb_graph.policy.registry import PolicyProblem, register_policy
from eplb_graph.policy.slot_tables import SlotTables

__all__ = ["SwiftMoves", "movable_slots", "swift_balance_policy", "swift_balance_search"]

logger = logging.getLogger(__name__)


def movable_slots(old_phy2log: np.ndarray, num_logical: int) -> np.ndarray:
    """``[L, P]`` bool: slots whose expert has more than one replica in ``old_phy2log [L, P]``."""
    return np.take_along_axis(replica_counts_numpy(old_phy2log, num_logical), old_phy2log, 1) > 1


def _best_swap(
    phy2log: np.ndarray,
    movable: np.ndarray,
    slot_load: np.ndarray,
    rank_load: np.ndarray,
    on_rank: np.ndarray,
    pair_ok: np.ndarray,
    hot: np.ndarray,
    slot_rank: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Best swap of a movable hot slot with a movable slot elsewhere, per layer.

    Args:
        phy2log, movable, slot_load: ``[A, P]``; rank_load: ``[A, ranks]``;
        on_rank: ``[A, N, ranks]`` copies per rank; pair_ok: ``[A, ranks, ranks]`` whether the
        ordered pair (src, dst) can take another transfer; hot: ``[A]``; slot_rank: ``[P]``.

    Returns:
        ``score [A]`` (the higher of the two new rank loads; ``inf`` if none allowed) and
        ``column [A]`` (``i * P + j``: hot-rank slot position i, other slot j).
    """
    num_rows, num_slots = phy2log.shape
    per_rank = num_slots // rank_load.shape[1]
    index = np.arange(num_rows)
    hot_slots = hot[:, None] * per_rank + np.arange(per_rank)
    a = np.take_along_axis(phy2log, hot_slots, 1)[:, :, None]
    a_load = np.take_along_axis(slot_load, hot_slots, 1)[:, :, None]
    b, b_load = phy2log[:, None, :], slot_load[:, None, :]
    other = slot_rank[None, None, :]
    a_on_other = on_rank[index[:, None, None], a, other] > 0
    b_on_hot = on_rank[index[:, None], phy2log, hot[:, None]][:, None, :] > 0
    pairs = pair_ok[index, hot][:, slot_rank] & pair_ok[index[:, None], slot_rank, hot[:, None]]
    valid = (
        np.take_along_axis(movable, hot_slots, 1)[:, :, None]
        & movable[:, None, :]
        & (other != hot[:, None, None])
        & (a != b)
        & ~a_on_other
        & ~b_on_hot
        & pairs[:, None, :]
    )
    peak = rank_load[index, hot][:, None, None]
    other_load = rank_load[:, slot_rank][:, None, :]
    score = np.maximum(peak - a_load + b_load, other_load + a_load - b_load)
    score = np.where(valid & (score < peak), score, np.inf).reshape(num_rows, -1)
    column = score.argmin(axis=1)
    return score[index, column], column


def _best_replace(
    phy2log: np.ndarray,
    movable: np.ndarray,
    load: np.ndarray,
    count: np.ndarray,
    rank_load: np.ndarray,
    on_rank: np.ndarray,
    pair_ok: np.ndarray,
    hot: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Best re-pointing of a movable hot slot to another expert, per layer.

    The touched ranks are: ``h`` (new load exact), the other holders of the dropped expert
    (each rises by the same amount; the hottest of them bounds them all) and the holders of the
    new expert (they cool, so they never limit the move).

    Returns:
        ``score [A]``, ``column [A]`` (``i * N + f``) and ``source [A]`` (the rank the new
        expert is copied from: its holder with a transfer to ``h`` still allowed).
    """
    num_rows, num_slots = phy2log.shape
    num_logical = load.shape[1]
    num_ranks = rank_load.shape[1]
    per_rank = num_slots // num_ranks
    index = np.arange(num_rows)
    hot_slots = hot[:, None] * per_rank + np.arange(per_rank)
    a = np.take_along_axis(phy2log, hot_slots, 1)
    per_replica = load / np.maximum(count, 1)
    a_load = np.take_along_axis(per_replica, a, 1)[:, :, None]
    a_count = np.take_along_axis(count, a, 1)
    peak = rank_load[index, hot]
    # Hottest other holder of each expert, after that expert loses one replica.
    holders = on_rank > 0
    not_hot = np.arange(num_ranks)[None, None, :] != hot[:, None, None]
    others_peak = np.where(holders & not_hot, rank_load[:, None, :], -np.inf).max(axis=2)
    rise = load / np.maximum(count - 1, 1) - per_replica
    a_others = np.take_along_axis(others_peak + rise, a, 1)[:, :, None]
    # A source for each new expert: a holder whose transfer to h is still allowed.
    can_send = holders & pair_ok[index, :, hot][:, None, :]
    source = can_send.argmax(axis=2)  # [A, N]
    on_hot = holders[index, :, hot]
    added = (load / (count + 1))[:, None, :]
    valid = (np.take_along_axis(movable, hot_slots, 1) & (a_count >= 2))[:, :, None] & (
        can_send.any(axis=2) & ~on_hot
    )[:, None, :]
    score = np.maximum(peak[:, None, None] - a_load + added, a_others)
    score = np.where(valid & (score < peak[:, None, None]), score, np.inf)
    score = score.reshape(num_rows, -1)
    column = score.argmin(axis=1)
    return score[index, column], column, source[index, column % num_logical]


@dataclass(frozen=True)
class SwiftMoves:
    """What :func:`swift_balance_search` did.

    Attributes:
        phy2log: ``[L, P]`` int64 placement after the moves (before the step-4 check).
        sent: ``[L, ranks, ranks]`` int64 expert copies sent from rank s (axis 1) to rank d.
        moves: ``[L]`` int64 moves applied per layer.
    """

    phy2log: np.ndarray
    sent: np.ndarray
    moves: np.ndarray


def swift_balance_search(
    load: np.ndarray,
    old_phy2log: np.ndarray,
    num_ranks: int,
    max_swaps: int,
    max_transfers_per_rank_pair: int,
) -> SwiftMoves:
    """Steps 1-3 of the module docstring for every layer at once.

    Args:
        load: ``[L, N]`` load per expert; old_phy2log: ``[L, P]`` installed placement.
        num_ranks: EP ranks; max_swaps, max_transfers_per_rank_pair: the bounds.

    Returns:
        :class:`SwiftMoves`.
    """
    num_layers, num_slots = old_phy2log.shape
    num_logical = load.shape[1]
    per_rank = num_slots // num_ranks
    tables = SlotTables.start(old_phy2log, num_logical, num_ranks)
    phy2log, count, on_rank = tables.phy2log, tables.count, tables.on_rank
    slot_rank = tables.slot_rank
    movable = movable_slots(old_phy2log, num_logical)
    sent = np.zeros((num_layers, num_ranks, num_ranks), dtype=np.int64)  # [L, src, dst]
    moves = np.zeros(num_layers, dtype=np.int64)
    active = np.ones(num_layers, dtype=bool)

    for _ in range(max_swaps):
        rows = np.flatnonzero(active)
        if rows.size == 0:
            break
        rows_p2l, rows_load = phy2log[rows], load[rows]
        per_replica = rows_load / np.maximum(count[rows], 1)
        slot_load = np.take_along_axis(per_replica, rows_p2l, 1)
        rank_load = slot_load.reshape(rows.size, num_ranks, per_rank).sum(axis=2)
        hot = rank_load.argmax(axis=1)
        pair_ok = sent[rows] < max_transfers_per_rank_pair
        swap_score, swap_column = _best_swap(
            rows_p2l, movable[rows], slot_load, rank_load, on_rank[rows], pair_ok, hot, slot_rank
        )
        replace_score, replace_column, source = _best_replace(
            rows_p2l,
            movable[rows],
            rows_load,
            count[rows],
            rank_load,
            on_rank[rows],
            pair_ok,
            hot,
        )
        use_swap = swap_score <= replace_score
        found = np.isfinite(np.minimum(swap_score, replace_score))
        active[rows[~found]] = False
        moves[rows[found]] += 1
        hot_position = np.where(use_swap, swap_column // num_slots, replace_column // num_logical)
        hot_slot = hot * per_rank + hot_position
        layers = rows[found & use_swap]
        if layers.size:
            pick = found & use_swap
            slot_a, slot_b = hot_slot[pick], swap_column[pick] % num_slots
            expert_a, expert_b = phy2log[layers, slot_a], phy2log[layers, slot_b]
            tables.reassign_(layers, slot_a, expert_b)
            tables.reassign_(layers, slot_b, expert_a)
            sent[layers, slot_rank[slot_a], slot_rank[slot_b]] += 1
            sent[layers, slot_rank[slot_b], slot_rank[slot_a]] += 1
        pick = found & ~use_swap
        layers = rows[pick]
        if layers.size:
            tables.reassign_(layers, hot_slot[pick], replace_column[pick] % num_logical)
            sent[layers, source[pick], hot[pick]] += 1
    return SwiftMoves(phy2log, sent, moves)


@register_policy("swift_balance", bounded_moves=True)
def swift_balance_policy(
    problem: PolicyProblem,
    *,
    max_swaps: int = 8,
    max_transfers_per_rank_pair: int = 2,
) -> torch.Tensor:
    """Registered policy ``"swift_balance"`` (see the module docstring).

    Args:
        problem: the load (summed over samples: time is not used) and the placement in force.
            Required in spirit: with none there is nothing to move, so this falls back to
            ``"default"`` (DeepSeek) and logs it.
        max_swaps: moves (swaps or replacements) per layer at most.
        max_transfers_per_rank_pair: expert copies per ordered (source, destination) rank pair.

    Returns:
        ``phy2log [L, P]`` int64.
    """
    if problem.old_phy2log is None:
        logger.info("swift_balance: no old placement to adjust; using the default policy")
        return default_policy(problem)
    if max_swaps < 0 or max_transfers_per_rank_pair < 0:
        raise ValueError(
            f"max_swaps and max_transfers_per_rank_pair must be >= 0, got {max_swaps} and "
            f"{max_transfers_per_rank_pair}"
        )
    load, num_ranks = problem.total_load.numpy(), problem.num_ranks
    old = problem.old_phy2log.numpy().astype(np.int64, copy=True)
    new = swift_balance_search(load, old, num_ranks, max_swaps, max_transfers_per_rank_pair).phy2log
    old_load = rank_load_numpy(old, load, num_ranks)
    new_load = rank_load_numpy(new, load, num_ranks)
    # Imbalance max / mean; the mean is the same for both (same total), so compare the peaks.
    improved = new_load.max(axis=1) < old_load.max(axis=1)
    return torch.from_numpy(np.where(improved[:, None], new, old))
