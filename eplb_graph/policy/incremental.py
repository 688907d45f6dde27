"""The plan that repays the most: a few moves from the committed placement, each one priced.

A fresh packing (:func:`~eplb_graph.policy.predicted_time.pack_by_predicted_time`, or any
counts policy) decides every slot anew, so even after relabelling ranks and keeping slots in
place it moves a large share of them; at a small decode batch the saving per step is a few
milliseconds, and a plan that moves a third of all slots cannot repay them within an interval,
while moving the three hot experts that make the busiest rank busy would. This search starts
from what is installed instead and only ever changes what pays:

- per layer (a step waits for each layer's busiest rank, and layers move independently), it
  repeatedly takes the move that lowers the rank times the most per copied expert, among
  **moves that touch the busiest rank**:

  - *replicate*: a slot holding a spare copy (its expert has another) takes a copy of a
    different expert, either a slot of the busiest rank (its spare copy leaves) or a slot
    elsewhere taking one of the busiest rank's experts (its rows split): one copy;
  - *swap*: a slot of the busiest rank and a slot of another rank exchange experts: two copies;

- "lowers the rank times" is measured by their 16-norm: close to the maximum, but it still
  falls when several ranks tie at the top (one move cannot lower a tied maximum);
- the moves stop where no further copy could repay itself (the layer's predicted time is
  within one copy's cost of the floor no placement beats), or after :data:`PATIENCE` moves
  without a better net gain, ``saving per step x horizon - copies x copy cost``; of the
  moves made, the prefix with the best net gain is kept.

Like the ``churn_aware`` policy's local search, but priced: that one lowers the peak *row count*
within a fixed transfer budget; this one lowers the predicted busiest-rank *time* (a replica
costs a weight read) for as long as a copy repays itself within the horizon.

Every expert keeps at least one copy, never gets more than ``cap`` copies, and never a second
copy on one rank: the same movement and lookup rules as every policy. Pure numpy, deterministic,
so every rank computes the same plan from the same reduced load.
"""

from __future__ import annotations

import numpy as np
import torch

from eplb_graph.control.cost_model import ExpertCostModel, layer_floors_us

__all__ = ["improve_by_moves", "reach_by_moves"]

PATIENCE = 8
"""Moves in a row without a better net gain before the search of a layer stops: a tie of up to
this many ranks at the top can still be worked down (each move lowers one of them)."""


def improve_by_moves(
    committed: torch.Tensor,
    per_step: torch.Tensor,
    num_ranks: int,
    max_replicas: int,
    model: ExpertCostModel,
    copy_us: float,
    horizon_steps: int,
) -> torch.Tensor:
    """``phy2log [L, P]``: ``committed`` changed by the moves that repay the most.

    Args:
        committed: ``[L, P]`` installed placement.
        per_step: ``[L, N]`` average rows per step of every logical expert.
        num_ranks: EP ranks (``P % num_ranks == 0``).
        max_replicas: lookup width: no expert gets more copies than this (nor than ranks).
        model: fitted cost model (µs).
        copy_us: what one expert copy moved across ranks costs serving, margin included (µs).
        horizon_steps: steps the saving is counted over.
    """
    table = torch.as_tensor(committed).to(torch.int64).numpy().copy()
    load = torch.as_tensor(per_step).to(torch.float64).numpy()
    if table.ndim != 2 or load.ndim != 2 or table.shape[0] != load.shape[0]:
        raise ValueError(f"committed {table.shape} and per_step {load.shape} must be [L, *]")
    if table.shape[1] % num_ranks:
        raise ValueError(f"{table.shape[1]} slots do not split over {num_ranks} ranks")
    if copy_us <= 0 or horizon_steps <= 0:
        raise ValueError("copy_us and horizon_steps must be positive")
    cap = max(1, min(max_replicas, num_ranks))
    for layer in range(table.shape[0]):
        search = _LayerSearch(table[layer], load[layer], num_ranks, cap, model)
        table[layer] = search.best_prefix(copy_us, horizon_steps)
    return torch.from_numpy(table)


