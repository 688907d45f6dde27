"""Search state of ``"churn_aware"``: the placement being edited, and one step's view of it.

:class:`SearchState` is the placement of every layer plus what the transfer accounting needs
(which experts each rank held before the search). :class:`Step` derives, for the layers still
searching, every array the edit scorers read, once per step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb_graph.policy.slot_tables import SlotTables

__all__ = ["SearchState", "Step"]


@dataclass
class SearchState(SlotTables):
    """:class:`SlotTables` of all layers plus the old placement's presence.

    Attributes:
        was_on_rank: ``[L, N, ranks]`` bool: rank r held expert e before the search (an edit
            that puts e back on r costs no transfer).
    """

    was_on_rank: np.ndarray

    @classmethod
    def start(cls, old_phy2log: np.ndarray, num_logical: int, num_ranks: int) -> SearchState:
        tables = SlotTables.start(old_phy2log, num_logical, num_ranks)
        return cls(
            tables.phy2log, tables.count, tables.on_rank, tables.slot_rank, tables.on_rank > 0
        )


class Step:
    """Derived arrays of one search step for the active layers ``rows`` (``A`` of them).

    Attributes: phy2log ``[A, P]``, count / load / per_replica ``[A, N]``, slot_load ``[A, P]``,
    rank_load ``[A, ranks]``, by_load ``[A, ranks]`` ranks hottest first, left ``[A]`` transfers
    still allowed, drop_cap ``[A]`` the per-replica cap an expert must respect after losing one,
    measured on ``replica_load`` (the load replica counts are planned for; default ``load``):
    cap_per_replica ``[A, N]`` and droppable ``[A, N]``.
    """

    def __init__(
        self,
        state: SearchState,
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

    @property
    def on_rank(self) -> np.ndarray:
        """``[A, N, ranks]`` copies of expert e on rank r now."""
        return self._on.reshape(self._shape)

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
