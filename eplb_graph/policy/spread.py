"""Post-pass: no two copies of one expert on one rank when the slot count allows otherwise.

Two replicas of an expert on one rank serve no purpose there: the routing op spreads an expert's
tokens over its replicas, so the rank carries the same load as with one copy of double weight,
and the second slot is wasted where it could take load off another rank. Such a layout also
cannot be written as an expert map (vllm-ascend's schema lists the experts each device holds),
so record mode could not save it. Packing that places copies by load alone (DeepSeek's balanced
packing, on skewed loads) produces it: equal-load copies of a hot expert are interchangeable to
the packer. Duplicates are unavoidable only for an expert with more copies than there are ranks.

:func:`spread_replicas` rewrites only the layers that hold an avoidable duplicate. Replica counts
never change (so each copy's load does not either); only which rank holds which copy does:

1. first, swaps that move an extra copy to a rank lacking the expert without raising the
   layer's peak rank load (balance untouched or better);
2. if duplicates remain, for a plan that edits the placement in force (``fewest_moves``), the
   swaps that raise the peak least; otherwise a re-pack: largest copy first onto the lightest
   rank with room that lacks the expert, then pairwise swaps that lower the peak while keeping
   every rank duplicate-free, and for a copy the greedy re-pack cornered, the swap that raises
   the peak least.

Loads are estimated with each expert's load split evenly over its copies, as the policies
assume. Measured on skewed random loads (``tests/test_policy_spread.py``, ``docs/benchmarks.md``)
the duplicate-free plans are as balanced on average; an individual layer can lose a little.
"""

from __future__ import annotations

import numpy as np
import torch

from eplb_graph.tables import check_slots_per_rank

__all__ = ["avoidable_duplicates", "count_duplicates", "spread_replicas"]

_TOLERANCE = 1e-9
_IMPROVEMENT_ROUNDS = 64


def count_duplicates(phy2log: torch.Tensor | np.ndarray, num_ranks: int) -> int:
    """Extra copies of an expert on a rank that already holds it, over all layers."""
    table = np.asarray(phy2log, dtype=np.int64)
    num_layers, num_slots = table.shape
    per_rank = check_slots_per_rank(num_slots, num_ranks)
    rows = np.sort(table.reshape(num_layers, num_ranks, per_rank), axis=2)
    return int((rows[:, :, 1:] == rows[:, :, :-1]).sum())


def avoidable_duplicates(phy2log: torch.Tensor | np.ndarray, num_ranks: int) -> int:
    """Duplicates beyond those forced by experts with more copies than ranks."""
    table = np.asarray(phy2log, dtype=np.int64)
    forced = 0
    for row in table:
        copies = np.bincount(row)
        forced += int(np.maximum(copies - num_ranks, 0).sum())
    return count_duplicates(table, num_ranks) - forced


def spread_replicas(
    phy2log: torch.Tensor,
    logical_load: torch.Tensor | np.ndarray,
    num_ranks: int,
    *,
    fewest_moves: bool = False,
) -> torch.Tensor:
    """``phy2log [L, P]`` with every avoidable duplicate copy moved to another rank.

    Args:
        phy2log: ``[L, P]`` int64 plan.
        logical_load: ``[L, N]`` load per logical expert the plan was made for.
        num_ranks: EP ranks.
        fewest_moves: remove duplicates by swaps alone (two slots each), never by a re-pack:
            for plans that are edits of the placement in force, whose policy bounded how many
            slots change.

    Returns:
        the plan itself when it has no avoidable duplicate, else a rewritten copy.
    """
    table = phy2log.detach().cpu().numpy().astype(np.int64, copy=True)
    if avoidable_duplicates(table, num_ranks) == 0:
        return phy2log
    load = np.asarray(logical_load, dtype=np.float64)
    for layer in range(table.shape[0]):
        row, layer_load = table[layer], load[layer]
        if avoidable_duplicates(row[None], num_ranks) == 0:
            continue
        swapped = row.copy()
        _swap_duplicates_away(swapped, layer_load, num_ranks, raise_peak=False)
        if avoidable_duplicates(swapped[None], num_ranks) == 0:
            row[:] = swapped
            continue
        if fewest_moves:
            _swap_duplicates_away(swapped, layer_load, num_ranks, raise_peak=True)
            row[:] = swapped
            continue
        repacked = _repack(row, layer_load, num_ranks)
        _lower_the_peak(repacked, layer_load, num_ranks)
        # The greedy re-pack can corner a late copy; a swap that costs the least peak frees it.
        _swap_duplicates_away(repacked, layer_load, num_ranks, raise_peak=True)
        row[:] = repacked
    return torch.from_numpy(table)