def reach_by_moves(
    committed: torch.Tensor,
    per_step: torch.Tensor,
    target: torch.Tensor,
    num_ranks: int,
    max_replicas: int,
    model: ExpertCostModel,
) -> torch.Tensor:
    """``phy2log [L, P]``: ``committed`` changed by the same moves as :func:`improve_by_moves`,
    layer by layer, until each layer is predicted no slower than ``target``'s under
    ``per_step``; a layer the moves do not bring there takes ``target``'s row.

    Why: going back to the starting placement where nothing beats it (the payback gate's
    ``HOME``) undoes every slot an earlier load tuned, while a few moves against the new load's
    busiest rank make a placement as fast (on the gate's two-domain tests, after code then chat
    traffic: 9 copies instead of the start's 45). What is left over costs nothing to keep.
    """
    table = torch.as_tensor(committed).to(torch.int64).numpy().copy()
    goal = torch.as_tensor(target).to(torch.int64).numpy()
    load = torch.as_tensor(per_step).to(torch.float64).numpy()
    if table.shape != goal.shape or table.ndim != 2 or load.shape[0] != table.shape[0]:
        raise ValueError(f"committed {table.shape}, target {goal.shape}, per_step {load.shape}")
    cap = max(1, min(max_replicas, num_ranks))
    for layer in range(table.shape[0]):
        bound = float(_LayerSearch(goal[layer], load[layer], num_ranks, cap, model).times.max())
        search = _LayerSearch(table[layer], load[layer], num_ranks, cap, model)
        for _ in range(table.shape[1]):
            if float(search.times.max()) <= bound * (1 + 1e-9) or not search._apply_best_move():
                break
        reached = float(search.times.max()) <= bound * (1 + 1e-9)
        table[layer] = search.row if reached else goal[layer]
    return torch.from_numpy(table)


