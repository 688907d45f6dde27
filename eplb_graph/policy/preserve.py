"""Post-passes that make any policy's new placement cheaper to install, without changing balance.

A rank's load depends only on *which* experts it holds (its slot multiset), not on slot order, and
the ranks of a placement are interchangeable. Both freedoms can be spent on reusing what is
already in place:

- :func:`preserve_slots` reorders slots within each rank so an expert that stays on a rank keeps
  its old slot (no intra-rank copy, and unchanged slots need no work at all);
- :func:`relabel_ranks` renumbers whole ranks (a rank's slot block moves as a unit) to maximize
  the (expert, rank) pairs already in place, i.e. to minimize what crosses ranks.

Both are pure functions of ``[L, P]`` int64 tables and keep every rank's multiset of experts (so
every rank-load and the balancedness) intact. :func:`slots_changed` and :func:`transfers_needed`
measure the churn they save.
"""

from __future__ import annotations

import numpy as np
import torch

from eplb_graph.tables import check_slots_per_rank

__all__ = [
    "linear_sum_assignment",
    "preserve_slots",
    "relabel_ranks",
    "slots_changed",
    "transfers_needed",
]


def _as_table(phy2log: torch.Tensor | np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(
        phy2log.detach().cpu().numpy() if isinstance(phy2log, torch.Tensor) else phy2log,
        dtype=np.int64,
    )
    if array.ndim != 2:
        raise ValueError(f"{name} must be [L, P], got shape {array.shape}")
    return array


def _tables(
    old_phy2log: torch.Tensor | np.ndarray, new_phy2log: torch.Tensor | np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Validated ``(old [L, P], new [L, P])`` of the same shape."""
    old = _as_table(old_phy2log, "old_phy2log")
    new = _as_table(new_phy2log, "new_phy2log")
    if old.shape != new.shape:
        raise ValueError(f"old and new phy2log shapes differ: {old.shape} vs {new.shape}")
    return old, new


def _pair(
    old_phy2log: torch.Tensor | np.ndarray, new_phy2log: torch.Tensor | np.ndarray, num_ranks: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Validated ``(old [L, P], new [L, P], slots_per_rank)``."""
    old, new = _tables(old_phy2log, new_phy2log)
    return old, new, check_slots_per_rank(old.shape[1], num_ranks)


def preserve_slots(
    old_phy2log: torch.Tensor | np.ndarray,
    new_phy2log: torch.Tensor | np.ndarray,
    num_ranks: int,
) -> torch.Tensor:
    """Reorder each rank's slots of ``new`` so experts staying on the rank keep their old slot.

    Per (layer, rank) block of ``P / num_ranks`` slots:

    1. for each old slot in ascending order, take a not-yet-used entry of the new block holding
       the same expert and put it in that slot: the entry already in that slot if it matches,
       else the first unused one;
    2. fill the remaining slots in ascending order with the remaining new entries in their new
       order.

    This is upstream vLLM's ``preserve_intragpu_slots`` except for the "entry already in that
    slot" preference. Upstream always takes the first unused entry, which is not idempotent
    (old block ``[0, 0, 3]``, new ``[3, 3, 2]`` gives ``[3, 2, 3]``, and applying it again gives
    ``[2, 3, 3]``). Which slots keep their old expert is the same under both rules; only the
    order of the pass-2 entries can differ. With the preference, a second application changes
    nothing, so re-planning against an already-preserved placement is stable.

    Vectorized over all (layer, rank) blocks: the loop runs over the slots of one rank only.

    Args:
        old_phy2log: ``[L, P]`` current placement.
        new_phy2log: ``[L, P]`` placement to install.
        num_ranks: EP ranks; ``P % num_ranks == 0``.

    Returns:
        ``[L, P]`` int64: ``new`` with slots permuted within ranks (same per-rank multisets).
    """
    old, new, per_rank = _pair(old_phy2log, new_phy2log, num_ranks)
    num_layers, num_slots = new.shape
    old_blocks = old.reshape(-1, per_rank)
    new_blocks = new.reshape(-1, per_rank)
    num_blocks = new_blocks.shape[0]
    blocks = np.arange(num_blocks)
    out = np.empty_like(new_blocks)
    used = np.zeros(new_blocks.shape, dtype=bool)  # new entry already placed
    filled = np.zeros(new_blocks.shape, dtype=bool)  # output slot already set
    for slot in range(per_rank):
        candidates = (new_blocks == old_blocks[:, slot : slot + 1]) & ~used
        found = candidates.any(axis=1)
        # The entry already in this slot if it matches, else the first unused match.
        entry = np.where(candidates[:, slot], slot, candidates.argmax(axis=1))
        hit = blocks[found]
        out[hit, slot] = new_blocks[hit, entry[found]]
        used[hit, entry[found]] = True
        filled[hit, slot] = True
    # Pass 2: k-th free slot (ascending) <- k-th unused entry (new order). A stable argsort puts
    # the False positions first, in order; both lists have the same length per block.
    free_slots = np.argsort(filled, axis=1, kind="stable")
    free_entries = np.argsort(used, axis=1, kind="stable")
    valid = np.arange(per_rank) < (~filled).sum(axis=1, keepdims=True)
    rows = np.broadcast_to(blocks[:, None], valid.shape)[valid]
    out[rows, free_slots[valid]] = new_blocks[rows, free_entries[valid]]
    return torch.from_numpy(out.reshape(num_layers, num_slots))


def _presence(phy2log: np.ndarray, num_ranks: int, num_logical: int) -> np.ndarray:
    """``[L, ranks, N]`` bool: does rank r hold expert e (in any slot)."""
    num_layers, num_slots = phy2log.shape
    rank_of_slot = np.arange(num_slots) // (num_slots // num_ranks)
    present = np.zeros((num_layers, num_ranks, num_logical), dtype=bool)
    layers = np.arange(num_layers)[:, None]
    present[layers, rank_of_slot[None, :], phy2log] = True
    return present


def linear_sum_assignment(cost: np.ndarray) -> np.ndarray:
    """Exact minimum-cost perfect matching of a square cost matrix (shortest augmenting paths).

    Jonker-Volgenant style: a column reduction gives feasible dual potentials and matches every
    row that is the unique first minimum of some column; each remaining row is then inserted by a
    Dijkstra search for the shortest augmenting path on reduced costs (Crouse's formulation, with
    lazy dual updates). The scan over columns is one numpy operation, so an ``n x n`` problem
    costs at most O(n^2) array operations of length n. Written here because scipy is not a
    dependency.

    Args:
        cost: ``[n, n]`` finite costs.

    Returns:
        ``[n]`` int64: ``column[row]`` of an optimal assignment.
    """
    cost = np.asarray(cost, dtype=np.float64)
    n = cost.shape[0]
    if cost.ndim != 2 or cost.shape != (n, n):
        raise ValueError(f"cost must be square, got shape {cost.shape}")
    if not np.isfinite(cost).all():
        raise ValueError("cost must be finite")
    row_dual = np.zeros(n)
    col_dual = cost.min(axis=0) if n else np.zeros(0)
    col_of_row = np.full(n, -1, dtype=np.int64)
    row_of_col = np.full(n, -1, dtype=np.int64)
    # Column reduction: every reduced cost is >= 0; match a column to its minimum row when free.
    for col, row in enumerate(cost.argmin(axis=0) if n else ()):
        if col_of_row[row] == -1:
            col_of_row[row] = col
            row_of_col[col] = row
    for start in np.flatnonzero(col_of_row == -1):
        shortest = np.full(n, np.inf)
        path = np.full(n, -1, dtype=np.int64)
        remaining = np.ones(n, dtype=bool)  # columns not yet scanned
        scanned_rows = []
        row, min_value, sink = int(start), 0.0, -1
        while sink == -1:
            scanned_rows.append(row)
            reduced = cost[row] - col_dual + (min_value - row_dual[row])
            better = remaining & (reduced < shortest)
            shortest[better] = reduced[better]
            path[better] = row
            col = int(np.where(remaining, shortest, np.inf).argmin())
            min_value = shortest[col]
            remaining[col] = False
            if row_of_col[col] == -1:
                sink = col
            else:
                row = int(row_of_col[col])
        # Lazy dual update: keeps every reduced cost >= 0 and the new path's edges at 0.
        row_dual[start] += min_value
        others = np.array(scanned_rows[1:], dtype=np.int64)
        row_dual[others] += min_value - shortest[col_of_row[others]]
        done = ~remaining
        col_dual[done] -= min_value - shortest[done]
        col = sink
        while True:  # augment along the path back to the start row
            row = int(path[col])
            row_of_col[col] = row
            col_of_row[row], col = col, col_of_row[row]
            if row == start:
                break
    return col_of_row


def _block_assignment(overlap: np.ndarray, num_nodes: int) -> np.ndarray:
    """Rank permutation ``target[new_rank]`` maximizing overlap, preferring fixed points.

    ``overlap [ranks, ranks]`` integer counts; score = overlap * (ranks + 1) + identity bonus, so
    among optimal relabelings the one that moves the fewest ranks wins (identity when it is
    already optimal). Permutations stay within each block of ``ranks / num_nodes`` ranks.
    """
    num_ranks = overlap.shape[0]
    per_node = num_ranks // num_nodes
    score = overlap.astype(np.float64) * (num_ranks + 1) + np.eye(num_ranks)
    target = np.empty(num_ranks, dtype=np.int64)
    for node in range(num_nodes):
        block = slice(node * per_node, (node + 1) * per_node)
        target[block] = node * per_node + linear_sum_assignment(-score[block, block])
    return target


def relabel_ranks(
    old_phy2log: torch.Tensor | np.ndarray,
    new_phy2log: torch.Tensor | np.ndarray,
    num_ranks: int,
    num_nodes: int = 1,
) -> torch.Tensor:
    """Renumber whole ranks of ``new`` to keep as many (expert, rank) pairs of ``old`` as possible.

    Rank ``a`` of the new placement becomes rank ``target[a]``, chosen per layer by an exact
    assignment maximizing ``sum_a |experts(new, a) & experts(old, target[a])|`` (ties: fewest
    ranks moved). Every rank's slot block moves unchanged, so the multiset of rank loads, and
    hence balancedness, is exactly that of ``new``; the overlap is never below the identity's.

    Args:
        old_phy2log: ``[L, P]`` current placement.
        new_phy2log: ``[L, P]`` placement to install.
        num_ranks: EP ranks; ``P % num_ranks == 0``.
        num_nodes: restrict relabeling to within each node (``num_ranks % num_nodes == 0``), e.g.
            to keep a hierarchical placement's group-to-node layout. Default: any rank.

    Returns:
        ``[L, P]`` int64 relabeled placement.
    """
    old, new, per_rank = _pair(old_phy2log, new_phy2log, num_ranks)
    if num_nodes < 1 or num_ranks % num_nodes != 0:
        raise ValueError(f"num_ranks={num_ranks} is not divisible by num_nodes={num_nodes}")
    num_layers = new.shape[0]
    num_logical = int(max(old.max(), new.max())) + 1
    new_has = _presence(new, num_ranks, num_logical).astype(np.int32)
    old_has = _presence(old, num_ranks, num_logical).astype(np.int32)
    overlap = np.matmul(new_has, old_has.transpose(0, 2, 1))  # [L, new rank, old rank]
    out = np.empty_like(new)
    for layer in range(num_layers):
        target = _block_assignment(overlap[layer], num_nodes)
        blocks = new[layer].reshape(num_ranks, per_rank)
        relabeled = np.empty_like(blocks)
        relabeled[target] = blocks
        out[layer] = relabeled.reshape(-1)
    return torch.from_numpy(out)


def slots_changed(
    old_phy2log: torch.Tensor | np.ndarray, new_phy2log: torch.Tensor | np.ndarray
) -> torch.Tensor:
    """``[L]`` float64: fraction of slots whose expert differs between ``old`` and ``new``."""
    old, new = _tables(old_phy2log, new_phy2log)
    return torch.from_numpy((old != new).mean(axis=1))


def transfers_needed(
    old_phy2log: torch.Tensor | np.ndarray,
    new_phy2log: torch.Tensor | np.ndarray,
    num_ranks: int,
) -> torch.Tensor:
    """``[L]`` int64: (expert, destination rank) pairs of ``new`` whose expert is not on that rank.

    This is what must cross ranks: a rank that already holds an expert (in any slot) copies it
    locally, and several new slots of one expert on one rank need one receive.
    """
    old, new, _ = _pair(old_phy2log, new_phy2log, num_ranks)
    num_logical = int(max(old.max(), new.max())) + 1
    missing = _presence(new, num_ranks, num_logical) & ~_presence(old, num_ranks, num_logical)
    return torch.from_numpy(missing.sum(axis=(1, 2)).astype(np.int64))
