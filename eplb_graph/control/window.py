"""Device ring window of per-step load passes, folded to logical space per recording placement.

Each step's load pass ``[L, P]`` (physical-slot counts written by the routing op) is copied into
row ``cursor`` of a ring ``[W, L, P]`` allocated once, and the pass is zeroed, all in place and
without a host sync. Next to every row the window keeps the committed placement that was live
while that row was recorded (an immutable host snapshot shared by all rows of one placement
version), so folding to logical experts never attributes old-placement counts to new experts.
"""

from __future__ import annotations

import torch


class LoadWindow:
    """Ring of the last ``window_size`` steps' load passes.

    Args:
        window_size: W, number of steps kept.
        num_layers, num_slots: L and P of the load pass.
        dtype, device: of the ring (same as the load pass).
    """

    def __init__(
        self,
        window_size: int,
        num_layers: int,
        num_slots: int,
        *,
        dtype: torch.dtype = torch.int64,
        device: torch.device | str = "cpu",
    ) -> None:
        if window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}")
        self.rows = torch.zeros(window_size, num_layers, num_slots, dtype=dtype, device=device)
        # Placement snapshot (phy2log [L, P], never mutated) per row; None: nothing recorded.
        self._placements: list[torch.Tensor | None] = [None] * window_size
        self.cursor = 0
        self.steps_seen = 0

    @property
    def window_size(self) -> int:
        return self.rows.shape[0]

    def fold_pass_(self, load_pass: torch.Tensor, placement: torch.Tensor, recorded: bool) -> None:
        """Move one step's load pass ``[L, P]`` into the ring (in place) and zero the pass.

        ``placement`` is the committed ``phy2log [L, P]`` snapshot the step ran under. A step that
        did not record still takes a row (zeroed): windows count steps, not recorded steps.
        """
        row = self.rows[self.cursor]
        if recorded:
            row.copy_(load_pass)
            load_pass.zero_()
            self._placements[self.cursor] = placement
        else:
            row.zero_()
            self._placements[self.cursor] = None
        self.cursor = (self.cursor + 1) % self.window_size
        self.steps_seen += 1

    def chronological_rows(self) -> list[int]:
        """Row indices from oldest to newest among the rows written so far."""
        filled = min(self.steps_seen, self.window_size)
        start = (self.cursor - filled) % self.window_size
        return [(start + i) % self.window_size for i in range(filled)]

    def physical_total(self) -> torch.Tensor:
        """``[L, P]`` sum of the window (on the window's device)."""
        return self.rows.sum(dim=0)

    def logical_samples(self, num_logical: int, num_samples: int) -> torch.Tensor:
        """Fold the window to logical experts in ``num_samples`` time buckets.

        Returns ``[S, L, N]`` int64 on the CPU, oldest bucket first, with S = min(num_samples,
        rows written). Each row is folded with the placement it was recorded under; rows that
        recorded nothing contribute zero.
        """
        rows, placements = self.snapshot()
        return fold_to_logical(rows, placements, num_logical, num_samples)

    def snapshot(self, out: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
        """The written rows in chronological order and their placements.

        ``out`` (``[W, L, P]`` on the window's device) receives the rows in place when given:
        the async path hands it to the worker without allocating and without a host sync.
        Returns ``(rows [r, L, P], placements [r])``.
        """
        order = self.chronological_rows()
        index = torch.tensor(order, dtype=torch.int64, device=self.rows.device)
        if out is None:
            rows = self.rows.index_select(0, index)
        else:
            rows = torch.index_select(self.rows, 0, index, out=out[: len(order)])
        return rows, [self._placements[row] for row in order]

    def reset_(self) -> None:
        self.rows.zero_()
        self._placements = [None] * self.window_size
        self.cursor = 0
        self.steps_seen = 0


def fold_to_logical(
    rows: torch.Tensor, placements: list, num_logical: int, num_samples: int
) -> torch.Tensor:
    """Fold chronological slot-load rows ``[r, L, P]`` to ``[S, L, N]`` int64 CPU time buckets.

    ``placements[i]`` is the ``phy2log [L, P]`` row ``i`` was recorded under (``None``: nothing
    recorded). Rows sharing a placement are folded together with one ``scatter_add_``.
    """
    count = rows.shape[0]
    num_layers = rows.shape[1]
    buckets = max(1, min(num_samples, count))
    samples = torch.zeros(buckets, num_layers, num_logical, dtype=torch.int64)
    if count == 0:
        return samples
    rows_host = rows.to("cpu", torch.int64)
    bucket_of_row = (torch.arange(count) * buckets) // count
    groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for position, placement in enumerate(placements):
        if placement is not None:
            groups.setdefault(id(placement), (placement, []))[1].append(position)
    for placement, positions in groups.values():
        index = torch.tensor(positions)
        physical = rows_host.index_select(0, index)  # [r, L, P]
        logical = torch.zeros(len(positions), num_layers, num_logical, dtype=torch.int64)
        logical.scatter_add_(2, placement.expand_as(physical), physical)
        samples.index_add_(0, bucket_of_row.index_select(0, index), logical)
    return samples
