"""A placement that a policy edits slot by slot, with the counts its edits read kept in step.

Why: the incremental policies (``"churn_aware"``, ``"swift_balance"``) score every candidate edit
from replica counts and per-rank copies of each expert. Recounting them from ``phy2log`` after
each edit would cost a pass over the whole placement; :meth:`SlotTables.reassign_` updates them
for exactly the slots that change, for many layers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eplb_graph.policy.metrics import replica_counts_numpy

__all__ = ["SlotTables"]


@dataclass
class SlotTables:
    """Placement tables of all layers, edited in place.

    Attributes:
        phy2log: ``[L, P]`` int64 current placement (a copy of the one it started from).
        count: ``[L, N]`` int64 replicas per expert.
        on_rank: ``[L, N, ranks]`` int32 copies of expert e on rank r.
        slot_rank: ``[P]`` rank of every slot.
    """

    phy2log: np.ndarray
    count: np.ndarray
    on_rank: np.ndarray
    slot_rank: np.ndarray

    @classmethod
    def start(cls, phy2log: np.ndarray, num_logical: int, num_ranks: int) -> SlotTables:
        """Tables of ``phy2log [L, P]`` (``P % num_ranks == 0``, ids in ``[0, N)``)."""
        num_layers, num_slots = phy2log.shape
        slot_rank = np.arange(num_slots) // (num_slots // num_ranks)
        on_rank = np.zeros((num_layers, num_logical, num_ranks), dtype=np.int32)
        np.add.at(on_rank, (np.arange(num_layers)[:, None], phy2log, slot_rank[None, :]), 1)
        count = replica_counts_numpy(phy2log, num_logical)
        return cls(phy2log.copy(), count, on_rank, slot_rank)

    def reassign_(self, layers: np.ndarray, slots: np.ndarray, experts: np.ndarray) -> None:
        """Put ``experts[i]`` into slot ``slots[i]`` of layer ``layers[i]`` (in place)."""
        old = self.phy2log[layers, slots]
        ranks = self.slot_rank[slots]
        np.subtract.at(self.on_rank, (layers, old, ranks), 1)
        np.add.at(self.on_rank, (layers, experts, ranks), 1)
        np.subtract.at(self.count, (layers, old), 1)
        np.add.at(self.count, (layers, experts), 1)
        self.phy2log[layers, slots] = experts