class _LayerSearch:
    """One layer's slots, counts and predicted rank times, updated move by move."""

    def __init__(
        self, row: np.ndarray, load: np.ndarray, num_ranks: int, cap: int, model: ExpertCostModel
    ) -> None:
        self.row = row.copy()
        self.load = load
        self.cap = cap
        self.model = model
        self.per_rank = row.shape[0] // num_ranks
        self.rank_of_slot = np.arange(row.shape[0]) // self.per_rank
        self.held = np.zeros((num_ranks, load.shape[0]), dtype=np.int64)  # copies per rank
        np.add.at(self.held, (self.rank_of_slot, row), 1)
        self.copies = self.held.sum(axis=0)
        self.times = self._rank_times()
        # No move here adds a copy beyond ``cap`` (nor removes an expert's last one), so the
        # floor under every placement this search reaches counts the copies the slots force.
        self.floor = float(
            layer_floors_us(
                load[None], num_ranks, model, row.shape[0], max(cap, int(self.copies.max()))
            )[0]
        )

    def _slot_us(self, expert: np.ndarray, copies: np.ndarray) -> np.ndarray:
        """Predicted µs per step of one slot of ``expert`` when it has ``copies`` copies."""
        rows = self.load[expert] / np.maximum(copies, 1)
        return self.model.row_us * rows + self.model.read_us * (1.0 - np.exp(-rows))

    def _rank_times(self) -> np.ndarray:
        experts = np.arange(self.load.shape[0])
        return self.model.fixed_us + self.held @ self._slot_us(experts, self.copies)

    def best_prefix(self, copy_us: float, horizon: int) -> np.ndarray:
        """Greedy moves until none helps or none could repay a copy; the prefix of them with the
        best net gain (the committed row itself when none has a positive one)."""
        start_row, start_held = self.row.copy(), self.held > 0
        start_peak = float(self.times.max())
        best_net, best_row, idle = 0.0, start_row, 0
        patience = min(PATIENCE, self.held.shape[0])
        for _ in range(self.row.shape[0]):
            if (float(self.times.max()) - self.floor) * horizon <= copy_us:
                break  # even the floor would not repay one more copy
            if not self._apply_best_move():
                break
            spent = int(((self.held > 0) & ~start_held).sum())  # what crosses ranks
            net = (start_peak - float(self.times.max())) * horizon - spent * copy_us
            if net > best_net + 1e-9:
                best_net, best_row, idle = net, self.row.copy(), 0
            else:
                idle += 1
                if idle >= patience:
                    break
        return best_row

    @staticmethod
    def _power(x: np.ndarray) -> np.ndarray:
        """``x ** 16`` by four squarings (far cheaper than a float power on every candidate)."""
        for _ in range(4):
            x = x * x
        return x

    def _apply_best_move(self) -> bool:
        """Apply the move that lowers ``sum((rank time / peak) ** 16)`` (the 16-norm without its
        root, which keeps the order) the most per copy; ``False`` if none lowers it without
        raising the busiest rank."""
        busiest = int(self.times.argmax())
        peak = float(self.times.max())
        experts = np.arange(self.load.shape[0])
        slot_us = {step: self._slot_us(experts, self.copies + step) for step in (-1, 0, 1)}
        powers = self._power(self.times / peak)
        best: tuple[float, np.ndarray, np.ndarray] | None = None
        for slots, new, spread, fits, copies in (
            self._replicas(busiest, peak, slot_us),
            self._swaps(busiest, peak, slot_us, powers),
        ):
            if not slots.size:
                continue
            score = np.where(fits, (powers.sum() - spread) / copies, -np.inf)
            index = int(score.argmax())
            if score[index] > 1e-12 and (best is None or score[index] > best[0]):
                best = (float(score[index]), slots[index], new[index])
        if best is None:
            return False
        for slot, expert in zip(best[1], best[2], strict=True):
            self._set(int(slot), int(expert))
        return True

    def _set(self, slot: int, expert: int) -> None:
        rank, old = self.rank_of_slot[slot], self.row[slot]
        self.held[rank, old] -= 1
        self.held[rank, expert] += 1
        self.row[slot] = expert
        self.copies = self.held.sum(axis=0)
        self.times = self._rank_times()

    def _replicas(self, busiest: int, peak: float, slot_us: dict) -> tuple:
        """Overwrite a spare copy with a copy of another expert, touching the busiest rank:
        ``(slots [K, 1], experts [K, 1], spread [K], fits [K], copies)``."""
        experts = np.arange(self.load.shape[0])
        spare = self.copies[self.row] >= 2  # [P]: the slot's expert has another copy
        on_busiest = self.rank_of_slot == busiest
        # A: a spare slot of the busiest rank takes any expert the rank lacks.
        slots_a, experts_a = np.meshgrid(np.flatnonzero(spare & on_busiest), experts, indexing="ij")
        # B: a spare slot elsewhere takes one of the busiest rank's experts.
        mine = experts[self.held[busiest] > 0]
        slots_b, experts_b = np.meshgrid(np.flatnonzero(spare & ~on_busiest), mine, indexing="ij")
        slots = np.concatenate([slots_a.ravel(), slots_b.ravel()])
        new = np.concatenate([experts_a.ravel(), experts_b.ravel()])
        ranks, old = self.rank_of_slot[slots], self.row[slots]
        keep = (self.held[ranks, new] == 0) & (self.copies[new] < self.cap) & (new != old)
        slots, new, ranks, old = slots[keep], new[keep], ranks[keep], old[keep]
        fewer, now, more = slot_us[-1], slot_us[0], slot_us[1]
        held = np.ascontiguousarray(self.held.T)  # [N, ranks]: one row gathered per candidate
        # Every rank holding ``old`` (``new``) sees its copies' rows change; rank ``r`` loses
        # its copy of ``old`` and gains one of ``new``.
        times = (
            self.times[None, :]
            + held[old] * (fewer[old] - now[old])[:, None]
            + held[new] * (more[new] - now[new])[:, None]
        )
        times[np.arange(slots.size), ranks] += more[new] - fewer[old]
        x = times / peak
        return (
            slots[:, None],
            new[:, None],
            self._power(x).sum(axis=1),
            x.max(axis=1) <= 1 + 1e-12,
            1.0,
        )

    def _swaps(self, busiest: int, peak: float, slot_us: dict, powers: np.ndarray) -> tuple:
        """A slot of the busiest rank and a slot of another rank exchange experts: only those two
        ranks change, so each candidate costs O(1)."""
        on_busiest = self.rank_of_slot == busiest
        first, second = np.meshgrid(
            np.flatnonzero(on_busiest), np.flatnonzero(~on_busiest), indexing="ij"
        )
        first, second = first.ravel(), second.ravel()
        mine, theirs = self.row[first], self.row[second]
        other = self.rank_of_slot[second]
        keep = (mine != theirs) & (self.held[other, mine] == 0) & (self.held[busiest, theirs] == 0)
        first, second, mine, theirs, other = (a[keep] for a in (first, second, mine, theirs, other))
        now = slot_us[0]
        delta = now[theirs] - now[mine]
        at_busiest = (self.times[busiest] + delta) / peak
        at_other = (self.times[other] - delta) / peak
        spread = (
            powers.sum()
            - powers[busiest]
            - powers[other]
            + self._power(at_busiest)
            + self._power(at_other)
        )
        fits = np.maximum(at_busiest, at_other) <= 1 + 1e-12
        slots = np.stack([first, second], axis=1)
        return slots, np.stack([theirs, mine], axis=1), spread, fits, 2.0
