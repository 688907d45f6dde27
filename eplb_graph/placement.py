"""``Placement``: which logical expert sits in every physical slot of every MoE layer.

A placement is a value object on the CPU (``phy2log [L, P]`` int64). Everything the routing op
reads (``log2phy``, ``replica_count``) is *derived* from it with vectorized tensor code, so the
control plane keeps one source of truth (invariant 1) and the device state only ever receives
copies of derived tables. The rules of a valid table live in ``eplb_graph.tables``; the
expert-map file format in ``eplb_graph.expert_map``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from eplb_graph import expert_map
from eplb_graph.arguments import as_int
from eplb_graph.tables import (
    PlacementError,
    as_phy2log,
    check_layer_index,
    check_lookup_width,
    derive_log2phy,
    replica_counts,
    validate_layer_row,
    validate_phy2log,
)

__all__ = ["Placement", "PlacementError"]

MAX_SIZE = 1 << 20
"""Largest layer, expert or rank count a default placement is built for: larger is a typo, and
would allocate a table of that size before anything else could object."""


class Placement:
    """Logical expert in every physical slot, for every MoE layer.

    Attributes:
        phy2log: ``[L, P]`` int64 CPU; ``phy2log[l, p]`` is the expert in slot ``p`` of layer ``l``.
        num_logical: N, the number of logical experts.
        num_ranks: EP ranks; slot ``p`` lives on rank ``p // (P / num_ranks)``.
    """

    __slots__ = ("_phy2log", "num_logical", "num_ranks")

    def __init__(self, phy2log: torch.Tensor | Sequence, num_logical: int, num_ranks: int) -> None:
        num_logical = as_int("num_logical", num_logical, minimum=1, error=PlacementError)
        num_ranks = as_int("num_ranks", num_ranks, minimum=1, error=PlacementError)
        table = as_phy2log(phy2log)
        validate_phy2log(table, num_logical, num_ranks)
        self._phy2log = table
        self.num_logical = int(num_logical)
        self.num_ranks = int(num_ranks)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def default(
        cls, num_layers: int, num_logical: int, num_redundant: int, num_ranks: int
    ) -> Placement:
        """Slots ``0..N-1`` hold experts ``0..N-1``; redundant slot ``N + j`` holds ``j % N``."""
        num_layers = as_int(
            "num_layers", num_layers, minimum=1, maximum=1 << 16, error=PlacementError
        )
        num_logical = as_int(
            "num_logical", num_logical, minimum=1, maximum=1 << 20, error=PlacementError
        )
        num_redundant = as_int(
            "num_redundant", num_redundant, minimum=0, maximum=1 << 20, error=PlacementError
        )
        num_ranks = as_int("num_ranks", num_ranks, minimum=1, maximum=1 << 20, error=PlacementError)
        row = torch.cat([torch.arange(num_logical), torch.arange(num_redundant) % num_logical]).to(
            torch.int64
        )
        return cls(row.expand(num_layers, -1).clone(), num_logical, num_ranks)

    # -- shape ---------------------------------------------------------------------------------
    @property
    def phy2log(self) -> torch.Tensor:
        """``[L, P]`` int64 CPU. Read-only by contract: a placement is a value."""
        return self._phy2log

    @property
    def num_layers(self) -> int:
        return self._phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self._phy2log.shape[1]

    @property
    def num_redundant(self) -> int:
        return self.num_slots - self.num_logical

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def rank_of_slot(self) -> torch.Tensor:
        """``[P]`` int64: the EP rank that holds each slot."""
        return torch.arange(self.num_slots) // self.slots_per_rank

    # -- derived tables ------------------------------------------------------------------------
    def replica_count(self) -> torch.Tensor:
        """``[L, N]`` int64 number of slots holding each expert."""
        return replica_counts(self._phy2log, self.num_logical)

    def max_replica_count(self) -> int:
        return int(self.replica_count().max())

    def log2phy(self, max_replicas: int) -> torch.Tensor:
        """``[L, N, R]`` int64: slots of each expert in ascending order, padded with -1.

        Raises:
            PlacementError: if some expert has more than ``max_replicas`` slots.
        """
        max_replicas = as_int("max_replicas", max_replicas, minimum=1, error=PlacementError)
        check_lookup_width(self.replica_count(), max_replicas)
        return derive_log2phy(self._phy2log, self.num_logical, max_replicas)

    def layer(self, layer: int) -> torch.Tensor:
        """``[P]`` int64 copy of one layer's ``phy2log`` row."""
        return self._phy2log[layer].clone()

    def with_layer(self, layer: int, phy2log_row: torch.Tensor | Sequence) -> Placement:
        """A new placement equal to this one except for ``layer`` (validated)."""
        layer = check_layer_index(layer, self.num_layers)
        row = validate_layer_row(
            phy2log_row, layer, self.num_logical, self.num_ranks, self.num_slots
        )
        table = self._phy2log.clone()
        table[layer] = row
        return Placement(table, self.num_logical, self.num_ranks)

    # -- value semantics -------------------------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Placement):
            return NotImplemented
        return (
            self.num_logical == other.num_logical
            and self.num_ranks == other.num_ranks
            and torch.equal(self._phy2log, other._phy2log)
        )

    def __hash__(self) -> int:
        return hash((self.num_logical, self.num_ranks, tuple(self._phy2log.flatten().tolist())))

    def __repr__(self) -> str:
        return (
            f"Placement(layers={self.num_layers}, logical={self.num_logical}, "
            f"slots={self.num_slots}, ranks={self.num_ranks})"
        )

    # -- expert-map files (vllm-ascend JSON schema; see eplb_graph.expert_map) ----------------
    @classmethod
    def load_expert_map(cls, path: str | os.PathLike, num_logical: int | None = None) -> Placement:
        """Read and fully validate an expert-map JSON file (``num_ranks`` = its device count).

        ``num_logical`` defaults to ``max id + 1``; pass the model's N to catch experts missing
        from every layer. Raises ``ExpertMapError`` (a :class:`PlacementError`) naming the layer,
        device and slot of the first defect, or ``OSError`` if the file cannot be read.
        """
        table = expert_map.load_expert_map(path, num_logical=num_logical)
        return cls(table.phy2log, table.num_logical, table.num_ranks)

    def save_expert_map(self, path: str | os.PathLike) -> None:
        """Write this placement as an expert-map JSON file atomically (old file kept on crash)."""
        expert_map.save_expert_map(self._phy2log, self.num_logical, self.num_ranks, path)

    def summary(self) -> dict[str, Any]:
        """Facts a reviewer checks first: shape, redundancy and how replicas are spread.

        ``replicas_histogram[k]`` = number of (layer, logical expert) pairs with ``k`` replicas.
        """
        counts = self.replica_count()
        values, frequencies = torch.unique(counts, return_counts=True)
        return {
            "layers": self.num_layers,
            "devices": self.num_ranks,
            "slots_per_device": self.slots_per_rank,
            "num_slots": self.num_slots,
            "num_logical": self.num_logical,
            "num_redundant": self.num_redundant,
            "max_replicas": int(counts.max()),
            "replicas_histogram": {
                str(int(v)): int(f) for v, f in zip(values, frequencies, strict=True)
            },
        }