class _Layer:
    """One layer's copies, per-copy loads, what each rank holds and each rank's load."""

    def __init__(self, row: np.ndarray, load: np.ndarray, num_ranks: int) -> None:
        self.row = row
        self.per_rank = row.shape[0] // num_ranks
        self.rank_of_slot = np.arange(row.shape[0]) // self.per_rank
        copies = np.bincount(row, minlength=load.shape[0])
        self.copy_load = load / np.maximum(copies, 1)
        self.held = np.zeros((num_ranks, load.shape[0]), dtype=np.int64)
        np.add.at(self.held, (self.rank_of_slot, row), 1)
        self.rank_load = (self.held * self.copy_load).sum(axis=1)

    def peak_elsewhere(self, rank: int) -> np.ndarray:
        """Per slot: the largest load among the ranks other than ``rank`` and the slot's own."""
        others = self.rank_load.copy()
        others[rank] = -np.inf
        order = np.argsort(-others, kind="stable")
        runner_up = others[order[1]] if len(order) > 1 else -np.inf
        return np.where(self.rank_of_slot == order[0], runner_up, others[order[0]])

    def swap(self, here: int, there: int) -> None:
        """Exchange the experts of slots ``here`` and ``there`` (on different ranks)."""
        rank_a, rank_b = self.rank_of_slot[here], self.rank_of_slot[there]
        a, b = self.row[here], self.row[there]
        self.row[here], self.row[there] = b, a
        self.held[rank_a, a] -= 1
        self.held[rank_a, b] += 1
        self.held[rank_b, b] -= 1
        self.held[rank_b, a] += 1
        delta = self.copy_load[b] - self.copy_load[a]
        self.rank_load[rank_a] += delta
        self.rank_load[rank_b] -= delta


def _swap_duplicates_away(
    row: np.ndarray, load: np.ndarray, num_ranks: int, *, raise_peak: bool
) -> None:
    """Move extra copies to ranks lacking the expert, each by the swap with the lowest new peak;
    without ``raise_peak`` only swaps that keep the peak where it is."""
    layer = _Layer(row, load, num_ranks)
    for _ in range(row.shape[0]):  # each swap removes one duplicate
        moved = False
        for rank, expert in np.argwhere(layer.held > 1):
            source = int(np.flatnonzero((row == expert) & (layer.rank_of_slot == rank))[0])
            valid = (
                (layer.rank_of_slot != rank)
                & (layer.held[layer.rank_of_slot, expert] == 0)  # the receiver lacks it
                & (layer.held[rank, row] == 0)  # and what comes back is new here
            )
            moving, coming = layer.copy_load[expert], layer.copy_load[row]
            new_peak = np.maximum(
                np.maximum(
                    layer.rank_load[rank] - moving + coming,
                    layer.rank_load[layer.rank_of_slot] + moving - coming,
                ),
                layer.peak_elsewhere(rank),
            )
            peak = layer.rank_load.max()
            if not raise_peak:
                valid &= new_peak <= peak + _TOLERANCE * max(peak, 1.0)
            if valid.any():
                target = int(np.argmin(np.where(valid, new_peak, np.inf)))
                layer.swap(source, target)
                moved = True
                break
        if not moved:
            return


def _repack(row: np.ndarray, load: np.ndarray, num_ranks: int) -> np.ndarray:
    """Largest copy first onto the lightest rank with room that lacks the expert (the lightest
    with room when every such rank holds it already)."""
    num_slots = row.shape[0]
    per_rank = num_slots // num_ranks
    copies = np.bincount(row, minlength=load.shape[0])
    copy_load = load / np.maximum(copies, 1)
    rank_load = np.zeros(num_ranks)
    filled = np.zeros(num_ranks, dtype=np.int64)
    held = np.zeros((num_ranks, load.shape[0]), dtype=bool)
    out = np.empty(num_slots, dtype=np.int64)
    for expert in row[np.argsort(-copy_load[row], kind="stable")]:
        room = filled < per_rank
        allowed = room & ~held[:, expert]
        choices = np.flatnonzero(allowed if allowed.any() else room)
        rank = int(choices[np.argmin(rank_load[choices])])
        out[rank * per_rank + filled[rank]] = expert
        filled[rank] += 1
        rank_load[rank] += copy_load[expert]
        held[rank, expert] = True
    return out


def _lower_the_peak(row: np.ndarray, load: np.ndarray, num_ranks: int) -> None:
    """Swap a copy off the peak rank for a lighter one elsewhere while that lowers the peak and
    creates no duplicate."""
    layer = _Layer(row, load, num_ranks)
    for _ in range(_IMPROVEMENT_ROUNDS):
        peak_rank = int(np.argmax(layer.rank_load))
        peak = layer.rank_load[peak_rank]
        sources = np.flatnonzero(layer.rank_of_slot == peak_rank)
        targets = np.flatnonzero(layer.rank_of_slot != peak_rank)
        a, b = row[sources][:, None], row[targets][None, :]
        receiver = layer.rank_of_slot[targets][None, :]
        load_a, load_b = layer.copy_load[a], layer.copy_load[b]
        valid = (load_a > load_b) & (layer.held[receiver, a] == 0) & (layer.held[peak_rank, b] == 0)
        new_peak = np.maximum(
            np.maximum(peak - load_a + load_b, layer.rank_load[receiver] + load_a - load_b),
            layer.peak_elsewhere(peak_rank)[targets][None, :],
        )
        new_peak = np.where(valid, new_peak, np.inf)
        i, j = np.unravel_index(int(np.argmin(new_peak)), new_peak.shape)
        if new_peak[i, j] >= peak - _TOLERANCE * max(peak, 1.0):
            return
        layer.swap(int(sources[i]), int(targets[j]))
